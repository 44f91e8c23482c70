"""Speculative-decoding metrics (docs/design.md, "Metrics"). Plain numpy: no JAX, so that the
benchmark's transformers peers can import it without loading JAX.

A decode records an *accept histogram*: `hist[k]` = iterations that accepted `k` of γ drafts.
"""

from __future__ import annotations

import numpy as np


def tokens_per_iteration(histogram) -> float:
    """E from an accept histogram over k = 0..γ: each iteration emits k + 1 tokens."""
    hist = np.asarray(histogram)
    return float(np.dot(hist, np.arange(1, len(hist) + 1)) / max(hist.sum(), 1))


def acceptance_per_depth(histogram) -> list[float]:
    """α_j from an accept histogram: the chance that draft j is accepted given drafts 1..j-1 were."""
    hist = np.asarray(histogram)
    reached = np.cumsum(hist[::-1])[::-1]  # reached[j] = iterations with k >= j
    return [float(reached[j + 1] / reached[j]) if reached[j] else float("nan") for j in range(len(hist) - 1)]


def expected_tokens(acceptance_per_depth) -> float:
    """E = 1 + Σ_i Π_{j<=i} α_j, from conditional acceptance per depth."""
    return float(1.0 + np.sum(np.cumprod(np.asarray(acceptance_per_depth, dtype=float))))


def memory_normalised_speedup(speed, base_speed, memory, base_memory) -> float:
    """M-SR = (v / v_base) / (mem / mem_base)."""
    return (speed / base_speed) / (memory / base_memory)
