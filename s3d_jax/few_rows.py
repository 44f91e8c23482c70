"""Products of a few rows against a large weight on a CPU: the decode passes' matmuls.

XLA's CPU dot reads a weight at its streaming bandwidth for one row, but for 2 to 16 rows it packs
the weight first, so verifying 5 tokens cost about 2x a one-token step. `few_rows.cc`, an XLA FFI
handler, reads the weight once for all the rows, which is what speculative decoding needs from a
CPU. It is built with the machine's C++ compiler on first use (`-march=native`; a line on stderr says so
and how long it took) into `<cache root>/kernels/`, keyed on everything the binary depends on, and
checked against its recorded digest before every load: a truncated or foreign file is rebuilt.

`matmul(x, w)` is the one entry point; a layer's weight comes as its stack `[L, ...]` and the layer's
(traced) index, `matmul(x, stack, at=layer)`, which the kernel reads at an offset and XLA's dot
as a slice (a copy on a CPU). The kernel where it applies (a CPU backend with one device,
a float32, bfloat16, float16, int8 or int4 weight (`quant`), at most `MAX_ROWS` rows
(`MAX_NARROW_ROWS` for the narrower types), the switch on), `jnp.tensordot` everywhere else, with
a quantized weight dequantized first. It is differentiable.

`cache_attention` is a decode pass's attention over the KV cache and its own block in one call,
reading each row's slots below its cached length only, where XLA's dot reads every allocated slot
(`model.Prefix`); the kernel's lookups in a vocabulary table are `tables`'. Settings (docs/cpu.md):
- `S3D_JAX_FEW_ROW_KERNEL`: `0`/`false`/`no`/`off` keeps every product and the attention on XLA's dot. It is read
  when a function is traced; the decode engine's caches key on it (`switch`).
- `S3D_JAX_FEW_ROW_THREADS`: the threads sharing a product, read once per process; by default the
  CPUs this process may run on, at most 8 (more add no bandwidth).
- `S3D_JAX_FEW_ROW_SPIN_US`: how long a helper thread spins after a product before it sleeps, read
  once per process (default 50 µs).
"""

from __future__ import annotations

import contextlib
import contextvars
import ctypes
import functools
import hashlib
import math
import os
import platform
import subprocess
import sys
import time
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import jaxlib
import numpy as np

from s3d_jax import quant
from s3d_jax.paths import cache_root
from s3d_jax.settings import env_setting, env_switch, usable_cores

SOURCE = Path(__file__).with_name("few_rows.cc")
TARGET = "s3d_few_row_matmul"
TARGET_INT8 = "s3d_few_row_matmul_int8"
TARGET_INT4 = "s3d_few_row_matmul_int4"
TARGET_CACHE_ATTENTION = "s3d_cache_attention"
TARGET_CONTEXT_LOGITS = "s3d_context_logits"
TARGET_TABLE_COLUMNS = "s3d_table_columns"
MAX_ROWS = 16  # beyond this (prefill, training) XLA's dot is the faster one
# A 16-bit or quantized weight's products stay in the kernel longer: XLA's CPU dot widens the whole
# weight to float32 first, and in a loop (the decode loop, a calibration's timing) it hoisted that
# widening out of the loop, a float32 copy of the model held throughout (docs/cpu.md, "bfloat16").
MAX_NARROW_ROWS = 64
ENV_SWITCH = "S3D_JAX_FEW_ROW_KERNEL"
ENV_THREADS = "S3D_JAX_FEW_ROW_THREADS"
ENV_SPIN = "S3D_JAX_FEW_ROW_SPIN_US"
DEFAULT_MAX_THREADS = 8
# Helpers spin this long after a product before sleeping: the products of one pass come a few
# microseconds apart; a longer spin is no faster and keeps a core busy (docs/cpu.md, "Helper threads").
DEFAULT_SPIN_MICROSECONDS = 50
FLAGS = ["-O3", "-march=native", "-ffp-contract=fast", "-std=c++20", "-shared", "-fPIC"]

