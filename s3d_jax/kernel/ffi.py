"""The kernel's handlers registered with XLA, and the calls into them.

`S3D_JAX_FEW_ROW_KERNEL` (`0`/`false`/`no`/`off`) keeps every product and the attention on XLA's
operations. It is read when a function is traced, unless `switch(on)` says otherwise there; the
decode engine's caches key on it (`decoding.compile_ahead`). The product calls are differentiable.
"""

from __future__ import annotations

import contextlib
import contextvars
import ctypes
import functools
import warnings

import jax
import jax.numpy as jnp
import numpy as np

from s3d_jax import quant
from s3d_jax.kernel import build
from s3d_jax.settings import env_switch

ENV_SWITCH = "S3D_JAX_FEW_ROW_KERNEL"
TARGET = "s3d_few_row_matmul"
TARGET_INT8 = "s3d_few_row_matmul_int8"
TARGET_INT4 = "s3d_few_row_matmul_int4"
TARGET_CACHE_ATTENTION = "s3d_cache_attention"
TARGET_CONTEXT_LOGITS = "s3d_context_logits"
TARGET_TABLE_COLUMNS = "s3d_table_columns"
PRODUCT_TARGETS = (TARGET, TARGET_INT8, TARGET_INT4)

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


def available() -> bool:
    """Whether the kernel is on: switched on, built (once per machine) and registered with XLA."""
    return switched_on() and registered()


def on_one_cpu() -> bool:
    return jax.default_backend() == "cpu" and jax.device_count() == 1  # sharded products stay with XLA's partitioner


def prepare() -> None:
    """Builds and registers the kernel now if it can apply (a CPU backend with one device, switched
    on), so that a first build is not counted in a compile's time."""
    if on_one_cpu():
        available()


def _load(path) -> dict:
    """The library's handlers by FFI target, its helper threads configured."""
    library = ctypes.cdll.LoadLibrary(str(path))
    handlers = {TARGET: library.S3dFewRowMatmul, TARGET_INT8: library.S3dFewRowMatmulInt8,  # AttributeError: not our library
                TARGET_INT4: library.S3dFewRowMatmulInt4, TARGET_CACHE_ATTENTION: library.S3dCacheAttention,
                TARGET_CONTEXT_LOGITS: library.S3dContextLogits, TARGET_TABLE_COLUMNS: library.S3dTableColumns}
    configure = library.S3dFewRowConfigure
    configure.argtypes = [ctypes.c_int64, ctypes.c_int64]
    configure(build.threads(), build.spin_microseconds())
    return handlers


@functools.cache
def registered() -> bool:
    """Whether the handlers are registered with XLA: built (or checked) and loaded once per process;
    a failure warns once and leaves every operation on XLA. `registered.cache_clear()` tries again."""
    try:
        for target, handler in _load(build.built_library()).items():
            jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(handler), platform="cpu")
    except (OSError, RuntimeError, AttributeError, ValueError) as error:
        warnings.warn(f"few-row CPU kernel unavailable, decoding uses XLA's dot: {error}", RuntimeWarning, stacklevel=3)
        return False
    return True


def entry(stack, at):
    """Entry `at` of a stack `[L, ...]` (a quantized weight's parts alike): XLA's slice, a copy where
    an operation cannot read it in place. The kernel reads the entry inside the whole stack instead."""
    return jax.tree.map(lambda part: jax.lax.dynamic_index_in_dim(part, at, keepdims=False), stack)


def _at(at):
    """Entries as the kernel reads them (`Entry` in cc/few_rows.h): one, or one per weight of a product."""
    return jnp.asarray(at, jnp.int32) if not isinstance(at, tuple) else jnp.stack([jnp.asarray(a, jnp.int32) for a in at])


def per_weight(at, count: int) -> tuple:
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
def product(x_MK, w_LKN, at, beside=()):
    """`x @ w[at[0]]` and `x @ b[at[i + 1]]` for each float stack b of `beside`, in one call (`at` one
    entry per weight, or a scalar with nothing beside); or with a batch axis (`x [S, M, K]`,
    `w [L, S, K, N]`, nothing beside) each `x[s] @ w[at, s]`. Float32 results."""
    call = jax.ffi.ffi_call(TARGET, _results(x_MK, (w_LKN, *beside)), vmap_method="sequential")
    return tuple(call(x_MK, w_LKN, _at(at), *beside))


