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


def least(values):
    """The last of `top_k`'s values, read as their minimum: XLA's CPU backend keeps its top-k kernel
    only for values sliced from index 0, and sorts the whole row to give `values[..., -1:]` (13 ms a
    row of a 49k vocabulary instead of 0.2)."""
    return jnp.min(values, axis=-1, keepdims=True)


def kth_largest(x, k: int):
    """The `k`-th largest of each row of `x`, keeping its axis."""
    return least(top_k(x, k)[0])


def scaled(logits, sampling: Sampling):
    """Float32 logits after temperature and top-k (removed tokens at -inf), before top-p."""
    # Shifted so that the largest logit is 0 and the rest negative: a tiny temperature then sends
    # them to -inf instead of overflowing every logit to inf (NaNs, garbage tokens).
    logits = logits.astype(jnp.float32)
    shifted = logits - jnp.max(logits, axis=-1, keepdims=True)
    logits = jnp.where(shifted == 0, 0.0, shifted / sampling.temperature)
    if sampling.top_k:
        logits = jnp.where(logits < kth_largest(logits, sampling.top_k), NEG_INF, logits)
    return logits


def log_probs(logits, sampling: Sampling):
    """Log-probabilities after temperature, top-k and top-p (removed tokens get -inf)."""
    logits = scaled(logits, sampling)
    if sampling.top_p < 1.0:
        logits = nucleus(logits, sampling.top_p)
    return jax.nn.log_softmax(logits, axis=-1)


NUCLEUS_CANDIDATES = 1024  # the largest logits in which `nucleus` looks for the cutoff first


def cutoff_among(values, logits, top_p: float):
    """The top-p cutoff of rows `logits` from their largest `values` (descending): the least value
    whose larger ones hold less than `top_p` of the row's mass. Correct where the nucleus ends
    among `values`."""
    probs = jnp.exp(values - jax.nn.logsumexp(logits, axis=-1, keepdims=True))
    mass_before = jnp.cumsum(probs, axis=-1) - probs
    return jnp.min(jnp.where(mass_before < top_p, values, jnp.inf), axis=-1, keepdims=True)


def order_key(x):
    """float32 as uint32 in the same order (the sign bit set for the non-negative, every bit flipped for the negative)."""
    bits = jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.uint32)
    return jnp.where(bits >> 31 == 1, ~bits, bits | jnp.uint32(1 << 31))


def whole_row_cutoff(logits, top_p: float):
    """The top-p cutoff of rows `logits` over the whole row, without sorting it: a bisection over the
    logits' 32-bit order keys for the least key whose larger logits hold less than `top_p` of the mass,
    32 masked sums of the row. Sorting a 49k vocabulary took 10-13 ms a row on a CPU; this 0.6."""
    probs = jax.nn.softmax(logits, axis=-1)
    keys = order_key(logits)
    # Invariant: the logits above key `lo` hold at least top_p (all of them do), those above `hi` less (none).
    lo, hi = jnp.min(keys, axis=-1, keepdims=True) - 1, jnp.max(keys, axis=-1, keepdims=True)

    def halve(_, bounds):
        lo, hi = bounds
        mid = lo + (hi - lo) // 2
        less = jnp.sum(jnp.where(keys > mid, probs, 0.0), axis=-1, keepdims=True) < top_p
        return jnp.where(less, lo, mid), jnp.where(less, mid, hi)

    _, hi = jax.lax.fori_loop(0, 32, halve, (lo, hi))
    return jnp.min(jnp.where(keys >= hi, logits, jnp.inf), axis=-1, keepdims=True)


def candidates(logits, top_p: float):
    """`(values, ids, cutoff, within)`: the `NUCLEUS_CANDIDATES` largest logits of each row and their
    ids, the top-p cutoff among them, and per row whether its nucleus ends strictly within them (no
    token outside reaches the cutoff, which is then the row's own)."""
    values, ids = top_k(logits, NUCLEUS_CANDIDATES)
    cutoff = cutoff_among(values, logits, top_p)
    return values, ids, cutoff, (cutoff > least(values))[..., 0]


def nucleus(logits, top_p: float):
    """`logits` with the tokens outside the top-p nucleus at -inf: the smallest set of largest logits
    whose mass reaches `top_p` (a token stays if the mass of the larger ones is below `top_p`; tied
    tokens stay or go together). The cutoff is looked for among the `NUCLEUS_CANDIDATES` largest
    first (`lax.top_k`: 0.2-0.5 ms a row of a 49k vocabulary on a CPU), and over the whole row only
    where some row's nucleus is larger (docs/cpu.md, "The loop's own operations")."""
    if logits.shape[-1] <= NUCLEUS_CANDIDATES:
        cutoff = whole_row_cutoff(logits, top_p)
    else:
        _, _, cutoff, within = candidates(logits, top_p)
        cutoff = jax.lax.cond(jnp.all(within), lambda: cutoff, lambda: whole_row_cutoff(logits, top_p))
    return jnp.where(logits < cutoff, NEG_INF, logits)


def draw_from_nucleus(rng, logits, top_p: float):
    """One token per row of `logits` (after `scaled`) from its top-p nucleus, as a draw over
    `nucleus(logits, top_p)` gives it: among the `NUCLEUS_CANDIDATES` largest for a row whose nucleus
    ends strictly within them, over the whole row for the others (computed only where some row
    needs it). A draw's random numbers over a 49k vocabulary cost 1-2.7 ms a row on a CPU, and a
    tree's verify draws at each of its nodes."""
    values, ids, cutoff, within = candidates(logits, top_p)
    pick = jax.random.categorical(rng, jnp.where(values < cutoff, NEG_INF, values), axis=-1)
    among_candidates = jnp.take_along_axis(ids, pick[..., None], axis=-1)[..., 0]

    def over_the_row():
        whole = jax.random.categorical(rng, jnp.where(logits < whole_row_cutoff(logits, top_p), NEG_INF, logits), axis=-1)
        return jnp.where(within, among_candidates, whole)

    return jax.lax.cond(jnp.all(within), lambda: among_candidates, over_the_row)


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
    if sampling.top_p < 1.0 and logits.shape[-1] > NUCLEUS_CANDIDATES:
        return draw_from_nucleus(rng, scaled(logits, sampling), sampling.top_p).astype(jnp.int32)
    return jax.random.categorical(rng, log_probs(logits, sampling), axis=-1).astype(jnp.int32)