_switch: contextvars.ContextVar[bool | None] = contextvars.ContextVar("few_row_kernel", default=None)


def switched_on() -> bool:
    """The switch: `switch(on)` while tracing under it, else `S3D_JAX_FEW_ROW_KERNEL` (default on)."""
    forced = _switch.get()
    return env_switch(ENV_SWITCH) if forced is None else forced


@contextlib.contextmanager
def switch(on: bool):
    """Traces inside use the kernel only if `on`: a static argument of a jitted function passes the
    switch in, so that jit's caches key on it (`decoding.compile_ahead`)."""
    token = _switch.set(bool(on))
    try:
        yield
    finally:
        _switch.reset(token)


def threads() -> int:
    """`S3D_JAX_FEW_ROW_THREADS`, else the CPUs this process may use, at most `DEFAULT_MAX_THREADS`."""
    return env_setting(ENV_THREADS, max(1, min(DEFAULT_MAX_THREADS, usable_cores())), 1)


def spin_microseconds() -> int:
    return env_setting(ENV_SPIN, DEFAULT_SPIN_MICROSECONDS, 0)


def _compiler() -> list[str]:
    return [os.environ.get("CXX", "c++")]


@functools.cache
def _compiler_version() -> str:
    try:
        return subprocess.run([*_compiler(), "--version"], capture_output=True, text=True).stdout.strip()
    except OSError:
        return ""


@functools.cache
def build_id() -> str:
    """What the binary depends on, hashed: this source, built by this compiler for this CPU and this jaxlib.
    Pass costs measured with one build are measured again with another (`calibration`)."""
    cpu = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else platform.processor()
    cpu_flags = next((line for line in cpu.splitlines() if line.startswith("flags")), cpu)
    parts = [SOURCE.read_text(), " ".join(FLAGS), jaxlib.__version__, _compiler_version(), platform.machine(), cpu_flags]
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:16]


def _library_path() -> Path:
    return cache_root() / "kernels" / f"few_rows-{build_id()}.so"


def _notice(text: str) -> None:
    """A line on stderr for what happens once per machine, like a progress bar: not a warning."""
    print(f"s3d_jax: {text}", file=sys.stderr, flush=True)


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _digest_path(library: Path) -> Path:
    return library.with_name(library.name + ".sha256")


def _intact(library: Path) -> bool:
    """Whether `library` is the file a build wrote: its digest matches the one recorded beside it."""
    recorded = _digest_path(library)
    return library.is_file() and recorded.is_file() and recorded.read_text().strip() == _digest(library)


def _write_durably(path: Path, data: bytes | None = None) -> None:
    """Writes `data` to `path` (or only flushes `path`) and fsyncs it, so a crash cannot leave it short."""
    with open(path, "r+b" if data is None else "wb") as f:
        if data is not None:
            f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _build(path: Path) -> None:
    """Compiles the kernel to `path` and records its digest beside it. Both are written under
    temporary names, synced, then renamed, so a crash or a concurrent first use leaves no short
    file; a digest that does not match (a crash between the renames) only causes a rebuild."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
    command = [*_compiler(), *FLAGS, f"-I{jax.ffi.include_dir()}", str(SOURCE), "-o", str(tmp)]
    _notice(f"building the few-row CPU kernel for this machine (once), into {path.parent}")
    start = time.perf_counter()
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode:
        raise RuntimeError(f"`{' '.join(command)}` failed:\n{result.stderr[-2000:]}")
    _write_durably(tmp)
    digest_tmp = _digest_path(tmp)
    _write_durably(digest_tmp, _digest(tmp).encode())
    tmp.replace(path)
    digest_tmp.replace(_digest_path(path))
    _notice(f"built the few-row CPU kernel in {time.perf_counter() - start:.1f} s")


def available() -> bool:
    """Whether the kernel is on: switched on, built (once per machine) and registered with XLA."""
    return switched_on() and _registered()


def prepare() -> None:
    """Builds and registers the kernel now if it can apply (a CPU backend with one device, switched
    on), so that a first build is not counted in a compile's time."""
    if jax.default_backend() == "cpu" and jax.device_count() == 1:
        available()


