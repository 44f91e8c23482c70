"""Which operations go to the kernel, and XLA's operations for the rest.

XLA's CPU dot reads a weight at its streaming bandwidth for one row, but for 2 to 16 rows it packs
the weight first, so verifying 5 tokens cost about 2x a one-token step. The kernel reads the weight
once for all the rows, which is what speculative decoding needs from a CPU. It takes a product on a
CPU backend with one device, for a float32, bfloat16, float16, int8 or int4 weight (`quant`) and at
most `MAX_ROWS` rows (`MAX_NARROW_ROWS` for the narrower types), the switch on; `jnp.tensordot`
everywhere else, with a quantized weight dequantized first. A layer's weight comes as its stack
`[L, ...]` and the layer's (traced) index `at`, which the kernel reads at an offset and XLA's dot as a
slice (a copy on a CPU).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from s3d_jax import quant
from s3d_jax.kernel import ffi
from s3d_jax.kernel.ffi import entry

MAX_ROWS = 16  # beyond this (prefill, training) XLA's dot is the faster one
# A 16-bit or quantized weight's products stay in the kernel longer: XLA's CPU dot widens the whole
# weight to float32 first, and in a loop (the decode loop, a calibration's timing) it hoisted that
# widening out of the loop, a float32 copy of the model held throughout (docs/cpu.md, "bfloat16").
MAX_NARROW_ROWS = 64
MAX_ATTENTION_TOKENS = 64  # a decode pass's block, at most: a prefill's attention stays with XLA
INPUT_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)  # of x; the kernel sums in float32
QUANTIZED_WEIGHT_DTYPES = (jnp.int8, jnp.uint8)  # an int8 or int4 weight's values, with its scales (`quant`)
WEIGHT_DTYPES = (*INPUT_DTYPES, *QUANTIZED_WEIGHT_DTYPES)


def applies(rows: int, x_dtype, w_dtype, activations: str = "float32") -> bool:
    """Whether `matmul` uses the kernel for this product (decided when tracing). With int8 activations
    every weight's products stay in the kernel up to `MAX_NARROW_ROWS`: a pass of 17 to 64 rows would
    otherwise sum a float32 weight's products in XLA's order, not a step's, and the next product's
    rounding of its input to int8 would turn that last-bit difference into a visible one."""
    wide = w_dtype != jnp.float32 or activations == "int8"
    return (
        0 < rows <= (MAX_NARROW_ROWS if wide else MAX_ROWS)
        and x_dtype in INPUT_DTYPES
        and w_dtype in WEIGHT_DTYPES
        and ffi.on_one_cpu()
        and ffi.available()
    )


def float32_handlers_apply(*dtypes) -> bool:
    """Whether the kernel's float32-only handlers apply to operands of these dtypes (decided when
    tracing): a decode pass's attention over each row's live cache slots (`cache_attention`) and the
    draft head's live context columns (`column_logits`)."""
    return all(d == jnp.float32 for d in dtypes) and ffi.on_one_cpu() and ffi.available()


def cache_attention_applies(block_len: int, head_dim: int, *dtypes) -> bool:
    """Whether `cache_attention` applies to a pass of `block_len` tokens, heads of `head_dim` (whole
    vectors of 16) and operands of these dtypes."""
    return block_len <= MAX_ATTENTION_TOKENS and head_dim % 16 == 0 and float32_handlers_apply(*dtypes)


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


def matmul(x, w, n_in: int = 1, precision=None, preferred_element_type=None, at=None, activations="float32"):
    """`x @ w` over x's last `n_in` axes and w's first `n_in`, as `jnp.tensordot` with the same
    arguments; `w` may be a quantized weight (`quant`), which stands for its float32 value. With
    `at` (a traced index), `w` is a stack of weights `[L, ...]` and the product is with `w[at]`.

    With a 16-bit weight and float32 x (the model's activations), the kernel widens the weight in
    registers and multiplies x as it is; XLA's dot multiplies x rounded to the weight's type, its
    fast form (`tensordot`). Either way the result is float32. `activations="int8"` has the kernel
    quantize x for a quantized weight (`ModelConfig.activations`); XLA's dot always reads x as it is."""
    return matmuls(x, (w,), n_in, precision, preferred_element_type, at, activations)[0]


