"""The cost of one pass, timed inside one jitted loop. Imports JAX: only JAX processes import it."""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp

from s3d_jax.cache import KVCache
from s3d_jax.speculative import Plan, draft_s3d, verify


def pass_ms(model, pass_fn, context: int = 256, repeats: int = 20) -> float:
    """Milliseconds of one `pass_fn(params, cache, x_n)` over a cache filled to `context` positions,
    timed inside one jitted loop (no dispatch overhead). The input token changes every iteration,
    so XLA cannot hoist the pass out of the loop."""
    cache = KVCache.zeros(model.config, 1, max(512, context + 16)).replace(lengths=jnp.asarray([context], jnp.int32))

    def loop(params, cache):
        def body(i, total):
            return total + pass_fn(params, cache, jnp.full((1,), i % 1000, jnp.int32)).sum()

        return jax.lax.fori_loop(0, repeats, body, jnp.zeros((), jnp.float32))

    fn = jax.jit(loop)
    jax.block_until_ready(fn(model.params, cache))  # compile and warm up
    start = time.perf_counter()
    jax.block_until_ready(fn(model.params, cache))
    return (time.perf_counter() - start) / repeats * 1e3


def verify_ms(model, tokens: int, **timing) -> float:
    """A full-model pass over `tokens` tokens (1 is a plain decoding step)."""
    drafts = jnp.zeros((1, tokens - 1), jnp.int32)
    return pass_ms(model, lambda p, c, x_n: verify(p, model.config, c, x_n, drafts)[0], **timing)


def draft_ms(model, skip, gamma: int, **timing) -> float:
    """One S3D draft pass of `gamma` tokens through the layers outside `skip`."""
    plan = Plan.make(model.config, "s3d", gamma, skip)
    return pass_ms(model, lambda p, c, x_n: draft_s3d(p, model.config, plan, c, x_n, jax.random.key(0))[1], **timing)
