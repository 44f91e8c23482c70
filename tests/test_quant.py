"""Weight-only int8 (`s3d_jax/quant.py`): the groups, the kernel's products, token-exact decoding, and
int8 model directories."""

import dataclasses
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from reference import tiny_model

import s3d_jax
from s3d_jax import checkpoint, few_rows, quant
from s3d_jax.config import ConfigError

needs_kernel = pytest.mark.skipif(
    shutil.which(os.environ.get("CXX", "c++")) is None or not few_rows.env_switch(few_rows.ENV_SWITCH),
    reason="no C++ compiler, or the kernel switched off",
)
# The projections' inputs (hidden 64, head_dim 32, MLP 96) are whole groups of 32.
SHAPE = dict(hidden_size=64, intermediate_size=96, num_heads=2, num_kv_heads=1, head_dim=32)


def as_int8(model):
    return dataclasses.replace(model, params=quant.quantize_params(model.params), config=model.config.replace(dtype="int8"))


def dequantized(model):
    """The float32 model that an int8 model stands for."""
    return dataclasses.replace(model, params=quant.dequantize_params(model.params), config=model.config.replace(dtype="float32"))


@pytest.fixture(scope="module")
def int8_model():
    return as_int8(tiny_model(seed=3, **SHAPE))


def random(shape, seed):
    return np.random.default_rng(seed).standard_normal(shape, dtype=np.float32)


def test_each_group_is_rounded_to_its_own_scale():
    w = random((96, 3, 5), 0)
    w[32:64, 1, 2] = 0.0  # a group of zeros quantizes to zeros, not to NaN
    w[0, 0, 0] = 50.0  # an outlier moves its own group's scale only
    q = quant.quantize(w, 1)
    assert q["values"].dtype == np.int8 and q["values"].shape == w.shape
    assert q["scale"].shape == (3, 3, 5)
    assert np.abs(q["values"]).max() == 127
    back = np.asarray(quant.dequantize(q, 1))
    bound = np.repeat(q["scale"], 32, axis=0) / 2
    assert np.all(np.abs(back - w) <= bound * (1 + 1e-6))
    assert np.all(back[32:64, 1, 2] == 0)
    assert np.isclose(q["scale"][0, 0, 0], 50.0 / 127, rtol=1e-6) and q["scale"][0, 0, 1] < 0.1
    on_device = quant.quantize(jnp.asarray(w), 1)  # the host's and the device's rounding agree
    np.testing.assert_array_equal(np.asarray(on_device["values"]), q["values"])


def test_a_weight_whose_input_is_not_whole_groups_is_refused():
    with pytest.raises(ValueError, match="not a multiple of 32"):
        quant.quantize(random((48, 8), 0), 1)
    with pytest.raises(ConfigError, match="hidden_size of 48 is not a multiple of 32"):
        tiny_model(dtype="int8")


@needs_kernel
@pytest.mark.parametrize("rows,k,n", [(1, 576, 1536), (5, 1536, 576), (16, 64, 300), (3, 96, 40)])
def test_int8_products_are_those_of_the_dequantized_weight_whatever_the_rows(rows, k, n):
    """Bit for bit, in the kernel: so an int8 model's S3D passes round as its plain steps do."""
    q = jax.tree.map(jnp.asarray, quant.quantize(random((k, n), 1) * 0.05, 1))
    x = jnp.asarray(random((rows, k), 2))
    assert few_rows.applies(rows, x.dtype, q["values"].dtype)
    product = jax.jit(few_rows.matmul)
    got = np.asarray(product(x, q))
    np.testing.assert_array_equal(got, np.asarray(product(x, quant.dequantize(q, 1))))
    np.testing.assert_array_equal(got[:1], np.asarray(product(x[:1], q)))  # alone or beside others
    np.testing.assert_allclose(got, np.asarray(x, np.float64) @ np.asarray(quant.dequantize(q, 1), np.float64), rtol=1e-4, atol=1e-4)


def test_more_rows_and_gradients_use_the_dequantized_weight():
    q = jax.tree.map(jnp.asarray, quant.quantize(random((2, 32, 24), 3), 2))
    dense = quant.dequantize(q, 2)
    x = jnp.asarray(random((40, 2, 32), 4))  # more rows than the kernel takes: XLA's dot
    np.testing.assert_allclose(few_rows.matmul(x, q, 2), jnp.tensordot(x, dense, 2), rtol=1e-5, atol=1e-5)
    few = x[:3]
    grad = jax.grad(lambda x: few_rows.matmul(x, q, 2).sum())(few)
    np.testing.assert_allclose(grad, jax.grad(lambda x: jnp.tensordot(x, dense, 2).sum())(few), rtol=1e-5, atol=1e-5)


