"""Weight-only quantization: the projections' weights and the vocabulary tables in int8, everything
else in float32.

A quantized weight is a dict in the params tree, `{"values": int8 [*in, *out], "scale": float32
[*in[:-1], in[-1] / GROUP, *out]}`: groups of `GROUP` consecutive entries along the last input axis,
one scale per group and output (the layout of GGUF's Q8_0). Its value is `values * scale`, one
float32 product per entry, so a product with the quantized weight equals a product with that float32
weight: decoding in int8 is decoding a float32 model whose weights are the dequantized ones, and
speculative decoding stays token-exact. A vocabulary table `[D, V]` is grouped along D, the head's
input, and a token's embedding is its dequantized column. Norms, biases and the drafter's adapters
stay float32 (docs/models.md, "Precisions").

`few_rows.matmul` reads a quantized weight directly in the CPU kernel (decode passes) and
dequantizes it for XLA's dot everywhere else (prefill, training, other backends).
"""

from __future__ import annotations

from collections.abc import Mapping

import jax.numpy as jnp
import numpy as np

from s3d_jax.config import QUANT_GROUP as GROUP  # entries sharing a scale, along a weight's last input axis

# The weights quantized, by name, with their input axes; the rest stay float32.
QUANTIZED_INPUTS = {"q": 1, "k": 1, "v": 1, "o": 2, "gate": 1, "up": 1, "down": 1,  # o reads [heads, head_dim]
                    "embed": 1, "lm_head": 1, "draft_head": 1}  # vocabulary tables [D, V]


def is_quantized(w) -> bool:
    return isinstance(w, Mapping) and "values" in w  # a dict, or flax's FrozenDict inside a module


def quantize(w, n_in: int) -> dict:
    """Symmetric int8 in groups along the last of the `n_in` input axes: scale = max |w| / 127, as
    GGUF's Q8_0 rounds (numpy arrays stay numpy: conversion quantizes on the host)."""
    xp = np if isinstance(w, np.ndarray) else jnp
    in_shape, out_shape = w.shape[:n_in], w.shape[n_in:]
    if in_shape[-1] % GROUP:
        raise ValueError(f"a weight of shape {w.shape} cannot be quantized: its input size {in_shape[-1]} is not a multiple of {GROUP}")
    grouped = xp.asarray(w, np.float32).reshape(*in_shape[:-1], in_shape[-1] // GROUP, GROUP, *out_shape)
    scale = xp.max(xp.abs(grouped), axis=n_in) * np.float32(1 / 127)  # XLA turns a division into this product
    safe = xp.where(scale == 0, 1, scale)
    values = xp.clip(xp.round(grouped / xp.expand_dims(safe, n_in)), -127, 127).astype(np.int8)
    return {"values": values.reshape(w.shape), "scale": scale.astype(np.float32)}


def dequantize(w: dict, n_in: int):
    """The float32 weight a quantized one stands for (the same products the CPU kernel rounds)."""
    values = w["values"]
    in_shape, out_shape = values.shape[:n_in], values.shape[n_in:]
    grouped = values.reshape(*in_shape[:-1], in_shape[-1] // GROUP, GROUP, *out_shape).astype(jnp.float32)
    return (grouped * jnp.expand_dims(w["scale"], n_in)).reshape(values.shape)


def initializer(init):
    """A flax initializer of a quantized weight: `init`'s float32 weight, quantized."""

    def init_quantized(rng, in_shape, out_shape):
        return quantize(init(rng, (*in_shape, *out_shape), jnp.float32), len(in_shape))

    return init_quantized


def dense(w, n_in: int = 1):
    """`w` as a float array: dequantized if quantized."""
    return dequantize(w, n_in) if is_quantized(w) else w


def columns(table, ids):
    """Columns `ids` (any shape) of a vocabulary table `[D, V]`, as `[D, *ids.shape]` in float."""
    if not is_quantized(table):
        return jnp.take(table, ids, axis=1)
    return dense({"values": jnp.take(table["values"], ids, axis=1), "scale": jnp.take(table["scale"], ids, axis=1)})


def select_columns(table, ids):
    """A table of the columns `ids` of `table`, quantized as `table` is (a reduced draft head)."""
    if not is_quantized(table):
        return jnp.take(table, ids, axis=1)
    return {k: jnp.take(v, ids, axis=1) for k, v in table.items()}


def set_column(table, index: int, column):
    """`table` with column `index` replaced by the float vector `column` (quantized if the table is)."""
    if not is_quantized(table):
        return table.at[:, index].set(jnp.asarray(column, table.dtype))
    one = quantize(jnp.asarray(column, jnp.float32)[:, None], 1)
    return {k: table[k].at[:, index].set(one[k][:, 0]) for k in table}


def quantize_params(params):
    """Float params with every weight of `QUANTIZED_INPUTS` quantized (the layout `model.abstract_params`
    gives a config whose dtype is a quantized format)."""
    return _map_quantized(params, lambda w, n_in: w if is_quantized(w) else quantize(w, n_in))


def dequantize_params(params):
    """Params with every quantized weight in float32."""
    return _map_quantized(params, lambda w, n_in: dense(w, n_in))


def _map_quantized(params, fn):
    def visit(name, node):
        if isinstance(node, dict) and not is_quantized(node):
            return {k: visit(k, v) for k, v in node.items()}
        return fn(node, QUANTIZED_INPUTS[name]) if name in QUANTIZED_INPUTS else node

    return visit(None, params)