def matmuls(x, weights, n_in: int = 1, precision=None, preferred_element_type=None, at=None, activations="float32"):
    """`matmul(x, w, ...)` for each w of `weights`, in one kernel call where the kernel applies to them
    all: a draft adapter's A factor beside its projection, whose threads then take both products'
    parts from one hand-off (docs/cpu.md, "The few-row kernel"). Weights after the first are
    float; each result is what `matmul` would give alone, bit for bit. `at` is every weight's entry,
    or a tuple of one per weight (an adapter's stack holds other layers than its projection's)."""
    w, beside = weights[0], weights[1:]
    quantized = quant.is_quantized(w)
    ats = ffi.per_weight(at, len(weights))
    stacks = tuple(v if a is not None else jax.tree.map(lambda part: part[None], v) for v, a in zip(weights, ats))
    values = [stacks[0]["values"] if quantized else stacks[0], *stacks[1:]]
    lead = x.shape[: x.ndim - n_in]
    rows = math.prod(lead)
    if not all(applies(rows, x.dtype, v.dtype, activations) and (i == 0 or v.dtype in INPUT_DTYPES) for i, v in enumerate(values)):
        return tuple(_xla_matmul(x, v, n_in, precision, preferred_element_type, a) for v, a in zip(weights, ats))
    K = math.prod(x.shape[x.ndim - n_in:])
    x_MK = x.reshape(rows, K).astype(jnp.float32)  # exact from 16 bits
    at = tuple(0 if a is None else a for a in ats) if beside else (0 if ats[0] is None else ats[0])
    beside_LKN = tuple(b.reshape(b.shape[0], K, -1) for b in stacks[1:])
    if quantized:
        N = math.prod(values[0].shape[1 + n_in:])
        ys = ffi.quantized_product(x_MK, {k: v.reshape(v.shape[0], -1, N) for k, v in stacks[0].items()}, at, beside_LKN,
                                   activations == "int8")
    else:
        ys = ffi.product(x_MK, stacks[0].reshape(stacks[0].shape[0], K, -1), at, beside_LKN)
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
        return ffi.product(x_SMK.astype(jnp.float32), w_LSKN, at)[0]
    w_SKN = entry(w_LSKN, at)
    return jax.lax.dot_general(x_SMK.astype(w_SKN.dtype), w_SKN, (((2,), (1,)), ((0,), (0,))), precision=precision,
                               preferred_element_type=jnp.float32)


def cache_attention(q_BTKGE, keys_LBKSE, values_LBKES, k_BTKE, v_BTKE, block_mask_BTT, lengths_B, at, scale: float):
    """`[B, T, K, G, E]`: a decode pass's attention of its queries over layer `at` of the cache (keys
    `[L, B, K, S, E]`, values `[L, B, K, E, S]`) at the slots below each row's `lengths_B`, and over
    its own block's keys and values where `block_mask_BTT` allows: scores, softmax and the weighted
    values in one kernel call, which reads no slot past a row's length."""
    B, T, K, G, E = q_BTKGE.shape
    q_BKRE = q_BTKGE.transpose(0, 2, 3, 1, 4).reshape(B, K, G * T, E)  # row g * T + t
    block_k_BKTE, block_v_BKTE = k_BTKE.transpose(0, 2, 1, 3), v_BTKE.transpose(0, 2, 1, 3)
    mask_BTT = jnp.broadcast_to(block_mask_BTT, (B, T, T))
    out_BKRE = ffi.cache_attention(q_BKRE, keys_LBKSE, values_LBKES, block_k_BKTE, block_v_BKTE, mask_BTT, lengths_B, at, scale)
    return out_BKRE.reshape(B, K, G, T, E).transpose(0, 3, 1, 2, 4)


def column_logits(hidden_BTD, table_DV, ids_BL, counts_B, precision=None):
    """`[B, T, L]`: each row's hidden states against the columns of a vocabulary table `[D, V]` at its
    own ids, for the first `counts[b]` ids of row b that lie inside the table; the others may hold
    anything, and the caller drops them. The kernel, where it applies (a float32 table), reads only
    those ids' columns, each distinct id's once, and sets the others to 0; XLA gathers every id's
    column first, a cost that grows with L (the draft head's context is the whole token buffer,
    `docs/cpu.md`, "The loop's own operations")."""
    if float32_handlers_apply(hidden_BTD.dtype, getattr(table_DV, "dtype", None)):
        return ffi.context_logits(hidden_BTD, table_DV, ids_BL, counts_B)
    vocab = (table_DV["values"] if quant.is_quantized(table_DV) else table_DV).shape[1]
    ids_BL = jnp.clip(ids_BL, 0, vocab - 1)  # ids outside the table: scored as its last, and dropped by the caller
    return jnp.einsum("btd,dbl->btl", hidden_BTD, columns(table_DV, ids_BL), preferred_element_type=jnp.float32,
                      precision=precision)


def columns(table_DV, ids):
    """Columns `ids` (any shape) of a vocabulary table as float32 `[D, *ids.shape]` (`quant.columns`).
    A 16-bit table's come from the kernel: XLA's CPU widens the whole table before its gather and, in
    the decode loop, hoisted that out, a float32 copy of the table held for as long as the loop ran
    (docs/cpu.md, "bfloat16")."""
    if getattr(table_DV, "dtype", None) in (jnp.bfloat16, jnp.float16) and ffi.on_one_cpu() and ffi.available():
        return ffi.table_columns(table_DV, ids.astype(jnp.int32))
    return quant.columns(table_DV, ids).astype(jnp.float32)