def _load(path: Path) -> dict:
    """The library's handlers by FFI target, its helper threads configured."""
    library = ctypes.cdll.LoadLibrary(str(path))
    handlers = {TARGET: library.S3dFewRowMatmul, TARGET_INT8: library.S3dFewRowMatmulInt8,  # AttributeError: not our library
                TARGET_INT4: library.S3dFewRowMatmulInt4, TARGET_CACHE_ATTENTION: library.S3dCacheAttention,
                TARGET_CONTEXT_LOGITS: library.S3dContextLogits, TARGET_TABLE_COLUMNS: library.S3dTableColumns}
    configure = library.S3dFewRowConfigure
    configure.argtypes = [ctypes.c_int64, ctypes.c_int64]
    configure(threads(), spin_microseconds())
    return handlers


@functools.cache
def _registered() -> bool:
    try:
        path = _library_path()
        if not _intact(path):
            if path.exists():
                _notice(f"{path} is not the file its build wrote (truncated, replaced, or without its digest); rebuilding it")
            _build(path)
        for target, handler in _load(path).items():
            jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(handler), platform="cpu")
    except (OSError, RuntimeError, AttributeError, ValueError) as error:
        warnings.warn(f"few-row CPU kernel unavailable, decoding uses XLA's dot: {error}", RuntimeWarning, stacklevel=3)
        return False
    return True


INPUT_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)  # of x; the kernel sums in float32
QUANTIZED_WEIGHT_DTYPES = (jnp.int8, jnp.uint8)  # an int8 or int4 weight's values, with its scales (`quant`)
WEIGHT_DTYPES = (*INPUT_DTYPES, *QUANTIZED_WEIGHT_DTYPES)


def applies(rows: int, x_dtype, w_dtype) -> bool:
    """Whether `matmul` uses the kernel for this product (decided when tracing)."""
    return (
        0 < rows <= (MAX_ROWS if w_dtype == jnp.float32 else MAX_NARROW_ROWS)
        and x_dtype in INPUT_DTYPES
        and w_dtype in WEIGHT_DTYPES
        and on_one_cpu()
        and available()
    )


def on_one_cpu() -> bool:
    return jax.default_backend() == "cpu" and jax.device_count() == 1  # sharded products stay with XLA's partitioner


def entry(stack, at):
    """Entry `at` of a stack `[L, ...]` (a quantized weight's parts alike): XLA's slice, a copy where
    an operation cannot read it in place. The kernel reads the entry inside the whole stack instead."""
    return jax.tree.map(lambda part: jax.lax.dynamic_index_in_dim(part, at, keepdims=False), stack)


def _at(at):
    """Entries as the kernel reads them (`Entry` in few_rows.cc): one, or one per weight of a product."""
    return jnp.asarray(at, jnp.int32) if not isinstance(at, tuple) else jnp.stack([jnp.asarray(a, jnp.int32) for a in at])


def _per_weight(at, count: int) -> tuple:
    """`at` as one entry per weight: a tuple of `count` as it is, a single entry repeated."""
    if isinstance(at, tuple):
        if len(at) != count:
            raise ValueError(f"{len(at)} stack entries for {count} weights")
        return at
    return (at,) * count


def _results(x_MK, weights_LKN):
    return [jax.ShapeDtypeStruct((*x_MK.shape[:-1], w.shape[-1]), jnp.float32) for w in weights_LKN]


def _float_tangents(x, dx, stacks, dstacks, ats):
    """The tangents of `x @ w[at]` for each float stack w of `stacks` and its entry of `ats`."""
    return tuple(dx @ entry(w, at) + x @ entry(dw, at) for w, dw, at in zip(stacks, dstacks, ats))


