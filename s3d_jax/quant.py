"""Weight-only quantization: the projections' weights in int8 or int4 and the vocabulary tables in
int8, everything else in float32.

A quantized weight is a dict in the params tree, grouped in `GROUP` consecutive entries along its
last input axis (shapes below for a weight `[*in, *out]` with `in[-1] = K`):
  - int8, GGUF's Q8_0: `{"values": int8 [*in, *out], "scale": float32 [.., K/GROUP, *out]}`, worth
    `values * scale`;
  - int4, GGUF's Q4_1: `{"values": uint8 [.., K/2, *out], "scale", "min": float16 [.., K/GROUP, *out]}`,
    worth `q * scale + min` for q in 0..15, two entries per byte (entry 2j in the low nibble of byte
    j, 2j+1 in its high one). The scales are float16, as GGUF stores them, so `q * scale` is exact in
    float32 and a fused multiply-add rounds the entry as a multiply and an add do.
Each entry is one float32 value, so a product with a quantized weight equals a product with that
float32 weight: decoding a quantized model is decoding the float32 model whose weights are the
dequantized ones, and speculative decoding stays token-exact. A vocabulary table `[D, V]` is grouped
along D, the head's input, and a token's embedding is its dequantized column; the tables are int8 in
an int4 model too, as llama.cpp's Q4 files keep them (docs/models.md, "Precisions"). Norms and biases
stay float32, and an applied drafter's adapters are bfloat16 (`drafter.DECODE_DTYPE`).

`few_rows.matmul` reads a quantized weight directly in the CPU kernel (decode passes) and
dequantizes it for XLA's dot everywhere else (prefill, training, other backends).
"""

from __future__ import annotations

from collections.abc import Mapping

import jax.numpy as jnp
import numpy as np

from s3d_jax.config import QUANT_GROUP as GROUP  # entries sharing a scale, along a weight's last input axis

# The weights quantized, by name, with their input axes; the rest stay float32. Conversion reads the
# parts of the fused projections (q, k, v; gate, up) separately before it fuses them (`model`).
QUANTIZED_INPUTS = {"qkv": 1, "o": 2, "gate_up": 1, "down": 1, "q": 1, "k": 1, "v": 1, "gate": 1, "up": 1,  # o reads [H, E]
                    "embed": 1, "lm_head": 1, "draft_head": 1}  # vocabulary tables [D, V]
VOCABULARY_TABLES = ("embed", "lm_head", "draft_head")
BITS = {"int8": 8, "int4": 4}  # a quantized dtype's projections
LEVELS = {8: 127, 4: 15}  # int8: -127..127 times the scale; int4: 0..15 times it, plus the minimum


def bits_for(dtype: str, name: str) -> int:
    """The bits of weight `name` in a model of quantized `dtype`: vocabulary tables are int8 at any."""
    return 8 if name in VOCABULARY_TABLES else BITS[dtype]


def is_quantized(w) -> bool:
    return isinstance(w, Mapping) and "values" in w  # a dict, or flax's FrozenDict inside a module


def bits_of(w) -> int:
    return 4 if "min" in w else 8


