"""The few-row CPU kernel (`s3d_jax/kernel/cc/`) against numpy, where `dispatch.matmul` uses it, and
its cache, settings and threads."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from reference import save_chat_model

from s3d_jax import paths, quant
from s3d_jax.kernel import build, dispatch, ffi

needs_kernel = pytest.mark.skipif(
    shutil.which(os.environ.get("CXX", "c++")) is None or os.environ.get(ffi.ENV_SWITCH, "1").lower() in ("0", "false", "no", "off"),
    reason="no C++ compiler, or the kernel switched off: products stay on XLA's dot",
)
SHAPES = [(1, 576, 1536), (5, 576, 1536), (16, 1536, 576), (7, 576, 49280), (3, 37, 53), (2, 9, 8), (9, 64, 300)]


def random(shape, seed):
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape, dtype=np.float32))


@needs_kernel
def test_the_kernel_is_built_on_this_cpu():
    # With a compiler and the switch on, a fallback to XLA's dot would be a silent regression.
    assert ffi.available()
    assert dispatch.applies(5, jnp.float32, jnp.float32)
    x, w = random((5, 16), 0), random((16, 32), 1)
    assert ffi.TARGET in jax.jit(dispatch.matmul).lower(x, w).as_text()


@pytest.mark.parametrize("rows,k,n", SHAPES)
def test_kernel_equals_the_float64_product(rows, k, n):
    x, w = random((rows, k), 0), random((k, n), 1)
    y = np.asarray(jax.jit(dispatch.matmul)(x, w))
    exact = np.asarray(x, np.float64) @ np.asarray(w, np.float64)
    assert y.shape == (rows, n) and y.dtype == np.float32
    np.testing.assert_allclose(y, exact, rtol=0, atol=2e-6 * np.abs(exact).max())


@needs_kernel
@pytest.mark.parametrize("w_dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("same_x", [False, True])
@pytest.mark.parametrize("rows,k,n", SHAPES[:4])
def test_16_bit_weights_are_summed_in_float32_and_rounded_once(rows, k, n, same_x, w_dtype):
    """A 16-bit weight (and float32 or same-type input) through the kernel: the float32 product of the
    same values, rounded once to the result's dtype, as XLA's 16-bit dot computes it."""
    x_dtype = w_dtype if same_x else jnp.float32
    x, w = random((rows, k), 0).astype(x_dtype), random((k, n), 1).astype(w_dtype)
    assert ffi.TARGET in jax.jit(dispatch.matmul).lower(x, w).as_text()
    y = jax.jit(dispatch.matmul)(x, w)
    assert y.dtype == jnp.result_type(x_dtype, w_dtype)
    exact = np.asarray(x, np.float64) @ np.asarray(w, np.float64)
    tolerance = 2e-6 * np.abs(exact).max() + (np.abs(exact) * 2.0 ** -(jnp.finfo(y.dtype).nmant + 1) if same_x else 0)
    assert np.all(np.abs(np.asarray(y, np.float64) - exact) <= tolerance)


def test_xlas_dot_takes_a_16_bit_weights_input_rounded_to_its_type():
    """Past the kernel, a float32 input meets a bfloat16 weight in XLA's fast form: both operands in
    bfloat16, a float32 result (not a float32 copy of the weight)."""
    rows = dispatch.MAX_NARROW_ROWS + 1
    x, w = random((rows, 64), 6), random((64, 96), 7).astype(jnp.bfloat16)
    y = jax.jit(dispatch.matmul)(x, w)
    assert y.dtype == jnp.float32
    np.testing.assert_array_equal(y, jnp.tensordot(x.astype(jnp.bfloat16), w, axes=1, preferred_element_type=jnp.float32))


@needs_kernel
@pytest.mark.parametrize("w_dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("rows,k,n", SHAPES)
def test_a_rows_result_does_not_depend_on_the_rows_beside_it(rows, k, n, w_dtype):
    """Bit for bit: a token's logits in a verify pass equal its logits in a one-token step."""
    x, w = random((rows, k), 2).astype(w_dtype), random((k, n), 3).astype(w_dtype)
    together = np.asarray(jax.jit(dispatch.matmul)(x, w))
    for t in range(rows):
        alone = np.asarray(jax.jit(dispatch.matmul)(x[t : t + 1], w))
        assert np.array_equal(together[t], alone[0]), t