@jax.custom_jvp
def _kernel(x_MK, w_LKN, at, beside=()):
    """`x @ w[at[0]]` and `x @ b[at[i + 1]]` for each float stack b of `beside`, in one call (`at` one
    entry per weight, or a scalar with nothing beside); or with a batch axis (`x [S, M, K]`,
    `w [L, S, K, N]`, nothing beside) each `x[s] @ w[at, s]`."""
    call = jax.ffi.ffi_call(TARGET, _results(x_MK, (w_LKN, *beside)), vmap_method="sequential")
    return tuple(call(x_MK, w_LKN, _at(at), *beside))


@_kernel.defjvp
def _kernel_jvp(primals, tangents):
    (x, w, at, beside), (dx, dw, _, dbeside) = primals, tangents
    return _kernel(x, w, at, beside), _float_tangents(x, dx, (w, *beside), (dw, *dbeside), _per_weight(at, 1 + len(beside)))


@jax.custom_jvp
def _quantized_kernel(x_MK, w, at, beside=()):
    """The kernel's product with entry `at[0]` of a stack of quantized weights `[L, K, N]` (`quant`), and
    `x @ b[at[i + 1]]` for each float stack b of `beside`, in one call."""
    target = TARGET_INT4 if quant.bits_of(w) == 4 else TARGET_INT8
    call = jax.ffi.ffi_call(target, _results(x_MK, (w["values"], *beside)), vmap_method="sequential")
    low = w["min"] if "min" in w else jnp.zeros((0,), jnp.float32)  # an int8 weight without a minimum passes an empty one
    return tuple(call(x_MK, w["values"], w["scale"], low, _at(at), *beside))


@_quantized_kernel.defjvp
def _quantized_kernel_jvp(primals, tangents):
    (x, stack, at, beside), (dx, dstack, _, dbeside) = primals, tangents
    ats = _per_weight(at, 1 + len(beside))
    w, dw = entry(stack, ats[0]), entry(dstack, ats[0])
    # The weight is linear in its scales (and minimums) for fixed values, which have no tangent.
    dw_value = quant.dequantize({**{k: dw[k] for k in w if k != "values"}, "values": w["values"]}, 1)
    dy = dx @ quant.dequantize(w, 1) + x @ dw_value
    return _quantized_kernel(x, stack, at, beside), (dy, *_float_tangents(x, dx, beside, dbeside, ats[1:]))


def result_dtype(x, w, preferred_element_type=None):
    """What a product of x and w (arrays or dtypes) returns: `preferred_element_type` where given, else their promoted type."""
    return jnp.dtype(preferred_element_type or jnp.result_type(x, w))


def tensordot(x, w, n_in: int = 1, precision=None, preferred_element_type=None):
    """`jnp.tensordot` that accumulates 16-bit products in float32 and rounds once at the end.

    The numbers are those of a bfloat16 dot on any backend, but XLA's CPU has a fast bfloat16 kernel
    only for a float32 result: asked for a bfloat16 result it converts both operands to float32
    first, which made bfloat16 slower than float32 (docs/cpu.md, "bfloat16")."""
    out_dtype = result_dtype(x, w, preferred_element_type)
    if jnp.dtype(out_dtype).itemsize < 4 and jnp.issubdtype(out_dtype, jnp.floating):
        return jnp.tensordot(x, w, axes=n_in, precision=precision, preferred_element_type=jnp.float32).astype(out_dtype)
    return jnp.tensordot(x, w, axes=n_in, precision=precision, preferred_element_type=preferred_element_type)


