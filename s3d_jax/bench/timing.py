"""The cost of one pass, timed inside one jitted loop, and its memory floor: the bytes the pass must
read divided by the machine's streaming bandwidth, measured by a probe. Imports JAX: only JAX
processes import it."""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np

from s3d_jax import few_rows, tree
from s3d_jax.cache import KVCache
from s3d_jax.decoding import compile_ahead
from s3d_jax.speculative import Plan, draft_s3d, verify


def pass_ms(model, pass_fn, context: int = 256, repeats: int = 20) -> float:
    """Milliseconds of one `pass_fn(params, cache, x_n)` over a cache filled to `context` positions,
    timed inside one jitted loop (no dispatch overhead). The input token changes every iteration,
    so XLA cannot hoist the pass out of the loop."""
    cache = KVCache.zeros(model.config, 1, max(512, context + 16)).replace(lengths=jnp.asarray([context], jnp.int32))

    def loop(params, cache, few_row_kernel):
        def body(i, total):
            return total + pass_fn(params, cache, jnp.full((1,), i % 1000, jnp.int32)).sum()

        with few_rows.switch(few_row_kernel):
            return jax.lax.fori_loop(0, repeats, body, jnp.zeros((), jnp.float32))

    # Compiled as the decode loop is; not kept in its cache, since `loop` closes over `pass_fn`.
    fn, _ = compile_ahead(jax.jit(loop, static_argnames="few_row_kernel"), model.params, cache, few_row_passes=True)
    jax.block_until_ready(fn(model.params, cache))  # warm up
    start = time.perf_counter()
    jax.block_until_ready(fn(model.params, cache))
    return (time.perf_counter() - start) / repeats * 1e3


def verify_ms(model, tokens: int, **timing) -> float:
    """A full-model pass over `tokens` tokens (1 is a plain decoding step)."""
    drafts = jnp.zeros((1, tokens - 1), jnp.int32)
    return pass_ms(model, lambda p, c, x_n: verify(p, model.config, c, x_n, drafts)[0], **timing)


def draft_ms(model, skip, gamma: int, **timing) -> float:
    """One S3D draft pass of `gamma` tokens through the layers outside `skip`, its head also scoring a
    context as long as the cache, as in decoding."""
    plan = Plan.make(model.config, "s3d", gamma, skip)

    def draft_pass(p, c, x_n):
        context = (x_n[:, None] + jnp.arange(c.max_len)) % model.config.vocab_size  # distinct ids, as a real context gathers
        return draft_s3d(p, model.config, plan, c, x_n, jax.random.key(0), context)[1]

    return pass_ms(model, draft_pass, **timing)


def tree_verify_ms(model, size: int, gamma: int, **timing) -> float:
    """Building a tree of `size` nodes from γ draft distributions, and its full-model verify pass."""
    config = model.config
    logits = jax.random.normal(jax.random.key(0), (1, gamma, config.vocab_size))
    if config.mask_token_id is not None:
        logits = logits.at[..., config.mask_token_id].set(-jnp.inf)

    def build_and_verify(p, c, x_n):
        # Shifted by x_n (softmax ignores a shift), so XLA cannot fold the tree's top-k into a constant.
        nodes = tree.build(x_n, logits + x_n[:, None, None].astype(jnp.float32), size)
        return tree.verify(p, config, c, nodes, gamma)[0]

    return pass_ms(model, build_and_verify, **timing)


def bandwidth_gb_s(nbytes: int, repeats: int = 10) -> float:
    """Streaming read bandwidth in GB/s: the best of `repeats` matrix-vector products over a float32
    buffer of `nbytes` (size it like the weights, so no cache holds it). A matrix-vector product reads
    each byte once on every core, as a decoding step does; a plain sum would run on one core."""
    rows = max(nbytes // (4 * 1024), 1)
    buffer, vector = jnp.ones((rows, 1024), jnp.float32), jnp.ones((1024,), jnp.float32)
    product = jax.jit(jnp.dot)
    jax.block_until_ready(product(buffer, vector))
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(product(buffer, vector))
        best = min(best, time.perf_counter() - start)
    return buffer.nbytes / best / 1e9


def pass_bytes(params, config, layers, context: int, draft: bool = False) -> int:
    """What a cached pass through `layers` must read at least: those layers' weights (with the LoRA
    adapters in a draft pass), the head (the reduced draft head in a draft pass that has one, else the
    tied embedding or the LM head) and the final norm, and the cached keys and values of `layers`
    over `context` positions."""
    if draft and config.draft_vocab_size:
        head = params["draft_head"]
    else:
        head = params["embed"] if config.tie_embeddings else params["lm_head"]
    weights = sum(x.nbytes for i in layers for path, x in jax.tree_util.tree_leaves_with_path(params[f"layer_{i}"])
                  if draft or "_lora" not in jax.tree_util.keystr(path))
    weights += head.nbytes + sum(x.nbytes for x in jax.tree.leaves(params["final_norm"]))
    cache = 2 * len(layers) * config.num_kv_heads * config.head_dim * context * np.dtype(config.jnp_dtype).itemsize
    return int(weights + cache)
