"""Weight-only int8 and int4 (`s3d_jax/quant.py`): the groups, the kernel's products, token-exact
decoding, and quantized model directories."""

import dataclasses
import os
import shutil
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from reference import assert_exact, layer_params, tiny_model

import s3d_jax
from s3d_jax import checkpoint, quant
from s3d_jax.config import ConfigError
from s3d_jax.kernel import dispatch, ffi

needs_kernel = pytest.mark.skipif(
    shutil.which(os.environ.get("CXX", "c++")) is None or not ffi.switched_on(),
    reason="no C++ compiler, or the kernel switched off",
)
# The projections' inputs (hidden 64, head_dim 32, MLP 96) are whole groups of 32.
SHAPE = dict(hidden_size=64, intermediate_size=96, num_heads=2, num_kv_heads=1, head_dim=32)


def as_quantized(model, dtype):
    return dataclasses.replace(model, params=quant.quantize_params(model.params, dtype), config=model.config.replace(dtype=dtype))


def dequantized(model):
    """The float32 model that an int8 model stands for."""
    return dataclasses.replace(model, params=quant.dequantize_params(model.params), config=model.config.replace(dtype="float32"))


@pytest.fixture(scope="module", params=["int8", "int4"])
def quantized_model(request):
    return as_quantized(tiny_model(seed=0, **SHAPE), request.param)


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


def test_int4_groups_hold_a_scale_and_a_minimum():
    w = random((64, 3), 5)
    w[:32, 1] = 0.25  # a constant group is exact: its scale is zero
    q = quant.quantize(w, 1, quant.INT4)
    assert q["values"].dtype == np.uint8 and q["values"].shape == (32, 3)
    assert q["scale"].dtype == q["min"].dtype == np.float16 and q["scale"].shape == (2, 3)
    codes = quant.unpack_nibbles(q["values"], 1)
    assert codes.min() == 0 and codes.max() == 15
    back = np.asarray(quant.dequantize(q, 1))
    assert np.all(back[:32, 1] == 0.25)
    even, odd = quant.dequantize_nibbles(q, 1)  # the same entries, the two nibbles' rows apart
    np.testing.assert_array_equal(np.asarray(even), back[0::2])
    np.testing.assert_array_equal(np.asarray(odd), back[1::2])
    bound = np.repeat(q["scale"].astype(np.float32), 32, axis=0) / 2 + np.abs(w) * 2e-3  # and the float16 minimum
    assert np.all(np.abs(back - w) <= bound)
    np.testing.assert_array_equal(quant.pack_nibbles(codes, 1), q["values"])
    on_device = quant.quantize(jnp.asarray(w), 1, quant.INT4)
    jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, on_device), q)


@needs_kernel
@pytest.mark.parametrize("fmt", ["int8", "int4", "int8-g16-min", "int4-f32"])
@pytest.mark.parametrize("rows,k,n", [(1, 576, 1536), (5, 1536, 576), (16, 64, 300), (3, 96, 40)])
def test_quantized_products_do_not_depend_on_the_rows_beside_them(fmt, rows, k, n):
    """Bit for bit, in the kernel: so a quantized model's S3D passes round as its plain steps do. The
    kernel sums codes and scales once per group, so it equals the dequantized weight's product up to
    float32 rounding."""
    q = jax.tree.map(jnp.asarray, quant.quantize(random((k, n), 1) * 0.05, 1, quant.Format.parse(fmt)))
    x = jnp.asarray(random((rows, k), 2))
    assert dispatch.applies(rows, x.dtype, q["values"].dtype)
    product = jax.jit(dispatch.matmul)
    got = np.asarray(product(x, q))
    for t in range(rows):  # alone, and beside others
        np.testing.assert_array_equal(got[t:t + 1], np.asarray(product(x[t:t + 1], q)))
    exact = np.asarray(x, np.float64) @ np.asarray(quant.dequantize(q, 1), np.float64)
    np.testing.assert_allclose(got, exact, rtol=1e-4, atol=1e-5 * np.sqrt(k))