def matmul(x, w, n_in: int = 1, precision=None, preferred_element_type=None, at=None):
    """`x @ w` over x's last `n_in` axes and w's first `n_in`, as `jnp.tensordot` with the same
    arguments; `w` may be a quantized weight (`quant`), which stands for its float32 value. With
    `at` (a traced index), `w` is a stack of weights `[L, ...]` and the product is with `w[at]`.

    With a 16-bit weight and float32 x (the model's activations), the kernel widens the weight in
    registers and multiplies x as it is; XLA's dot multiplies x rounded to the weight's type, its
    fast form (`tensordot`). Either way the result is float32."""
    return matmuls(x, (w,), n_in, precision, preferred_element_type, at)[0]


def matmuls(x, weights, n_in: int = 1, precision=None, preferred_element_type=None, at=None):
    """`matmul(x, w, ...)` for each w of `weights`, in one kernel call where the kernel applies to them
    all: a draft adapter's A factor beside its projection, whose threads then take both products'
    parts from one hand-off (docs/cpu.md, "The few-row kernel"). Weights after the first are
    float; each result is what `matmul` would give alone, bit for bit. `at` is every weight's entry,
    or a tuple of one per weight (an adapter's stack holds other layers than its projection's)."""
    w, beside = weights[0], weights[1:]
    quantized = quant.is_quantized(w)
    ats = _per_weight(at, len(weights))
    stacks = tuple(v if a is not None else jax.tree.map(lambda part: part[None], v) for v, a in zip(weights, ats))
    values = [stacks[0]["values"] if quantized else stacks[0], *stacks[1:]]
    lead = x.shape[: x.ndim - n_in]
    rows = math.prod(lead)
    if not all(applies(rows, x.dtype, v.dtype) and (i == 0 or v.dtype in INPUT_DTYPES) for i, v in enumerate(values)):
        return tuple(_xla_matmul(x, v, n_in, precision, preferred_element_type, a) for v, a in zip(weights, ats))
    K = math.prod(x.shape[x.ndim - n_in:])
    x_MK = x.reshape(rows, K).astype(jnp.float32)  # exact from 16 bits
    at = tuple(0 if a is None else a for a in ats) if beside else (0 if ats[0] is None else ats[0])
    beside_LKN = tuple(b.reshape(b.shape[0], K, -1) for b in stacks[1:])
    if quantized:
        N = math.prod(values[0].shape[1 + n_in:])
        ys = _quantized_kernel(x_MK, {k: v.reshape(v.shape[0], -1, N) for k, v in stacks[0].items()}, at, beside_LKN)
    else:
        ys = _kernel(x_MK, stacks[0].reshape(stacks[0].shape[0], K, -1), at, beside_LKN)
    dtypes = [x.dtype if quantized else values[0].dtype, *(b.dtype for b in beside)]
    return tuple(y.reshape(*lead, *v.shape[1 + n_in:]).astype(result_dtype(x.dtype, d, preferred_element_type))
                 for y, v, d in zip(ys, values, dtypes))


def _xla_matmul(x, w, n_in, precision, preferred_element_type, at):
    """`matmul` by XLA's dot: where the kernel does not apply."""
    w = w if at is None else entry(w, at)
    if quant.is_quantized(w):
        # Made to depend on x (adding zero, exactly), so that XLA dequantizes each weight when its
        # product is due: with no such dependency it dequantized every weight up front, a float32
        # copy of the model in a prefill's temporaries. An optimization barrier does not survive
        # to XLA's CPU scheduler.
        out_dtype = result_dtype(x.dtype, x.dtype, preferred_element_type)
        zero = (0 * x.reshape(-1)[0]).astype(w["scale"].dtype)
        w = {**w, "scale": w["scale"] + zero}
        narrow = (lambda v: v.astype(x.dtype)) if jnp.dtype(x.dtype).itemsize < 4 else (lambda v: v)  # as a float base in a 16-bit pass
        if quant.bits_of(w) == 4:  # x's even entries by the low nibbles' rows, its odd ones by the high nibbles'
            even, odd = quant.dequantize_nibbles(w, n_in)
            return (tensordot(x[..., 0::2], narrow(even), n_in, precision, jnp.float32)
                    + tensordot(x[..., 1::2], narrow(odd), n_in, precision, jnp.float32)).astype(out_dtype)
        return tensordot(x, narrow(quant.dense(w, n_in)), n_in, precision, out_dtype)
    out_dtype = result_dtype(x.dtype, w.dtype, preferred_element_type)
    if jnp.dtype(w.dtype).itemsize < jnp.dtype(x.dtype).itemsize:
        x = x.astype(w.dtype)
    return tensordot(x, w, n_in, precision, out_dtype)