def _grouped(w, n_in: int):
    """`w [*in, *out]` as `[.., K/GROUP, GROUP, *out]`."""
    in_shape, out_shape = w.shape[:n_in], w.shape[n_in:]
    return w.reshape(*in_shape[:-1], in_shape[-1] // GROUP, GROUP, *out_shape)


def quantize(w, n_in: int, bits: int = 8) -> dict:
    """`w` in groups along the last of its `n_in` input axes, rounded to nearest as GGUF's Q8_0 and
    Q4_1 round: int8 with scale = max |w| / 127, int4 with scale = (max - min) / 15 and the minimum.
    Numpy arrays stay numpy: conversion quantizes on the host."""
    xp = np if isinstance(w, np.ndarray) else jnp
    size = w.shape[n_in - 1]
    if size % GROUP:
        raise ValueError(f"a weight of shape {w.shape} cannot be quantized: its input size {size} is not a multiple of {GROUP}")
    grouped = _grouped(xp.asarray(w, np.float32), n_in)
    if bits == 8:
        scale = xp.max(xp.abs(grouped), axis=n_in) * np.float32(1 / 127)  # XLA turns a division into this product
        safe = xp.where(scale == 0, 1, scale)
        values = xp.clip(xp.round(grouped / xp.expand_dims(safe, n_in)), -127, 127).astype(np.int8)
        return {"values": values.reshape(w.shape), "scale": scale.astype(np.float32)}
    if bits != 4:
        raise ValueError(f"cannot quantize to {bits} bits: 8 and 4 are the formats")
    low = xp.min(grouped, axis=n_in).astype(np.float16)
    scale = ((xp.max(grouped, axis=n_in) - low.astype(np.float32)) * np.float32(1 / 15)).astype(np.float16)
    safe = xp.where(scale == 0, 1, scale.astype(np.float32))
    shifted = grouped - xp.expand_dims(low.astype(np.float32), n_in)
    q = xp.clip(xp.round(shifted / xp.expand_dims(safe, n_in)), 0, 15).astype(np.uint8)
    return {"values": pack_nibbles(q.reshape(w.shape), n_in), "scale": scale, "min": low}


def pack_nibbles(q, n_in: int):
    """Codes 0..15 `[*in, *out]` as bytes `[.., K/2, *out]`: entry 2j in byte j's low nibble, 2j+1 in its high."""
    pairs = q.reshape(*q.shape[: n_in - 1], q.shape[n_in - 1] // 2, 2, *q.shape[n_in:])
    low, high = (pairs[(slice(None),) * n_in + (i,)] for i in (0, 1))
    return low | (high << 4)


def unpack_nibbles(values, n_in: int):
    """The inverse of `pack_nibbles`."""
    xp = np if isinstance(values, np.ndarray) else jnp
    pairs = xp.stack([values & 15, values >> 4], axis=n_in)
    return pairs.reshape(*values.shape[: n_in - 1], values.shape[n_in - 1] * 2, *values.shape[n_in:])


def dequantize(w: Mapping, n_in: int):
    """The float32 weight a quantized one stands for (the same products the CPU kernel rounds)."""
    if bits_of(w) == 4:  # the two nibbles' rows, interleaved back in place
        even, odd = dequantize_nibbles(w, n_in)
        pairs = jnp.stack([even, odd], axis=n_in)
        return pairs.reshape(*even.shape[: n_in - 1], even.shape[n_in - 1] * 2, *even.shape[n_in:])
    grouped = _grouped(w["values"], n_in).astype(jnp.float32)
    return (grouped * jnp.expand_dims(w["scale"].astype(jnp.float32), n_in)).reshape(w["values"].shape)


def dequantize_nibbles(w: Mapping, n_in: int):
    """An int4 weight's float32 value as two arrays `[.., K/2, *out]`: its even entries along K and its
    odd ones, the low and the high nibbles. A product reads them against x's even and odd entries
    (`few_rows`): XLA's CPU took five times longer to interleave the two into one weight than to
    compute them (docs/cpu.md, "Prefill at int4")."""
    scale, low = (jnp.expand_dims(w[k].astype(jnp.float32), n_in) for k in ("scale", "min"))

    def half(codes):  # [.., K/2, *out] in groups of GROUP/2 along K/2
        grouped = codes.reshape(*codes.shape[: n_in - 1], codes.shape[n_in - 1] // (GROUP // 2), GROUP // 2, *codes.shape[n_in:])
        return (grouped.astype(jnp.float32) * scale + low).reshape(codes.shape)

    return half(w["values"] & 15), half(w["values"] >> 4)


def initializer(init, bits: int):
    """A flax initializer of a quantized weight: `init`'s float32 weight, quantized."""

    def init_quantized(rng, in_shape, out_shape):
        return quantize(init(rng, (*in_shape, *out_shape), jnp.float32), len(in_shape), bits)

    return init_quantized


def dense(w, n_in: int = 1):
    """`w` as a float array: dequantized if quantized."""
    return dequantize(w, n_in) if is_quantized(w) else w


def columns(table, ids):
    """Columns `ids` (any shape) of a vocabulary table `[D, V]`, as `[D, *ids.shape]` in float."""
    return dense(select_columns(table, ids))


def select_columns(table, ids):
    """A table of the columns `ids` of `table`, quantized as `table` is (a reduced draft head)."""
    if not is_quantized(table):
        return jnp.take(table, ids, axis=1)
    return {k: jnp.take(v, ids, axis=1) for k, v in table.items()}


def set_column(table, index: int, column):
    """`table` with column `index` replaced by the float vector `column` (quantized if the table is)."""
    if not is_quantized(table):
        return table.at[:, index].set(jnp.asarray(column, table.dtype))
    one = quantize(jnp.asarray(column, jnp.float32)[:, None], 1, bits_of(table))
    return {k: table[k].at[:, index].set(one[k][:, 0]) for k in table}


def quantize_params(params, dtype: str):
    """Params with every weight of `QUANTIZED_INPUTS` in the format quantized `dtype` gives it (the
    layout `model.abstract_params` gives a config of that dtype); a weight quantized otherwise is
    requantized from its float32 value."""

    def to_format(w, n_in, name):
        bits = bits_for(dtype, name)
        return w if is_quantized(w) and bits_of(w) == bits else quantize(dense(w, n_in), n_in, bits)

    return _map_quantized(params, to_format)


def dequantize_params(params):
    """Params with every quantized weight in float32."""
    return _map_quantized(params, lambda w, n_in, name: dense(w, n_in))


def _map_quantized(params, fn):
    def visit(name, node, stacked):  # a weight in the layer stack has the layer axis before its inputs
        if isinstance(node, Mapping) and not is_quantized(node):
            return {k: visit(k, v, stacked or k == "layers") for k, v in node.items()}
        return fn(node, QUANTIZED_INPUTS[name] + stacked, name) if name in QUANTIZED_INPUTS else node

    return visit(None, params, False)