@pytest.mark.parametrize("fmt", ["int8", "int4", "int8-g16-min", "int4-f32"])
def test_more_rows_and_gradients_use_the_dequantized_weight(fmt):
    q = jax.tree.map(jnp.asarray, quant.quantize(random((2, 32, 24), 3), 2, quant.Format.parse(fmt)))
    dense = quant.dequantize(q, 2)
    x = jnp.asarray(random((dispatch.MAX_NARROW_ROWS + 16, 2, 32), 4))  # more rows than the kernel takes: XLA's dot
    assert not dispatch.applies(x.shape[0], x.dtype, q["values"].dtype)
    np.testing.assert_allclose(dispatch.matmul(x, q, 2), jnp.tensordot(x, dense, 2), rtol=1e-5, atol=1e-5)
    stack = jax.tree.map(lambda part: jnp.stack([part * 0, part]), q)  # entry `at` of a stack, as the layers read it
    np.testing.assert_allclose(dispatch.matmul(x, stack, 2, at=jnp.int32(1)), jnp.tensordot(x, dense, 2), rtol=1e-5, atol=1e-5)
    few = x[:3]
    grad = jax.grad(lambda x: dispatch.matmul(x, q, 2).sum())(few)
    np.testing.assert_allclose(grad, jax.grad(lambda x: jnp.tensordot(x, dense, 2).sum())(few), rtol=1e-5, atol=1e-5)