@product.defjvp
def _product_jvp(primals, tangents):
    (x, w, at, beside), (dx, dw, _, dbeside) = primals, tangents
    return product(x, w, at, beside), _float_tangents(x, dx, (w, *beside), (dw, *dbeside), per_weight(at, 1 + len(beside)))


@functools.partial(jax.custom_jvp, nondiff_argnums=(4,))
def quantized_product(x_MK, w, at, beside=(), int8_activations=False):
    """`product` with entry `at[0]` of a stack of quantized weights `[L, K, N]` (`quant`), and
    `x @ b[at[i + 1]]` for each float stack b of `beside`, in one call. With `int8_activations`, the
    product quantizes x per row and block of 16 and sums integers (cc/int8_rows.h, `Int8Rows`); its
    tangents are the float product's."""
    four_bits = quant.bits_of(w) == 4
    call = jax.ffi.ffi_call(TARGET_INT4 if four_bits else TARGET_INT8, _results(x_MK, (w["values"], *beside)),
                            vmap_method="sequential")
    low = w["min"] if "min" in w else jnp.zeros((0,), jnp.float32)  # an int8 weight without a minimum passes an empty one
    return tuple(call(x_MK, w["values"], w["scale"], low, _at(at), *beside, int8_activations=bool(int8_activations)))


@quantized_product.defjvp
def _quantized_product_jvp(int8_activations, primals, tangents):
    (x, stack, at, beside), (dx, dstack, _, dbeside) = primals, tangents
    ats = per_weight(at, 1 + len(beside))
    w, dw = entry(stack, ats[0]), entry(dstack, ats[0])
    # The weight is linear in its scales (and minimums) for fixed values, which have no tangent.
    dw_value = quant.dequantize({**{k: dw[k] for k in w if k != "values"}, "values": w["values"]}, 1)
    dy = dx @ quant.dequantize(w, 1) + x @ dw_value
    return quantized_product(x, stack, at, beside, int8_activations), (dy, *_float_tangents(x, dx, beside, dbeside, ats[1:]))


def cache_attention(q_BKRE, keys_LBKSE, values_LBKES, block_k_BKTE, block_v_BKTE, mask_BTT, lengths_B, at, scale: float):
    """`[B, K, R, E]` float32: the queries' attention over layer `at` of the cache below each row's
    length and over the block where `mask_BTT` allows, in one call (`dispatch.cache_attention`)."""
    if not registered():
        raise RuntimeError("attention over the cache needs the few-row CPU kernel, which is unavailable here (see the warning above)")
    out = jax.ShapeDtypeStruct(q_BKRE.shape, jnp.float32)
    return jax.ffi.ffi_call(TARGET_CACHE_ATTENTION, out, vmap_method="sequential")(
        q_BKRE, keys_LBKSE, values_LBKES, block_k_BKTE, block_v_BKTE, mask_BTT, lengths_B.astype(jnp.int32), _at(at),
        scale=np.float32(scale))


def context_logits(hidden_BTD, table_DV, ids_BL, counts_B):
    """`[B, T, L]` float32: each row's scores at the columns of its first `counts[b]` ids, the others 0."""
    out = jax.ShapeDtypeStruct((*hidden_BTD.shape[:2], ids_BL.shape[1]), jnp.float32)
    return jax.ffi.ffi_call(TARGET_CONTEXT_LOGITS, out, vmap_method="sequential")(
        hidden_BTD, table_DV, ids_BL.astype(jnp.int32), counts_B.astype(jnp.int32))


@jax.custom_jvp
def table_columns(table_DV, ids):
    """Columns `ids` of a 16-bit table as float32 `[D, *ids.shape]`, without widening the whole table."""
    out = jax.ShapeDtypeStruct((table_DV.shape[0], *ids.shape), jnp.float32)
    return jax.ffi.ffi_call(TARGET_TABLE_COLUMNS, out, vmap_method="sequential")(table_DV, ids)


@table_columns.defjvp
def _table_columns_jvp(primals, tangents):  # linear in the table (a drafter's trained mask row)
    (table, ids), (dtable, _) = primals, tangents
    return table_columns(table, ids), jnp.take(dtable, ids, axis=1).astype(jnp.float32)