@needs_kernel
def test_a_bfloat16_weight_stays_in_the_kernel_past_sixteen_rows():
    """XLA's CPU dot widens a bfloat16 weight to float32 first, and in a loop hoists that out (a float32
    copy of the model held throughout): such products stay in the kernel up to `MAX_NARROW_ROWS` rows,
    each row still bit for bit what it is alone."""
    rows = dispatch.MAX_ROWS + 1
    assert dispatch.applies(rows, jnp.float32, jnp.bfloat16) and not dispatch.applies(rows, jnp.float32, jnp.float32)
    assert not dispatch.applies(dispatch.MAX_NARROW_ROWS + 1, jnp.float32, jnp.bfloat16)
    x, w = random((rows, 64), 4).astype(jnp.bfloat16), random((64, 96), 5).astype(jnp.bfloat16)
    assert ffi.TARGET in jax.jit(dispatch.matmul).lower(x, w).as_text()
    together = np.asarray(jax.jit(dispatch.matmul)(x, w), np.float32)
    alone = np.asarray(jax.jit(dispatch.matmul)(x[-1:], w), np.float32)
    assert np.array_equal(together[-1], alone[0])


@needs_kernel
@pytest.mark.parametrize("base", ["float32", "bfloat16", "int8", "int4", "int8-g16-min", "int4-f32"])
@pytest.mark.parametrize("rows", [1, 5, 16])
def test_products_beside_the_first_in_one_call_equal_each_alone(base, rows):
    """`matmuls` (a projection and its draft adapter's A factor): one kernel call whose results are
    bit for bit each weight's `matmul` alone, at an entry of its own stack (an adapter's stack holds
    the draft layers only), whatever the first weight's format; the XLA path alike."""
    L, K, N, R = 3, 64, 96, 40
    w = random((L, K, N), 11)
    w = quant.quantize(w, 2, quant.Format.parse(base)) if base.startswith("int") else w.astype(base)
    a, a16 = random((2, K, R), 12), random((5, K, 8), 13).astype(jnp.bfloat16)
    x, at = random((rows, K), 14), (jnp.int32(2), jnp.int32(1), jnp.int32(4))
    together = jax.jit(lambda x, at: dispatch.matmuls(x, (w, a, a16), at=at))
    assert together.lower(x, at).as_text().count("custom_call") == 1
    for got, weight, entry in zip(together(x, at), (w, a, a16), at):
        assert np.array_equal(got, dispatch.matmul(x, weight, at=entry))
    with ffi.switch(False):
        for got, weight, entry in zip(jax.jit(lambda x, at: dispatch.matmuls(x, (w, a, a16), at=at))(x, at), (w, a, a16), at):
            alone = dispatch.matmul(x, dispatch.entry(weight, entry))
            assert np.array_equal(got, alone)


def test_trailing_input_axes_and_leading_batch_axes():
    """Like `jnp.tensordot`: a `[B, T, H, E]` input against an `[H, E, D]` weight (the attention output)."""
    x, w = random((2, 3, 4, 8), 4), random((4, 8, 48), 5)
    expected = jnp.tensordot(x, w, axes=((2, 3), (0, 1)))
    np.testing.assert_allclose(dispatch.matmul(x, w, n_in=2), expected, rtol=1e-5, atol=1e-5)


def test_gradients_equal_xlas():
    x, w = random((4, 32), 6), random((32, 24), 7)

    def loss(matmul):
        return lambda x, w: jnp.sum(jnp.sin(matmul(x, w)))

    got = jax.grad(loss(dispatch.matmul), argnums=(0, 1))(x, w)
    expected = jax.grad(loss(jnp.matmul), argnums=(0, 1))(x, w)
    for g, e in zip(got, expected):
        np.testing.assert_allclose(g, e, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "rows,x_dtype,w_dtype",
    [(dispatch.MAX_ROWS + 1, jnp.float32, jnp.float32), (0, jnp.float32, jnp.float32),
     (dispatch.MAX_NARROW_ROWS + 1, jnp.float16, jnp.float16)],
)
def test_other_products_stay_on_xlas_dot(rows, x_dtype, w_dtype):
    assert not dispatch.applies(rows, x_dtype, w_dtype)
    x, w = random((rows, 16), 8).astype(x_dtype), random((16, 32), 9).astype(w_dtype)
    assert "custom_call" not in jax.jit(dispatch.matmul).lower(x, w).as_text()
    np.testing.assert_array_equal(dispatch.matmul(x, w), jnp.tensordot(x, w, axes=1))


