"""The public Python API: `load`, `logits`, `decode`."""

from __future__ import annotations

import functools
import os

import jax
import jax.numpy as jnp
import numpy as np

from s3d_jax import checkpoint
from s3d_jax.cache import KVCache, cached_forward
from s3d_jax.checkpoint import Model
from s3d_jax.config import ModelConfig
from s3d_jax.model import lm_logits


def load(path: str | os.PathLike | None = None, dtype: str | None = None) -> Model:
    """Loads a converted model; with no path, the bundled SmolLM2-135M-Instruct (converted on first use)."""
    return checkpoint.load_default(dtype) if path is None else checkpoint.load(path, dtype)


def check_token_ids(token_ids: np.ndarray, config: ModelConfig) -> None:
    if token_ids.size == 0:
        raise ValueError("empty prompt: give at least one token")
    bad = token_ids[(token_ids < 0) | (token_ids >= config.vocab_size)]
    if bad.size:
        raise ValueError(f"token id {int(bad[0])} is outside the vocabulary [0, {config.vocab_size})")


@functools.partial(jax.jit, static_argnames="config")
def _full_logits(params, config: ModelConfig, token_ids_BT):
    cache = KVCache.zeros(config, token_ids_BT.shape[0], 0)
    hidden, _ = cached_forward(params, config, cache, token_ids_BT, config.all_layers, write=False)
    return lm_logits(params, config, hidden)


def logits(model: Model, token_ids) -> jax.Array:
    """Full-model float32 logits `[batch, time, vocab]` for a rectangular batch of token ids."""
    token_ids = np.asarray(token_ids, dtype=np.int64)
    if token_ids.ndim == 1:
        token_ids = token_ids[None]
    if token_ids.ndim != 2:
        raise ValueError(f"token_ids must be [time] or [batch, time], got shape {token_ids.shape}")
    check_token_ids(token_ids, model.config)
    return _full_logits(model.params, model.config, jnp.asarray(token_ids, jnp.int32))
