"""Where a layer's attention looks, for a layer of the stack that is traced (`model`): its rotary
embedding (RoPE) and its sliding window. Gemma's layers differ (`ModelConfig.layer_types`): a
sliding-window layer has its own window and, in Gemma-3, its own RoPE base; where every layer is
alike, both are constants of the compiled pass."""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np

from s3d_jax.config import ModelConfig, RopeScaling


def layer_is_sliding(config: ModelConfig, layer):
    """Whether `layer` (traced) has a sliding window: a constant where all layers agree."""
    kinds = np.asarray([config.is_sliding(i) for i in range(config.num_layers)])
    return bool(kinds[0]) if kinds.all() or not kinds.any() else jnp.asarray(kinds)[layer]


def window_mask(config: ModelConfig, layer, q_pos, k_pos):
    """Keys within `layer`'s sliding window of each query (everything in a layer without one)."""
    sliding = layer_is_sliding(config, layer)
    if config.sliding_window is None or sliding is False:
        return jnp.ones(jnp.broadcast_shapes(q_pos.shape, k_pos.shape), bool)
    within = q_pos - k_pos < config.sliding_window
    return within if sliding is True else within | ~sliding


def layer_frequencies(config: ModelConfig, layer):
    """`layer`'s RoPE inverse frequencies (Gemma-3's sliding-window layers have their own base)."""
    sliding = layer_is_sliding(config, layer)
    if isinstance(sliding, bool):
        return rope_frequencies(config.head_dim, *config.layer_rope(0))
    local, full = (rope_frequencies(config.head_dim, *config.layer_rope(i)) for i in (
        config.layer_types.index("sliding_attention"), config.layer_types.index("full_attention")))
    return jnp.where(sliding, local, full)


def rope_frequencies(head_dim: int, theta: float, scaling: RopeScaling | None = None):
    """RoPE's inverse frequencies `[head_dim / 2]` in float32, scaled as transformers scales them."""
    half = head_dim // 2
    inv_freq = 1.0 / theta ** (jnp.arange(half, dtype=jnp.float32) / half)
    if scaling is None:
        return inv_freq
    if scaling.rope_type == "linear":
        return inv_freq / scaling.factor
    # llama3: long wavelengths slow down by `factor`, short ones stay, and those between interpolate.
    wavelen = 2 * math.pi / inv_freq
    context = scaling.original_max_position_embeddings
    low_wavelen, high_wavelen = context / scaling.low_freq_factor, context / scaling.high_freq_factor
    scaled = jnp.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (context / wavelen - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    return jnp.where((wavelen >= high_wavelen) & (wavelen <= low_wavelen), smoothed, scaled)


def rope(x_BTNE, positions_BT, inv_freq):
    """Rotary embedding in the rotate-half layout, with angles in float32."""
    angles_BTE = positions_BT.astype(jnp.float32)[..., None] * inv_freq
    cos, sin = jnp.cos(angles_BTE)[:, :, None, :], jnp.sin(angles_BTE)[:, :, None, :]
    x1, x2 = jnp.split(x_BTNE.astype(jnp.float32), 2, axis=-1)
    rotated = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return rotated.astype(x_BTNE.dtype)
