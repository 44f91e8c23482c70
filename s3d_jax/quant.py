"""Weight-only quantization: the projections' weights in int8 or int4 and the vocabulary tables in
int8, everything else in float32.

A quantized weight is a dict in the params tree, grouped in `group` (32 or 16) consecutive entries
along its last input axis (shapes below for a weight `[*in, *out]` with `in[-1] = K`), in a `Format`:
  - 8 bits: `{"values": int8 [*in, *out], "scale": float32 [.., K/group, *out]}` and optionally
    `"min"` (float32, the same shape), worth `values * scale (+ min)`. It holds GGUF's Q8_0 and
    Q5_0 (codes q - 16) in groups of 32, Q5_1 and Q5_K with the minimum, and Q6_K (codes q - 32) in
    Q6_K's groups of 16;
  - 4 bits: `{"values": uint8 [.., K/2, *out], "scale", "min": [.., K/group, *out]}`, worth
    `q * scale + min` for q in 0..15, two entries per byte (entry 2j in the low nibble of byte j,
    2j+1 in its high one). The scales are float16 as Q4_0 and Q4_1 store them, or float32 for
    Q4_K, whose scale (a 6-bit code times a float16 factor) does not fit a float16.
Either way `q * scale` is exact in float32 (a GGUF block's factors have few enough bits, and
`quantize` rounds a float32 scale to as few), so a fused multiply-add rounds an entry as a multiply
and an add do. Each entry is one float32 value, so a product with a quantized weight equals a
product with that float32 weight: decoding a quantized model is decoding the float32 model whose
weights are the dequantized ones, and speculative decoding stays token-exact. A vocabulary table
`[D, V]` is grouped along D, the head's input, and a token's embedding is its dequantized column;
the tables are 8-bit in an int4 model too, as llama.cpp's Q4 files keep them (docs/models.md,
"Precisions"). Norms and biases stay float32, and an applied drafter's adapters are bfloat16
(`drafter.DECODE_DTYPE`). A model's formats are its dtype's (`INT8`, `INT4`) unless its config
names others per weight (`ModelConfig.weight_formats`), as a GGUF's kept blocks need (convert/gguf_file.py).

`ops.linear` reads a quantized weight directly in the CPU kernel (decode passes) and
dequantizes it for XLA's dot everywhere else (prefill, training, other backends).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np

from s3d_jax.config import QUANT_GROUP as GROUP  # entries sharing a scale, along a weight's last input axis
from s3d_jax.config import weight_format_fields

# The weights quantized, by name, with their input axes; the rest stay float32. Conversion reads the
# parts of the fused projections (q, k, v; gate, up) separately before it fuses them (`model`).
QUANTIZED_INPUTS = {"qkv": 1, "o": 2, "gate_up": 1, "down": 1, "q": 1, "k": 1, "v": 1, "gate": 1, "up": 1,  # o reads [H, E]
                    "embed": 1, "lm_head": 1, "draft_head": 1}  # vocabulary tables [D, V]
VOCABULARY_TABLES = ("embed", "lm_head", "draft_head")
FUSED_INTO = {"q": "qkv", "k": "qkv", "v": "qkv", "gate": "gate_up", "up": "gate_up"}  # a part's format is its fused weight's


@dataclasses.dataclass(frozen=True, order=True)
class Format:
    """How a quantized weight holds its entries; `name` is how a config writes it: `int8`, `int4`,
    with `-g16` for groups of 16, `-min` for an 8-bit minimum, `-f32` for 4-bit float32 scales."""

    bits: int  # 8: int8 codes; 4: codes 0..15, two per byte, always with a minimum
    group: int = GROUP  # entries per scale along the last input axis: 32 or 16
    min: bool = False  # a per-group minimum (8 bits; 4 bits have one always)
    scale_dtype: str = "float32"  # of the scales and minimums: float32, or float16 (4 bits)

    def __post_init__(self):
        if (self.bits, self.group) not in {(8, 32), (8, 16), (4, 32), (4, 16)} or self.scale_dtype not in ("float32", "float16") or (
                self.bits == 8 and self.scale_dtype != "float32") or (self.bits == 4 and not self.min):
            raise ValueError(f"no such weight format: {self}")

    @property
    def name(self) -> str:
        return (f"int{self.bits}" + ("-g16" if self.group == 16 else "") + ("-min" if self.min and self.bits == 8 else "")
                + ("-f32" if self.bits == 4 and self.scale_dtype == "float32" else ""))

    @classmethod
    def parse(cls, name: str) -> Format:
        fields = weight_format_fields(name)
        if fields is None:
            raise ValueError(f"unknown weight format {name!r}: int8 or int4, then -g16 (groups of 16), -min (int8), -f32 (int4)")
        return cls(*fields)

    def widest(self, other: Format) -> Format:
        """The narrowest format that holds every value of both exactly."""
        bits = max(self.bits, other.bits)
        return Format(bits, min(self.group, other.group), self.min or other.min,
                      "float16" if bits == 4 and self.scale_dtype == other.scale_dtype == "float16" else "float32")


INT8, INT4 = Format(8), Format(4, min=True, scale_dtype="float16")  # the dtypes' own: GGUF's Q8_0 and Q4_1
DTYPE_FORMATS = {"int8": INT8, "int4": INT4}


def format_for(config, name: str) -> Format:
    """The format of weight `name` in a quantized model of `config`."""
    return _format(config.dtype, config.weight_formats, name)


def _format(dtype: str, weight_formats, name: str) -> Format:
    """A config's own format for weight `name` (a fused projection's parts take the fused weight's),
    else its dtype's, vocabulary tables 8 bits at any."""
    named = dict(weight_formats)
    if FUSED_INTO.get(name, name) in named:
        return Format.parse(named[FUSED_INTO.get(name, name)])
    return INT8 if name in VOCABULARY_TABLES else DTYPE_FORMATS[dtype]