def batched_matmul(x_SMK, w_LSKN, at, precision=None):
    """`x[s] @ w[at, s]` for each s, in float32: the kernel where a product of M rows applies, else XLA's
    batched dot. For the fused draft adapters' B factors (`adapters.DraftLoRA`), whose batched dot of
    a few rows cost XLA more than the projection's own product (docs/cpu.md, "The loop's own operations")."""
    if applies(x_SMK.shape[1], x_SMK.dtype, w_LSKN.dtype):
        return _kernel(x_SMK.astype(jnp.float32), w_LSKN, at)[0]
    w_SKN = entry(w_LSKN, at)
    return jax.lax.dot_general(x_SMK.astype(w_SKN.dtype), w_SKN, (((2,), (1,)), ((0,), (0,))), precision=precision,
                               preferred_element_type=jnp.float32)


def float32_handlers_apply(*dtypes) -> bool:
    """Whether the kernel's float32-only handlers apply to operands of these dtypes (decided when
    tracing): a decode pass's attention over each row's live cache slots (`cache_attention`) and the
    draft head's live context columns (`column_logits`)."""
    return all(d == jnp.float32 for d in dtypes) and on_one_cpu() and available()


MAX_ATTENTION_TOKENS = 64  # a decode pass's block, at most: a prefill's attention stays with XLA


def cache_attention_applies(block_len: int, head_dim: int, *dtypes) -> bool:
    """Whether `cache_attention` applies to a pass of `block_len` tokens, heads of `head_dim` (whole
    vectors of 16) and operands of these dtypes."""
    return block_len <= MAX_ATTENTION_TOKENS and head_dim % 16 == 0 and float32_handlers_apply(*dtypes)


def cache_attention(q_BTKGE, keys_LBKSE, values_LBKES, k_BTKE, v_BTKE, block_mask_BTT, lengths_B, at, scale: float):
    """`[B, T, K, G, E]`: a decode pass's attention of its queries over layer `at` of the cache (keys
    `[L, B, K, S, E]`, values `[L, B, K, E, S]`) at the slots below each row's `lengths_B`, and over
    its own block's keys and values where `block_mask_BTT` allows: scores, softmax and the weighted
    values in one kernel call, which reads no slot past a row's length."""
    if not _registered():
        raise RuntimeError("attention over the cache needs the few-row CPU kernel, which is unavailable here (see the warning above)")
    B, T, K, G, E = q_BTKGE.shape
    q_BKRE = q_BTKGE.transpose(0, 2, 3, 1, 4).reshape(B, K, G * T, E)  # row g * T + t
    block_k_BKTE, block_v_BKTE = k_BTKE.transpose(0, 2, 1, 3), v_BTKE.transpose(0, 2, 1, 3)
    mask_BTT = jnp.broadcast_to(block_mask_BTT, (B, T, T))
    out = jax.ShapeDtypeStruct(q_BKRE.shape, jnp.float32)
    out_BKRE = jax.ffi.ffi_call(TARGET_CACHE_ATTENTION, out, vmap_method="sequential")(
        q_BKRE, keys_LBKSE, values_LBKES, block_k_BKTE, block_v_BKTE, mask_BTT, lengths_B.astype(jnp.int32), _at(at),
        scale=np.float32(scale))
    return out_BKRE.reshape(B, K, G, T, E).transpose(0, 3, 1, 2, 4)
