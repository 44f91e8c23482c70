"""Turning logits into tokens: greedy, temperature, top-k and top-p, applied the same way to the
draft's and the verifier's distributions."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from s3d_jax.ops import NEG_INF


@dataclasses.dataclass(frozen=True)
class Sampling:
    """Static sampling settings; `temperature == 0` is greedy decoding. Checked by DecodeOptions."""

    temperature: float = 0.0
    top_k: int = 0  # 0 keeps every token
    top_p: float = 1.0

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def top_k(x, k: int):
    """`jax.lax.top_k` over the last axis, on a 2-D view: XLA's CPU backend has a top-k kernel for rank 2
    only and sorts whole rows at any other rank (50 ms instead of 0.5 for γ rows of a 49k vocabulary)."""
    values, indices = jax.lax.top_k(x.reshape(-1, x.shape[-1]), k)
    return values.reshape(*x.shape[:-1], k), indices.reshape(*x.shape[:-1], k)


def log_probs(logits, sampling: Sampling):
    """Log-probabilities after temperature, top-k and top-p (removed tokens get -inf)."""
    # Shifted so that the largest logit is 0 and the rest negative: a tiny temperature then sends
    # them to -inf instead of overflowing every logit to inf (NaNs, garbage tokens).
    logits = logits.astype(jnp.float32)
    shifted = logits - jnp.max(logits, axis=-1, keepdims=True)
    logits = jnp.where(shifted == 0, 0.0, shifted / sampling.temperature)
    if sampling.top_k:
        kth = top_k(logits, sampling.top_k)[0][..., -1:]
        logits = jnp.where(logits < kth, NEG_INF, logits)
    if sampling.top_p < 1.0:
        logits = nucleus(logits, sampling.top_p)
    return jax.nn.log_softmax(logits, axis=-1)


NUCLEUS_CANDIDATES = 1024  # the largest logits in which `nucleus` looks for the cutoff first


def nucleus(logits, top_p: float):
    """`logits` with the tokens outside the top-p nucleus at -inf: the smallest set of largest logits
    whose mass reaches `top_p` (a token stays if the mass of the larger ones is below `top_p`; tied
    tokens stay or go together). The cutoff is looked for among the `NUCLEUS_CANDIDATES` largest
    first, and over the whole sorted row only where some row's nucleus is larger: on a CPU, sorting
    a 49k vocabulary took 13 ms a row, half a float32 step of the bundled model, and its 1,024
    largest 0.5 ms (docs/cpu.md, "The loop's own operations")."""
    vocab = logits.shape[-1]

    def cutoff_among(values):  # values: the largest logits, descending
        probs = jnp.exp(values - jax.nn.logsumexp(logits, axis=-1, keepdims=True))
        mass_before = jnp.cumsum(probs, axis=-1) - probs
        within = mass_before[..., -1] >= top_p  # the nucleus ends before the last value
        return jnp.min(jnp.where(mass_before < top_p, values, jnp.inf), axis=-1, keepdims=True), within

    def whole_row():
        return cutoff_among(-jnp.sort(-logits, axis=-1))[0]

    if vocab <= NUCLEUS_CANDIDATES:
        cutoff = whole_row()
    else:
        cutoff, within = cutoff_among(top_k(logits, NUCLEUS_CANDIDATES)[0])
        cutoff = jax.lax.cond(jnp.all(within), lambda: cutoff, whole_row)
    return jnp.where(logits < cutoff, NEG_INF, logits)


def argmax(logits):
    """`jnp.argmax` over the last axis (the first of equal maxima), as two plain reductions: XLA's CPU
    runs argmax's paired value-and-index reduction one element at a time, 0.8 ms for the 5 rows of a
    verify over a 49k vocabulary against 0.3 ms for these (docs/cpu.md, "The loop's own operations").
    A row with a NaN picks its last id."""
    top = jnp.max(logits, axis=-1, keepdims=True)
    last = logits.shape[-1] - 1
    return jnp.min(jnp.where(logits == top, jnp.arange(logits.shape[-1], dtype=jnp.int32), last), axis=-1)


def choose(rng, logits, sampling: Sampling):
    """One token per distribution: argmax when greedy, else a sample."""
    if sampling.greedy:
        return argmax(logits)
    return jax.random.categorical(rng, log_probs(logits, sampling), axis=-1).astype(jnp.int32)