def is_quantized(w) -> bool:
    return isinstance(w, Mapping) and "values" in w  # a dict, or flax's FrozenDict inside a module


def bits_of(w) -> int:
    return 4 if w["values"].dtype == np.uint8 else 8


def format_of(w, n_in: int) -> Format:
    """The format a quantized weight with `n_in` input axes is held in."""
    bits = bits_of(w)
    K = w["values"].shape[n_in - 1] * (2 if bits == 4 else 1)
    return Format(bits, K // w["scale"].shape[n_in - 1], "min" in w, np.dtype(w["scale"].dtype).name)


def _grouped(w, n_in: int, group: int = GROUP):
    """`w [*in, *out]` as `[.., K/group, group, *out]`."""
    in_shape, out_shape = w.shape[:n_in], w.shape[n_in:]
    return w.reshape(*in_shape[:-1], in_shape[-1] // group, group, *out_shape)


def quantize(w, n_in: int, fmt: Format = INT8) -> dict:
    """`w` in groups along the last of its `n_in` input axes in format `fmt`, rounded to nearest as
    GGUF's Q8_0 and Q4_1 round: 8 bits with scale = max |w| / 127 (or, with a minimum, codes
    -127..127 about the group's midpoint), 4 bits with scale = (max - min) / 15 and the minimum.
    Numpy arrays stay numpy: conversion quantizes on the host."""
    xp = np if isinstance(w, np.ndarray) else jnp
    size = w.shape[n_in - 1]
    if size % fmt.group:
        raise ValueError(f"a weight of shape {w.shape} cannot be quantized: its input size {size} is not a multiple of {fmt.group}")
    grouped = _grouped(xp.asarray(w, np.float32), n_in, fmt.group)
    high, low = xp.max(grouped, axis=n_in), xp.min(grouped, axis=n_in)
    if fmt.bits == 8:
        middle = ((high + low) * np.float32(0.5)) if fmt.min else None
        # XLA turns a division into a product: the host computes the same one.
        scale = ((high - low) * np.float32(1 / 254)) if fmt.min else xp.max(xp.abs(grouped), axis=n_in) * np.float32(1 / 127)
        safe = xp.where(scale == 0, 1, scale)
        centred = grouped if middle is None else grouped - xp.expand_dims(middle, n_in)
        values = xp.clip(xp.round(centred / xp.expand_dims(safe, n_in)), -127, 127).astype(np.int8)
        scale = _exact_products(scale, 7) if fmt.min else scale
        return {"values": values.reshape(w.shape), "scale": scale.astype(np.float32), **({} if middle is None else {"min": middle})}
    low = low.astype(fmt.scale_dtype)
    scale = _exact_products(((high - low.astype(np.float32)) * np.float32(1 / 15)).astype(fmt.scale_dtype), 4)
    safe = xp.where(scale == 0, 1, scale.astype(np.float32))
    shifted = grouped - xp.expand_dims(low.astype(np.float32), n_in)
    q = xp.clip(xp.round(shifted / xp.expand_dims(safe, n_in)), 0, 15).astype(np.uint8)
    return {"values": pack_nibbles(q.reshape(w.shape), n_in), "scale": scale, "min": low}


def _exact_products(scale, code_bits: int):
    """`scale` rounded to as many significant bits as keep `code * scale` exact in float32 for codes
    of `code_bits` bits (a float16 scale already is), as a GGUF block's factors do: then a fused
    multiply-add of code, scale and minimum rounds as a multiply and an add, and XLA's fusions of a
    dequantization give the same entries compiled or not."""
    if scale.dtype != np.float32:
        return scale
    xp = np if isinstance(scale, np.ndarray) else jnp
    mantissa, exponent = xp.frexp(scale)
    return xp.ldexp(xp.round(mantissa * 2.0 ** (24 - code_bits)) / 2.0 ** (24 - code_bits), exponent).astype(np.float32)


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
    fmt, xp = format_of(w, n_in), _array_module(w)
    if fmt.bits == 4:  # the two nibbles' rows, interleaved back in place
        even, odd = dequantize_nibbles(w, n_in)
        pairs = xp.stack([even, odd], axis=n_in)
        return pairs.reshape(*even.shape[: n_in - 1], even.shape[n_in - 1] * 2, *even.shape[n_in:])
    grouped = _grouped(w["values"], n_in, fmt.group).astype(np.float32) * xp.expand_dims(w["scale"].astype(np.float32), n_in)
    if fmt.min:
        grouped = grouped + xp.expand_dims(w["min"].astype(np.float32), n_in)
    return grouped.reshape(w["values"].shape)


def _array_module(w: Mapping):
    """numpy for a weight held in numpy (conversion works on the host), else jax.numpy."""
    return np if all(isinstance(v, np.ndarray) for v in w.values()) else jnp


def dequantize_nibbles(w: Mapping, n_in: int):
    """A 4-bit weight's float32 value as two arrays `[.., K/2, *out]`: its even entries along K and its
    odd ones, the low and the high nibbles. A product reads them against x's even and odd entries
    (`s3d_jax.kernel`): XLA's CPU took five times longer to interleave the two into one weight than to
    compute them (docs/cpu.md, "Prefill at int4")."""
    half_group, xp = format_of(w, n_in).group // 2, _array_module(w)
    scale, low = (xp.expand_dims(w[k].astype(np.float32), n_in) for k in ("scale", "min"))

    def half(codes):  # [.., K/2, *out] in groups of group/2 along K/2
        grouped = codes.reshape(*codes.shape[: n_in - 1], codes.shape[n_in - 1] // half_group, half_group, *codes.shape[n_in:])
        return (grouped.astype(np.float32) * scale + low).reshape(codes.shape)

    return half(w["values"] & 15), half(w["values"] >> 4)


def initializer(init, fmt: Format):
    """A flax initializer of a quantized weight: `init`'s float32 weight, quantized."""

    def init_quantized(rng, in_shape, out_shape):
        return quantize(init(rng, (*in_shape, *out_shape), jnp.float32), len(in_shape), fmt)

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
    one = quantize(jnp.asarray(column, jnp.float32)[:, None], 1, format_of(table, 1))
    return {k: table[k].at[:, index].set(one[k][:, 0]) for k in table}


def quantize_params(params, dtype: str, weight_formats: tuple = ()):
    """Params with every weight of `QUANTIZED_INPUTS` in the format a config of quantized `dtype` and
    `weight_formats` gives it (the layout `model.abstract_params` gives that config); a weight held in
    another format is requantized from its float32 value."""

    def to_format(w, n_in, name):
        fmt = _format(dtype, weight_formats, name)
        return w if is_quantized(w) and format_of(w, n_in) == fmt else quantize(dense(w, n_in), n_in, fmt)

    return _map_quantized(params, to_format)


def cast_dtype(leaf_dtype, dtype):
    """A leaf's dtype once cast to `dtype`: floating-point leaves take it; the draft vocabulary's token ids stay integers."""
    return dtype if jnp.issubdtype(leaf_dtype, jnp.floating) else leaf_dtype


def cast_params(params, dtype):
    """Float leaves cast to `dtype`; a quantized weight keeps its format."""
    return jax.tree.map(lambda x: x if is_quantized(x) else x.astype(cast_dtype(x.dtype, dtype)), params, is_leaf=is_quantized)


def dequantize_params(params):
    """Params with every quantized weight in float32."""
    return _map_quantized(params, lambda w, n_in, name: dense(w, n_in))


def _map_quantized(params, fn):
    def visit(name, node, stacked):  # a weight in the layer stack has the layer axis before its inputs
        if isinstance(node, Mapping) and not is_quantized(node):
            return {k: visit(k, v, stacked or k == "layers") for k, v in node.items()}
        return fn(node, QUANTIZED_INPUTS[name] + stacked, name) if name in QUANTIZED_INPUTS else node

    return visit(None, params, False)
