"""Weight-only quantization: the projections' weights in int8, everything else in float32.

A quantized weight is a dict in the params tree, `{"values": int8 [*in, *out], "scale": float32
[*in[:-1], in[-1] / GROUP, *out]}`: groups of `GROUP` consecutive entries along the last input axis,
one scale per group and output (the layout of GGUF's Q8_0, whose blocks load as they are). Its value
is `values * scale`, one float32 product per entry, so a product with the quantized weight equals a
product with that float32 weight: decoding in int8 is decoding a float32 model whose weights are the
dequantized ones, and speculative decoding stays token-exact. Norms, embeddings, the head and the
drafter's adapters stay float32 (docs/models.md, "Precisions").

`few_rows.matmul` reads a quantized weight directly in the CPU kernel (decode passes) and
dequantizes it for XLA's dot everywhere else (prefill, training, other backends).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from s3d_jax.config import QUANT_GROUP as GROUP  # entries sharing a scale, along a weight's last input axis

PROJECTIONS = ("q", "k", "v", "o", "gate", "up", "down")  # the weights quantized; the rest stay float32


def is_quantized(w) -> bool:
    return isinstance(w, dict) and "values" in w


def scale_shape(in_shape, out_shape) -> tuple[int, ...]:
    return (*in_shape[:-1], in_shape[-1] // GROUP, *out_shape)


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


def projection_inputs(name: str) -> int | None:
    """The input axes of the projection weight called `name` in a layer, or None for any other parameter."""
    if name not in PROJECTIONS:
        return None
    return 2 if name == "o" else 1  # o reads [heads, head_dim]


def quantize_params(params):
    """Float params with every projection weight quantized (the layout `model.abstract_params` gives
    a config whose dtype is a quantized format)."""
    return _map_projections(params, lambda w, n_in: quantize(w, n_in))


def dequantize_params(params):
    """Quantized params with every projection weight in float32."""
    return _map_projections(params, lambda w, n_in: dequantize(w, n_in) if is_quantized(w) else w)


def _map_projections(params, fn):
    def visit(path, node):
        if isinstance(node, dict) and not is_quantized(node):
            return {k: visit((*path, jax.tree_util.DictKey(k)), v) for k, v in node.items()}
        n_in = projection_inputs(path[-1].key) if path else None
        return node if n_in is None else fn(node, n_in)

    return visit((), params)