@needs_kernel
def test_the_switch_turns_it_off(monkeypatch):
    monkeypatch.setenv(ffi.ENV_SWITCH, "0")
    assert not dispatch.applies(1, jnp.float32, jnp.float32)
    x, w = random((1, 16), 8), random((16, 32), 9)
    assert "custom_call" not in jax.jit(dispatch.matmul).lower(x, w).as_text()
    monkeypatch.undo()
    assert dispatch.applies(1, jnp.float32, jnp.float32)


@needs_kernel
def test_a_failed_build_falls_back_with_a_warning(monkeypatch, tmp_path):
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    monkeypatch.setenv("S3D_JAX_CACHE", str(tmp_path))  # nothing built there yet
    ffi.registered.cache_clear()
    try:
        with pytest.warns(RuntimeWarning, match="few-row CPU kernel unavailable"):
            assert not ffi.available()
    finally:
        monkeypatch.undo()
        ffi.registered.cache_clear()
    assert ffi.available()  # the same library again: registering it twice is harmless


def kernel_process(cache, code="", **env):
    """A fresh Python process that loads the kernel from `cache` (and runs `code`): (exit code, stderr, stdout)."""
    script = f"from s3d_jax.kernel import dispatch, ffi\nprint(ffi.available())\n{code}"
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                            env={**os.environ, "S3D_JAX_CACHE": str(cache), **env})
    return result.returncode, result.stderr, result.stdout


@pytest.fixture(scope="module")
def built_cache(tmp_path_factory):
    """A cache directory holding a copy of this run's kernel (built here if no test has yet)."""
    if not ffi.available():
        pytest.skip("no few-row kernel here (no compiler, or switched off)")
    cache = tmp_path_factory.mktemp("kernel_cache")
    shutil.copytree(paths.cache_root() / "kernels", cache / "kernels")
    return cache


@needs_kernel
@pytest.mark.parametrize("damage", ["truncated", "foreign library", "digest missing", "random bytes"])
def test_a_kernel_file_unlike_its_build_is_not_intact(built_cache, tmp_path, damage):
    """A file in the kernel cache that is not what the build wrote (a crash mid-copy, another library
    at its path) is never loaded, which could kill the process with SIGBUS: `built_library` rebuilds
    whatever `intact` refuses (tests/test_faults.py rebuilds one, a rebuild being half a minute)."""
    shutil.copytree(built_cache / "kernels", tmp_path / "kernels")
    (library,) = (tmp_path / "kernels").glob("few_rows-*.so")
    assert build.intact(library)
    digest = library.with_name(library.name + ".sha256")
    if damage == "truncated":
        library.write_bytes(library.read_bytes()[:4096])
    elif damage == "foreign library":
        shutil.copyfile(min(jax_libraries(), key=lambda p: p.stat().st_size), library)
    elif damage == "digest missing":
        digest.unlink()
    else:
        library.write_bytes(np.random.default_rng(0).bytes(library.stat().st_size))
    assert not build.intact(library)


def jax_libraries():
    import jaxlib

    return list(Path(jaxlib.__file__).parent.rglob("*.so"))


@needs_kernel
def test_the_thread_setting_sets_the_helper_threads(built_cache):
    """`S3D_JAX_FEW_ROW_THREADS=N` starts N - 1 helper threads at the first product."""
    count = "import os, jax, jax.numpy as jnp\njax.jit(lambda x: x + 1)(jnp.ones(3)).block_until_ready()\n" \
            "before = len(os.listdir('/proc/self/task'))\n" \
            "jax.jit(dispatch.matmul)(jnp.ones((2, 64)), jnp.ones((64, 4096))).block_until_ready()\n" \
            "print(len(os.listdir('/proc/self/task')) - before)"
    if not Path("/proc/self/task").exists():
        pytest.skip("no /proc: threads cannot be counted")
    started = {}
    for threads in ("1", "4"):
        code, err, out = kernel_process(built_cache, count, S3D_JAX_FEW_ROW_THREADS=threads)
        assert code == 0, err
        started[threads] = int(out.split()[-1])
    assert started["4"] - started["1"] == 3