def int8_activation_product(x, q):
    """The product that int8 activations define (kernel/cc/int8_rows.h, `Int8Rows`), in float64: each row's x
    quantized per block of 16 to round(x * 127 / max|x|), integer sums of codes, then the block's scales."""
    values = np.asarray(q["values"])
    codes = (quant.unpack_nibbles(values, 1) if values.dtype == np.uint8 else values).astype(np.int64)  # [K, N]
    group = codes.shape[0] // q["scale"].shape[0]
    low = q["min"] if "min" in q else np.zeros_like(q["scale"])
    scale, low = (np.repeat(np.asarray(v, np.float64), group // 16, axis=0) for v in (q["scale"], low))  # per block
    blocks = x.reshape(x.shape[0], -1, 16)  # float32, as the kernel rounds them
    largest = np.abs(blocks).max(-1, keepdims=True)
    inverse = np.where(largest > 0, np.float32(127) / np.where(largest > 0, largest, 1), np.float32(0))
    x_codes = np.rint(blocks * inverse).astype(np.int64)
    sums = np.einsum("tbi,bin->tbn", x_codes, codes.reshape(-1, 16, codes.shape[1]))
    return (np.einsum("tbn,bn->tn", sums * (largest.astype(np.float64) / 127), scale)
            + np.einsum("tb,bn->tn", blocks.astype(np.float64).sum(-1), low))


@needs_kernel
@pytest.mark.parametrize("fmt", ["int4", "int4-f32", "int4-g16", "int8", "int8-g16-min"])
@pytest.mark.parametrize("rows", [1, 5, 13])
def test_int8_activations_sum_each_rows_quantized_activations_exactly(fmt, rows):
    """`activations="int8"`: a quantized weight's product is the integer product of each row's int8 codes
    (to float32 rounding), a row's result the same alone and beside others, and within about 1% of the
    float product. 40 columns: two vectors of 16 and 8 in the scalar tail."""
    k = 96
    q = jax.tree.map(jnp.asarray, quant.quantize(random((k, 40), 1), 1, quant.Format.parse(fmt)))
    x = random((rows, k), 2)
    x[0, :16] = 0.0  # a block of zeros: codes and scale 0, not NaN
    product = jax.jit(lambda x, w: dispatch.matmul(x, w, activations="int8"))
    got = np.asarray(product(x, q))
    np.testing.assert_allclose(got, int8_activation_product(x, q), rtol=1e-5, atol=1e-5)
    for t in range(rows):
        np.testing.assert_array_equal(got[t:t + 1], np.asarray(product(x[t:t + 1], q)))
    exact = np.asarray(x, np.float64) @ np.asarray(quant.dequantize(q, 1), np.float64)
    assert 0 < np.abs(got - exact).max() < 0.02 * np.abs(exact).max()


def test_int8_activations_keep_quantized_speculative_greedy_exact(quantized_model):
    """Int8 activations change a quantized model's numbers, and S3D, trees and the context branch still
    reproduce plain greedy decoding of that model token for token."""
    model = dataclasses.replace(quantized_model, config=quantized_model.config.replace(activations="int8"))
    prompts = [[5, 17, 3, 40], [1, 2, 3, 4, 5, 6, 7, 8, 1, 2, 3, 4]]
    for options in (dict(gamma=3, skip=(1, 4), tree=0), dict(gamma=2, skip=(1, 4), tree=6, lookup=True)):
        assert_exact(model, prompts, method="s3d", max_new_tokens=24, eos_token_ids=(), min_certainty=0.0, **options)
    ids = np.random.default_rng(0).integers(0, 90, (1, 3))  # a few rows: the kernel's products
    moved = np.abs(np.asarray(s3d_jax.logits(model, ids)) - np.asarray(s3d_jax.logits(quantized_model, ids))).max()
    assert (moved > 0) == ffi.available()


def test_a_quantized_model_is_the_float_model_of_its_dequantized_weights(quantized_model):
    ids = np.random.default_rng(0).integers(0, 90, (2, 9))
    # More rows than the kernel takes: XLA's dot, which may sum a dequantized weight in another order.
    np.testing.assert_allclose(s3d_jax.logits(quantized_model, ids), s3d_jax.logits(dequantized(quantized_model), ids),
                               rtol=1e-5, atol=1e-5)
    prompt = [5, 17, 3, 40]
    got = s3d_jax.decode(quantized_model, prompt, method="ar", max_new_tokens=16, eos_token_ids=())
    want = s3d_jax.decode(dequantized(quantized_model), prompt, method="ar", max_new_tokens=16, eos_token_ids=())
    assert got.tokens == want.tokens  # a random model's logits are far apart enough for float32 rounding


@pytest.mark.parametrize("options", [
    dict(method="s3d", gamma=3, skip=(1, 4), tree=0),
    dict(method="s3d", gamma=3, skip=(2, 3), tree=4),
    dict(method="selfspec", gamma=4, skip=(1, 4)),
    dict(method="s3d", gamma=2, skip=(1, 4), tree=6, lookup=True),
])
def test_quantized_speculative_greedy_equals_plain_greedy(quantized_model, options):
    prompts = [[5, 17, 3, 40], [9, 9, 2], [1, 2, 3, 4, 5, 6, 7, 8, 1, 2, 3, 4]]
    spec, plain = assert_exact(quantized_model, prompts, max_new_tokens=24, eos_token_ids=(), min_certainty=0.0, **options)
    assert sum(spec.stats.iterations) < sum(plain.stats.iterations)  # drafts were accepted: the check exercised them


def test_quantized_speculative_greedy_is_exact_on_xlas_dot_too(quantized_model, monkeypatch):
    """With the kernel switched off every product dequantizes into XLA's dot, as on a GPU."""
    monkeypatch.setenv(ffi.ENV_SWITCH, "0")
    prompts = [[5, 17, 3, 40], [9, 9, 2]]
    assert_exact(quantized_model, prompts, method="s3d", max_new_tokens=16, eos_token_ids=(), min_certainty=0.0, gamma=3, skip=(1, 4),
                 tree=4)
    product = jax.jit(lambda x, w: dispatch.matmul(x, w, at=0))
    lowered = product.lower(jnp.ones((1, 64)), quantized_model.params["layers"]["mlp"]["gate_up"]).as_text()
    assert "custom_call" not in lowered


def test_a_quantized_directory_saves_loads_and_converts_both_ways(quantized_model, tmp_path):
    dtype, other = quantized_model.config.dtype, {"int8": "int4", "int4": "int8"}[quantized_model.config.dtype]
    float_model = dequantized(quantized_model)
    checkpoint.save(tmp_path / dtype, quantized_model.params, quantized_model.config)
    checkpoint.save(tmp_path / "float", float_model.params, float_model.config)
    loaded = checkpoint.load(tmp_path / dtype)
    assert loaded.config.dtype == dtype
    jax.tree.map(np.testing.assert_array_equal, loaded.params, quantized_model.params)
    as_float = checkpoint.load(tmp_path / dtype, dtype="float32")
    jax.tree.map(np.testing.assert_array_equal, as_float.params, float_model.params)
    # The float values of quantized ones quantize back to them (int4's codes may move by one where a
    # float16 minimum rounded up).
    requantized = checkpoint.load(tmp_path / "float", dtype=dtype)
    jax.tree.map(lambda got, want: np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-3),
                 quant.dequantize_params(requantized.params), quant.dequantize_params(quantized_model.params))
    layer = layer_params(requantized.params, 0)
    assert layer["mlp"]["down"]["values"].dtype == {"int8": jnp.int8, "int4": jnp.uint8}[dtype]
    assert layer["attn_norm"]["scale"].dtype == jnp.float32
    assert requantized.params["embed"]["values"].dtype == jnp.int8  # the vocabulary tables are int8 in both
    converted = checkpoint.load(tmp_path / dtype, dtype=other)  # one quantized format to the other, from float32
    down = layer_params(converted.params, 0)["mlp"]["down"]
    assert converted.config.dtype == other and quant.format_of(down, 1) == quant.DTYPE_FORMATS[other]


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
    loaded = checkpoint.load(tmp_path / "f32", dtype="int8")
    mask = model.config.mask_token_id  # its row, the mean embedding, is taken from the int8 table: close, not equal
    keep = np.arange(model.config.vocab_size) != mask
    for k in ("values", "scale"):
        np.testing.assert_array_equal(model.params["embed"][k][:, keep], loaded.params["embed"][k][:, keep])
    np.testing.assert_allclose(quant.dense(model.params["embed"])[:, mask], quant.dense(loaded.params["embed"])[:, mask],
                               atol=2 * float(np.max(model.params["embed"]["scale"][:, mask])))  # a rounding step apart
    rest = lambda params: {k: v for k, v in params.items() if k != "embed"}  # noqa: E731
    jax.tree.map(np.testing.assert_array_equal, rest(model.params), rest(loaded.params))
    ids = np.random.default_rng(1).integers(0, 96, (2, 12))
    reference = hf_logits(hf, ids)
    error = relative_error(np.asarray(s3d_jax.logits(model, ids))[..., : reference.shape[-1]], reference)
    assert 1e-4 < error < 5e-2  # int8's rounding, and no more
    exported = export_hf(model, tmp_path / "back")  # dequantized, as float32
    back = s3d_jax.load(convert(exported, tmp_path / "again", progress=False))
    np.testing.assert_array_equal(np.asarray(s3d_jax.logits(back, ids)), np.asarray(s3d_jax.logits(dequantized(model), ids)))


# A GGUF of one block type per projection (two for the stacks whose layers differ, as Q4_K_M's do),
# and the formats int4 and int8 hold them in: the narrowest that holds every layer's blocks exactly.
GGUF_TYPES = {"attn_q": ("Q4_0", "Q4_0"), "attn_k": ("Q5_0", "Q5_0"), "attn_v": ("Q8_0", "Q6_K"), "attn_output": ("Q4_K", "Q4_K"),
              "ffn_gate": ("Q5_1", "Q5_1"), "ffn_up": ("Q4_1", "Q4_1"), "ffn_down": ("Q4_K", "Q6_K"), "token_embd": ("Q5_K",)}
KEPT_FORMATS = {"int4": {"qkv": "int8-g16-min", "o": "int4-f32", "gate_up": "int8-min", "down": "int8-g16-min", "embed": "int8-min"},
                "int8": {"qkv": "int8-g16-min", "o": "int8-min", "gate_up": "int8-min", "down": "int8-g16-min", "embed": "int8-min"}}


@pytest.fixture(scope="module")
def typed_gguf(tmp_path_factory):
    """A random Qwen3 whose projections are stored in each block type of `GGUF_TYPES`, with what gguf's
    own dequantization makes of each tensor, and the float32 model converted from it."""
    pytest.importorskip("torch")
    import gguf
    from hf_models import random_family_model
    from test_families import write_gguf

    from s3d_jax.convert import convert

    path = tmp_path_factory.mktemp("typed") / "m.gguf"
    hf = random_family_model("qwen3", tie_word_embeddings=True, hidden_size=256, intermediate_size=512, num_attention_heads=4,
                             num_key_value_heads=2, head_dim=64, num_hidden_layers=2)

    def block_type(name, w):
        kinds = next((kinds for key, kinds in GGUF_TYPES.items() if key in name), None)
        return None if w.ndim == 1 or kinds is None else kinds[int(name.split(".")[1]) if name.startswith("blk.") else 0]

    write_gguf(hf, path, "qwen3", block_type)
    shipped = {t.name: gguf.quants.dequantize(t.data, t.tensor_type) for t in gguf.GGUFReader(str(path)).tensors}
    return path, shipped, s3d_jax.load(convert(path, path.parent / "f32", progress=False))


@pytest.mark.filterwarnings("ignore:no tokenizer")
@pytest.mark.parametrize("dtype", ["int4", "int8"])
def test_gguf_blocks_are_kept_exactly_in_the_narrowest_format_that_holds_them(typed_gguf, dtype):
    """Q4_0, Q4_1, Q4_K, Q5_0, Q5_1, Q5_K, Q6_K and Q8_0: every entry of the quantized model is the value
    gguf's dequantization gives (the float32 conversion's), nothing is requantized, the logits equal
    the float32 conversion's, and S3D equals plain greedy on the kernel's products of each format."""
    from s3d_jax.convert import convert

    path, shipped, reference = typed_gguf
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = s3d_jax.load(convert(path, path.parent / dtype, dtype=dtype, progress=False, overwrite=True))
    assert [str(w.message) for w in caught if "weights are not" in str(w.message)] == []
    assert dict(model.config.weight_formats) == KEPT_FORMATS[dtype]
    assert model.config.replace(dtype="float32").weight_formats == ()  # the formats belong to the dtype's weights
    for i in range(2):
        layer = layer_params(model.params, i)
        for group, name in (("attn", "qkv"), ("attn", "o"), ("mlp", "gate_up"), ("mlp", "down")):
            assert quant.format_of(layer[group][name], quant.QUANTIZED_INPUTS[name]).name == KEPT_FORMATS[dtype][name]
    plain = quant.dequantize_params(model.params)
    vocab = model.config.mask_token_id  # the appended mask row is the table's mean, then padding
    np.testing.assert_array_equal(plain["embed"][:, :vocab], shipped["token_embd.weight"].T)
    for i in range(2):
        np.testing.assert_array_equal(layer_params(plain, i)["mlp"]["down"], shipped[f"blk.{i}.ffn_down.weight"].T)
        key = layer_params(plain, i)["attn"]["qkv"][:, :, -2]  # [D, K, G + 2, E]: each KV head's key is its next to last
        np.testing.assert_array_equal(key.reshape(256, -1), shipped[f"blk.{i}.attn_k.weight"].T)
    same = {k: v for k, v in plain.items() if k != "embed"}
    jax.tree.map(np.testing.assert_array_equal, same, {k: v for k, v in dict(reference.params).items() if k != "embed"})
    ids = np.random.default_rng(1).integers(0, 96, (1, 12))
    want = np.asarray(s3d_jax.logits(reference, ids))
    assert np.abs(np.asarray(s3d_jax.logits(model, ids)) - want).max() <= 1e-5 * np.abs(want).max()
    prompt = [5, 17, 3, 40]
    assert_exact(model, prompt, method="s3d", skip=(1, 1), gamma=3, min_certainty=0.0, max_new_tokens=12, eos_token_ids=())
