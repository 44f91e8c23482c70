"""How many matrix products each decode pass launches, counted in the traced passes of every family:
q, k, v as one product and gate, up as another, and each fused projection's draft adapter as one A
and one B product (`model`); on a CPU the A product shares its projection's kernel call."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from reference import tiny_model

from s3d_jax import quant
from s3d_jax.cache import KVCache
from s3d_jax.calibration import draft_pass, verify_pass
from s3d_jax.checkpoint import Model
from s3d_jax.kernel import ffi

FAMILIES = {
    "llama": {},
    "mistral": dict(architecture="mistral", sliding_window=5),
    "phi3": dict(architecture="phi3"),
    "qwen2": dict(architecture="qwen2", qkv_bias=True),
    "qwen3": dict(architecture="qwen3", qk_norm=True),
    "gemma2": dict(architecture="gemma2", hidden_act="gelu_pytorch_tanh", norm_plus_one=True, post_norms=True,
                   scale_embeddings=True, attn_softcap=50.0, final_softcap=30.0, sliding_window=5),
    "gemma3_text": dict(architecture="gemma3_text", hidden_act="gelu_pytorch_tanh", norm_plus_one=True, post_norms=True,
                        scale_embeddings=True, qk_norm=True, sliding_window=5),
}
PROJECTIONS = 4  # per layer: qkv, o, gate_up, down
ATTENTION = 4  # scores and values, against the cache and against the block itself
ONE_TOKEN_ATTENTION = 2  # a plain step's token against its own key is a product and sum, no matmul
SKIP, GAMMA = (2, 3), 3


def products(fn, *args, kernel: bool = False) -> int:
    """`dot_general`s in the jaxpr of `fn(*args)`, inside loops, conditionals and calls too, with every
    product on XLA's dot; or with `kernel`, the CPU kernel's product calls instead (each call counted
    once, whatever weights it reads). A `scan`'s body (the loop over the layers) counts once per turn."""
    with ffi.switch(kernel):
        jaxpr = jax.make_jaxpr(fn)(*args).jaxpr
    targets = (ffi.TARGET, ffi.TARGET_INT8, ffi.TARGET_INT4) if kernel else ()

    def count(jaxpr) -> int:
        total = 0
        for eqn in jaxpr.eqns:
            if kernel:
                total += eqn.primitive.name == "ffi_call" and eqn.params["target_name"] in targets
            else:
                total += eqn.primitive.name == "dot_general"
            turns = eqn.params["length"] if eqn.primitive.name == "scan" else 1
            for sub in jax.core.jaxprs_in_params(eqn.params):
                total += turns * count(sub)
        return total

    return count(jaxpr)


@pytest.mark.parametrize("family", FAMILIES)
def test_a_plain_step_makes_one_product_per_fused_projection(family):
    model = tiny_model(draft_lora_rank=4, draft_skip=SKIP, **FAMILIES[family])
    cache = KVCache.zeros(model.config, 1, 32)
    x_n = jnp.zeros((1,), jnp.int32)
    layers = model.config.num_layers
    assert products(verify_pass(model, 1), model.params, cache, x_n) == layers * (PROJECTIONS + ONE_TOKEN_ATTENTION) + 1  # + the head
    assert products(verify_pass(model, 3), model.params, cache, x_n) == layers * (PROJECTIONS + ATTENTION) + 1
    # A draft layer adds its adapters' two products per projection (separate adapters made six for qkv).
    draft_layers = len(model.config.draft_layers(SKIP))
    drafted = products(draft_pass(model, SKIP, GAMMA), model.params, cache, x_n)
    assert drafted == draft_layers * (3 * PROJECTIONS + ATTENTION) + 1


@pytest.mark.skipif(not ffi.available(), reason="no few-row kernel on this machine")
@pytest.mark.parametrize("dtype", ["float32", "int8", "int4"])
def test_a_draft_layer_calls_the_kernel_twice_per_projection(dtype):
    """On a CPU each adapter's A factor is read in its projection's kernel call, so a draft layer's
    products are two calls per projection (the projection with A, then B), a plain step's one."""
    model = tiny_model(draft_lora_rank=4, draft_skip=SKIP, hidden_size=64, intermediate_size=96, num_heads=2, num_kv_heads=1, head_dim=32)
    if dtype != "float32":
        model = Model(quant.quantize_params(model.params, dtype), model.config.replace(dtype=dtype))
    cache = KVCache.zeros(model.config, 1, 32)
    x_n = jnp.zeros((1,), jnp.int32)
    layers, draft_layers = model.config.num_layers, len(model.config.draft_layers(SKIP))
    assert products(verify_pass(model, 1), model.params, cache, x_n, kernel=True) == layers * PROJECTIONS + 1
    assert products(draft_pass(model, SKIP, GAMMA), model.params, cache, x_n, kernel=True) == draft_layers * 2 * PROJECTIONS + 1