def test_an_int8_model_is_the_float_model_of_its_dequantized_weights(int8_model):
    ids = np.random.default_rng(0).integers(0, 90, (2, 9))
    # More rows than the kernel takes: XLA's dot, which may sum a dequantized weight in another order.
    np.testing.assert_allclose(s3d_jax.logits(int8_model, ids), s3d_jax.logits(dequantized(int8_model), ids), rtol=1e-5, atol=1e-5)
    prompt = [5, 17, 3, 40]
    got = s3d_jax.decode(int8_model, prompt, method="ar", max_new_tokens=16, eos_token_ids=())
    want = s3d_jax.decode(dequantized(int8_model), prompt, method="ar", max_new_tokens=16, eos_token_ids=())
    assert got.tokens == want.tokens


@pytest.mark.parametrize("options", [
    dict(method="s3d", gamma=3, skip=(1, 4), tree=0),
    dict(method="s3d", gamma=3, skip=(2, 3), tree=4),
    dict(method="selfspec", gamma=4, skip=(1, 4)),
    dict(method="s3d", gamma=2, skip=(1, 4), tree=6, lookup=True),
])
def test_int8_speculative_greedy_equals_plain_greedy(int8_model, options):
    prompts = [[5, 17, 3, 40], [9, 9, 2], [1, 2, 3, 4, 5, 6, 7, 8, 1, 2, 3, 4]]
    plain = s3d_jax.decode(int8_model, prompts, method="ar", max_new_tokens=24, eos_token_ids=())
    spec = s3d_jax.decode(int8_model, prompts, max_new_tokens=24, eos_token_ids=(), min_certainty=0.0, **options)
    assert spec.tokens == plain.tokens
    assert sum(spec.stats.iterations) < sum(plain.stats.iterations)  # drafts were accepted: the check exercised them


def test_an_int8_directory_saves_loads_and_converts_both_ways(int8_model, tmp_path):
    float_model = dequantized(int8_model)
    checkpoint.save(tmp_path / "int8", int8_model.params, int8_model.config)
    checkpoint.save(tmp_path / "float", float_model.params, float_model.config)
    loaded = checkpoint.load(tmp_path / "int8")
    assert loaded.config.dtype == "int8"
    jax.tree.map(np.testing.assert_array_equal, loaded.params, int8_model.params)
    as_float = checkpoint.load(tmp_path / "int8", dtype="float32")
    jax.tree.map(np.testing.assert_array_equal, as_float.params, float_model.params)
    requantized = checkpoint.load(tmp_path / "float", dtype="int8")  # the float values of int8 ones quantize back to them
    jax.tree.map(lambda got, want: np.testing.assert_allclose(got, want, rtol=1e-6), requantized.params, int8_model.params)
    layer = requantized.params["layer_0"]
    assert layer["mlp"]["down"]["values"].dtype == jnp.int8 and layer["attn_norm"]["scale"].dtype == jnp.float32


def test_a_model_that_cannot_be_quantized_is_refused_before_its_weights_are_read(tmp_path):
    model = tiny_model(seed=1)  # hidden size 48
    checkpoint.save(tmp_path / "m", model.params, model.config)
    with pytest.raises(ConfigError, match="dtype int8 .* hidden_size of 48"):
        checkpoint.load(tmp_path / "m", dtype="int8")


def test_a_hugging_face_model_converts_to_int8(tmp_path):
    pytest.importorskip("torch")
    from hf_models import hf_logits, random_hf_model, relative_error

    from s3d_jax.convert import convert, export_hf

    hf = random_hf_model("llama", heads=2, kv_heads=1)  # hidden 64, head_dim 32, MLP 96
    hf.save_pretrained(tmp_path / "hf")
    out = convert(tmp_path / "hf", tmp_path / "int8", dtype="int8", progress=False)
    convert(tmp_path / "hf", tmp_path / "f32", progress=False)
    model = s3d_jax.load(out)
    assert model.config.dtype == "int8"
    jax.tree.map(np.testing.assert_array_equal, model.params, checkpoint.load(tmp_path / "f32", dtype="int8").params)
    ids = np.random.default_rng(1).integers(0, 96, (2, 12))
    reference = hf_logits(hf, ids)
    error = relative_error(np.asarray(s3d_jax.logits(model, ids))[..., : reference.shape[-1]], reference)
    assert 1e-4 < error < 5e-2  # int8's rounding, and no more
    exported = export_hf(model, tmp_path / "back")  # dequantized, as float32
    back = s3d_jax.load(convert(exported, tmp_path / "again", progress=False))
    np.testing.assert_array_equal(np.asarray(s3d_jax.logits(back, ids)), np.asarray(s3d_jax.logits(dequantized(model), ids)))