@pytest.mark.parametrize("name,value", [(build.ENV_THREADS, "0"), (build.ENV_THREADS, "many"), (build.ENV_SPIN, "-5")])
def test_a_bad_setting_is_named(monkeypatch, name, value):
    monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=f"{name}='{value}': expected a whole number"):
        build.threads() if name == build.ENV_THREADS else build.spin_microseconds()


# A decode pass's attention: (B, K KV heads, G query heads each, T block tokens, S slots, E), each row's
# cached length, and the block's mask: "causal", or "tree" (token t sees itself and a random choice
# of the tokens before it, as a tree's ancestors; token 0 sees only itself).
ATTENTION_CASES = [((1, 3, 3, 1, 256, 64), [200], "causal"), ((2, 2, 5, 4, 77, 96), [0, 77], "causal"),
                   ((3, 1, 2, 9, 40, 32), [17, 1, 39], "tree"), ((1, 3, 3, 5, 600, 64), [513], "tree")]


def float64_attention(q, keys, values, block_keys, block_values, mask, lengths, scale):
    """numpy's attention in float64 over each row's live slots and the block keys its mask allows."""
    B, K, G, T, E = q.shape
    S = keys.shape[2]
    live = np.arange(S)[None, :] < np.asarray(lengths)[:, None]
    q, keys, values = (np.nan_to_num(np.asarray(a, np.float64)) for a in (q, keys, values))
    block_keys = np.asarray(block_keys, np.float64)
    scores = np.concatenate([np.einsum("bkgte,bkse->bkgts", q, keys), np.einsum("bkgte,bkje->bkgtj", q, block_keys)], -1)
    sees = np.concatenate([np.broadcast_to(live[:, None, :], (B, T, S)), mask], -1)[:, None, None]
    scores = np.where(sees, scores * scale, -np.inf)
    probs = np.exp(scores - scores.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    return np.einsum("bkgts,bkes->bkgte", probs[..., :S], values) + np.einsum("bkgtj,bkje->bkgte", probs[..., S:], block_values)


@needs_kernel
@pytest.mark.parametrize("shape,lengths,mask_kind", ATTENTION_CASES)
def test_attention_over_the_cache_reads_only_each_rows_live_slots(shape, lengths, mask_kind):
    """Equals float64 numpy's over each row's first `lengths[b]` slots of layer 1 of a stack of 3 and
    the block keys its mask allows; every slot past them, and the other layers, hold NaN, which any
    read of them would carry into the result."""
    B, K, G, T, S, E = shape
    rng = np.random.default_rng(0)
    lengths = np.asarray(lengths, np.int32)
    live = np.arange(S)[None, :] < lengths[:, None]
    q, block_keys, block_values = random((B, K, G, T, E), 0), random((B, K, T, E), 4), random((B, K, T, E), 5)
    keys, values = np.array(random((B, K, S, E), 1)), np.array(random((B, K, E, S), 2))
    keys.transpose(0, 2, 1, 3)[~live] = np.nan
    values.transpose(0, 3, 1, 2)[~live] = np.nan
    mask = np.tril(np.ones((B, T, T), bool)) & (rng.random((B, T, T)) < 0.5 if mask_kind == "tree" else True)
    mask |= np.eye(T, dtype=bool)
    def stack(layer):  # layer 1 of three
        return jnp.asarray(np.stack([np.full_like(layer, np.nan), layer, np.full_like(layer, np.nan)]))

    q_BTKGE = jnp.asarray(q).transpose(0, 3, 1, 2, 4)
    got = jax.jit(dispatch.cache_attention, static_argnums=8)(
        q_BTKGE, stack(keys), stack(values), block_keys.transpose(0, 2, 1, 3), block_values.transpose(0, 2, 1, 3),
        jnp.asarray(mask), jnp.asarray(lengths), 1, E ** -0.5)
    exact = float64_attention(q, keys, values, block_keys, block_values, mask, lengths, E ** -0.5)
    np.testing.assert_allclose(np.asarray(got).transpose(0, 2, 3, 1, 4), exact, rtol=0, atol=2e-6 * np.abs(exact).max())


@needs_kernel
def test_a_rows_attention_does_not_depend_on_the_rows_or_slots_beside_it():
    """A token alone (a plain step: its 3 query heads, its own key) and the same token as the first of
    a causal block of 5 (a verify pass) over a longer allocation: bit for bit the same output, which
    keeps a verify pass's tokens equal to plain steps'."""
    K, G, E, n = 1, 3, 64, 200
    q, block_keys, block_values = random((1, 5, K, G, E), 0), random((1, 5, K, E), 4), random((1, 5, K, E), 5)
    keys, values = random((1, 1, K, 300, E), 1), random((1, 1, K, E, 300), 2)  # stacks of one layer
    lengths = jnp.asarray([n])
    alone = dispatch.cache_attention(q[:, :1], keys[:, :, :, :n + 8], values[..., :n + 8], block_keys[:, :1], block_values[:, :1],
                                     jnp.ones((1, 1, 1), bool), lengths, 0, E ** -0.5)
    beside = dispatch.cache_attention(q, keys, values, block_keys, block_values, jnp.tril(jnp.ones((1, 5, 5), bool)), lengths, 0,
                                      E ** -0.5)
    assert np.array_equal(alone, beside[:, :1])


@needs_kernel
@pytest.mark.parametrize("T,counts", [(4, [0, 1, 37, 300]), (9, [16, 17, 300, 299]), (1, [300, 5, 0, 120])])
def test_column_logits_read_each_rows_first_count_ids_and_equal_the_gathered_product(T, counts):
    """The draft head's scores of a row's own context ids: float64 numpy's over the first `counts[b]`
    ids of row b that lie in the table, repeats included, 0 elsewhere; the table's other columns hold
    NaN, which a read would carry."""
    B, D, V, L = 4, 96, 1000, 300
    rng = np.random.default_rng(0)
    ids = rng.integers(0, V // 2, (B, L)).astype(np.int32)  # many repeats, which the kernel scores once
    outside = rng.random((B, L)) < 0.2
    ids[outside] = rng.choice([-1, V, V + 7], outside.sum())  # ids the caller drops: not read
    table = np.array(random((D, V), 1))
    table[:, V // 2 :] = np.nan  # no live id lies there; dead slots point there
    counts = np.asarray(counts, np.int32)
    live = np.arange(L)[None, :] < counts[:, None]
    ids = np.where(live, ids, V - 1)
    hidden = random((B, T, D), 2)
    got = np.asarray(jax.jit(dispatch.column_logits)(hidden, jnp.asarray(table), jnp.asarray(ids), jnp.asarray(counts)))
    exact = np.einsum("btd,dbl->btl", np.asarray(hidden, np.float64), np.nan_to_num(table.astype(np.float64))[:, np.clip(ids, 0, V - 1)])
    scored = live & ~outside
    np.testing.assert_allclose(got, np.where(scored[:, None, :], exact, 0), rtol=0, atol=2e-6 * np.abs(exact).max())
    # A row's logits are bit for bit the same alone and beside other rows with other counts.
    alone = dispatch.column_logits(hidden[2:3, :1], jnp.asarray(table), jnp.asarray(ids[2:3]), jnp.asarray(counts[2:3]))
    assert np.array_equal(np.asarray(alone)[0, 0], got[2, 0])


@needs_kernel
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_a_16_bit_tables_columns_equal_xlas_gather(dtype):
    """Token embeddings of a 16-bit table come from the kernel (`dispatch.columns`): the same float32
    values as `jnp.take`, a negative id counted from the end and NaN for one outside the table as it
    gives them, and its gradient."""
    table = random((64, 300), 6).astype(dtype)
    ids = jnp.asarray([[0, 299, 7, 7], [300, -302, -1, 5]], jnp.int32)
    assert ffi.TARGET_TABLE_COLUMNS in jax.jit(dispatch.columns).lower(table, ids).as_text()
    got = np.asarray(jax.jit(dispatch.columns)(table, ids))
    want = np.asarray(jnp.take(table, ids, axis=1).astype(jnp.float32))
    assert got.shape == (64, 2, 4) and got.dtype == np.float32
    np.testing.assert_array_equal(got, want)
    assert np.isnan(got[:, 1, :2]).all() and not np.isnan(got[:, 0]).any()

    def loss(t):
        return jnp.sum(dispatch.columns(t, ids[:1]) ** 2)

    np.testing.assert_array_equal(np.asarray(jax.grad(loss)(table)),
                                  np.asarray(jax.grad(lambda t: jnp.sum(jnp.take(t, ids[:1], axis=1).astype(jnp.float32) ** 2))(table)))


@needs_kernel
def test_a_bfloat16_decode_loop_holds_no_float32_copy_of_the_vocabulary_table():
    """XLA's CPU widened a bfloat16 table before its gather and hoisted that out of the decode loop:
    with the embedding and the draft head's context columns from the kernel, no float32 table is left."""
    from reference import tiny_model

    from s3d_jax import api
    from s3d_jax.checkpoint import Model
    from s3d_jax.model import default_draft_vocab, draft_head_table
    from s3d_jax.quant import cast_params

    base = tiny_model(draft_lora_rank=4, draft_skip=(2, 3), vocab_size=301)
    config = base.config.replace(dtype="bfloat16", draft_vocab_size=64)  # a reduced draft head, which scores context columns
    params = {**cast_params(base.params, "bfloat16"), "draft_vocab": default_draft_vocab(config)}
    params["draft_head"] = draft_head_table(params["embed"], params["draft_vocab"], config)
    model = Model(params, config)
    _, run, _ = api.prepare(model, [4, 5, 6], method="s3d", gamma=3, skip=(2, 3), tree=4, lookup=True, min_certainty=0.0,
                            max_new_tokens=8, max_len=128)
    run.compile()
    table = f"[{model.config.hidden_size},{model.params['embed'].shape[1]}]"
    for executable in run.executables:
        widened = [line for line in executable.as_text().splitlines() if f"f32{table}" in line]
        assert not widened, widened[:2]


# Stands in for the C++ compiler: it answers `--version` as the real one (so the library keeps its
# name) and "builds" by copying the library that this test run built from the same source.
STAND_IN_COMPILER = """#!{python}
import shutil, subprocess, sys
args = sys.argv[1:]
if "--version" in args:
    sys.exit(subprocess.run([{real!r}, *args]).returncode)
shutil.copyfile({built!r}, args[args.index("-o") + 1])
"""


@pytest.mark.needs("bundled_model")
def test_a_damaged_kernel_in_the_cache_is_rebuilt_not_loaded(tmp_path):
    """A kernel cut short in the cache (a crash, an interrupted copy) once killed every later run with
    SIGBUS, and another library at its path ended in a traceback; now the command line rebuilds it and
    goes on, and the next process loads it. (Every kind of damage is refused above.
    The rebuild runs a stand-in compiler that copies the library this run built, since compiling
    again would take half a minute on 2 cores and check nothing the run's own first build did not.)"""
    if not ffi.available():
        pytest.skip("no few-row kernel here (no compiler, or switched off)")
    chat_model = save_chat_model(tmp_path / "chat_model")
    built = build.library_path()
    compiler = tmp_path / "c++"
    compiler.write_text(STAND_IN_COMPILER.format(python=sys.executable, real=os.environ.get("CXX", "c++"), built=str(built)))
    compiler.chmod(0o755)
    shutil.copytree(paths.cache_root() / "kernels", tmp_path / "kernels")
    for library in (tmp_path / "kernels").glob("few_rows-*.so"):
        shutil.copyfile(Path(sys.executable).resolve(), library)  # an ELF, but not the kernel
    env = {**os.environ, "S3D_JAX_CACHE": str(tmp_path), "CXX": str(compiler)}
    command = [sys.executable, "-m", "s3d_jax.generate", "--model", str(chat_model), "--drafter", "none", "--chat", "--prompt", "Hi",
               "--max-new-tokens", "4"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=600, env=env)
    assert result.returncode == 0, result.stderr
    assert "is not the file its build wrote" in result.stderr and "built the few-row CPU kernel" in result.stderr
    check = "from s3d_jax.kernel import ffi; print(ffi.available())"  # whole again: the next process builds nothing
    again = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, timeout=300, env=env)
    assert again.stdout.split() == ["True"] and "build" not in again.stderr, again.stderr
