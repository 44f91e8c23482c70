"""The real SmolLM2 in int8 and int4 with its shipped drafter (a file of its own, so that the test
processes share the slow real-model tests evenly)."""

import numpy as np
import pytest
from reference import assert_exact
from test_smollm2 import CHATS, NEW_TOKENS

import s3d_jax
from s3d_jax import bundled, drafter, quant

pytestmark = pytest.mark.slow


# One S3D loop each, a chain at int8 and a tree of 16 at int4 (passes of more rows than one of the
# kernel's sweeps): test_quant.py runs both kinds at both precisions on random weights.
@pytest.mark.parametrize("dtype, tree", [("int8", 0), ("int4", 16)])
def test_quantized_with_the_shipped_drafter_is_exact_and_close_to_float32(dtype, tree, smollm2_dir):
    """int8 quantized at load, and int4 from the GGUF's own Q4_1 blocks (the weights float32 holds
    dequantized): the shipped drafter still applies, S3D reproduces plain greedy output at that
    precision, and its logits stay near float32's."""
    base = s3d_jax.load(smollm2_dir, dtype="int8") if dtype == "int8" else bundled.load(dtype="int4")
    quantized = drafter.apply(base, bundled.DRAFTER)
    assert quant.bits_of(quantized.params["layers"]["mlp"]["down"]) == quant.DTYPE_FORMATS[dtype].bits
    assert quantized.params["embed"]["values"].dtype == "int8" and quantized.params["draft_head"]["values"].dtype == "int8"
    # Drafting at every iteration (no calibration: a minute that checks nothing here).
    _, plain = assert_exact(quantized, CHATS, chat=True, max_new_tokens=NEW_TOKENS, min_certainty=0.0, tree=tree)
    ids = plain.tokens[0][:32]  # the logits stay near float32's on real text
    float_logits, quantized_logits = np.asarray(s3d_jax.logits(s3d_jax.load(smollm2_dir), ids)), np.asarray(s3d_jax.logits(quantized, ids))
    # int8 rounds the weights (0.035 measured on a reply); int4 holds float32's own weights, summed in another order.
    bound = 0.1 if dtype == "int8" else 1e-3
    assert np.abs(quantized_logits - float_logits).max() < bound * np.abs(float_logits).max()


def test_bfloat16_with_the_shipped_drafter_is_exact(smollm2_dir):
    """bfloat16 weights compute in float32 (activations and cache), so S3D with a tree and the context
    branch reproduces plain greedy at that precision. With bfloat16 activations and cache it did not:
    a verify pass's last-bit differences from a step, rounded to 16 bits, became visible ones."""
    import jax.numpy as jnp

    model = drafter.apply(s3d_jax.load(smollm2_dir, dtype="bfloat16"), bundled.DRAFTER)
    assert model.params["layers"]["mlp"]["down"].dtype == jnp.bfloat16
    new_tokens = 2 * NEW_TOKENS
    assert_exact(model, CHATS, chat=True, max_new_tokens=new_tokens, min_certainty=0.0, tree=4, lookup=True)


def test_int4_with_int8_activations_is_exact():
    """int8 activations round each row's input to a product (kernel/cc/int8_rows.h, `Int8Rows`): a verify pass's
    rows equal one-token steps bit for bit, so a last-bit difference never becomes a rounding step, and
    S3D with a tree and the context branch reproduces plain greedy at that precision too."""
    model = drafter.apply(s3d_jax.load(dtype="int4", activations="int8"), bundled.DRAFTER)
    assert model.config.activations == "int8"
    assert_exact(model, CHATS, chat=True, max_new_tokens=NEW_TOKENS, min_certainty=0.0, tree=8, lookup=True)
