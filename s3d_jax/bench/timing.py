"""A pass's memory floor: the bytes it must read divided by the machine's streaming bandwidth,
measured by a probe; the pass timings
themselves are `s3d_jax.calibration`'s.
Imports JAX: only JAX processes import it."""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np

from s3d_jax.config import COMPUTE_DTYPE


def bandwidth_gb_s(nbytes: int, repeats: int = 10) -> float:
    """Streaming read bandwidth in GB/s: the best of `repeats` matrix-vector products over a float32
    buffer of `nbytes` (size it like the weights, so no cache holds it). A matrix-vector product reads
    each byte once on every core, as a decoding step does; a plain sum would run on one core."""
    rows = max(nbytes // (4 * 1024), 1)
    buffer, vector = jnp.ones((rows, 1024), jnp.float32), jnp.ones((1024,), jnp.float32)
    product = jax.jit(jnp.dot)
    jax.block_until_ready(product(buffer, vector))
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(product(buffer, vector))
        best = min(best, time.perf_counter() - start)
    return buffer.nbytes / best / 1e9


def pass_bytes(params, config, layers, context: int, draft: bool = False) -> int:
    """What a cached pass through `layers` must read at least: those layers' weights (with the LoRA
    adapters in a draft pass), the head (the reduced draft head in a draft pass that has one, else the
    tied embedding or the LM head) and the final norm, and the cached keys and values of `layers`
    over `context` positions."""
    if draft and config.draft_vocab_size:
        head = params["draft_head"]
    else:
        head = params["embed"] if config.tie_embeddings else params["lm_head"]
    stacks = [x for path, x in jax.tree_util.tree_leaves_with_path(params["layers"]) if draft or "_lora" not in jax.tree_util.keystr(path)]
    weights = sum(x.nbytes // x.shape[0] for x in stacks) * len(layers)  # one entry of each stack per layer run
    weights += head.nbytes + sum(x.nbytes for x in jax.tree.leaves(params["final_norm"]))
    cache = 2 * len(layers) * config.num_kv_heads * config.head_dim * context * np.dtype(COMPUTE_DTYPE).itemsize
    return int(weights + cache)
