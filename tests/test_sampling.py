"""Sampling's building blocks on their own: the top-p nucleus, the draw from it, and what they compile
to. That a sampled decode keeps the model's distribution is tested in tests/test_decoding.py."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from s3d_jax import sampling
from s3d_jax.sampling import Sampling


@pytest.mark.parametrize("scale", [8.0, 0.05])  # a small nucleus among the candidates, and a nucleus wider than them
def test_the_nucleus_is_the_smallest_set_of_largest_tokens_whose_mass_reaches_top_p(monkeypatch, scale):
    """`nucleus` finds its cutoff among the largest logits, or over the whole row where some row's
    nucleus is wider: either way, a token stays exactly when the mass of the larger ones is below top_p."""
    monkeypatch.setattr(sampling, "NUCLEUS_CANDIDATES", 16)
    logits = np.random.default_rng(0).standard_normal((3, 500)).astype(np.float32) * scale
    logits[0, :4] = logits[0].max() + 1.0  # tied largest tokens stay or go together
    kept = np.asarray(jax.jit(lambda x: sampling.nucleus(x, 0.9))(jnp.asarray(logits))) > sampling.NEG_INF
    probs = np.exp(logits - logits.max(-1, keepdims=True), dtype=np.float64)
    probs /= probs.sum(-1, keepdims=True)
    larger_mass = np.array([[row_probs[row > v].sum() for v in row] for row_probs, row in zip(probs, logits)])
    np.testing.assert_array_equal(kept, larger_mass < 0.9)
    assert (kept.sum(-1) < 16).all() if scale > 1 else (kept.sum(-1) > 16).all()


def test_a_draw_from_the_nucleus_follows_the_top_p_distribution(monkeypatch):
    """`draw_from_nucleus` draws each row from exactly its top-p distribution (chi-squared over 20,000
    draws): among the candidates where the nucleus ends within them, over the row where it does not,
    rows of both kinds in one batch, and never a token outside the nucleus."""
    from scipy.stats import chisquare

    monkeypatch.setattr(sampling, "NUCLEUS_CANDIDATES", 8)
    rng = np.random.default_rng(1)
    logits = np.stack([rng.standard_normal(40) * 4.0, rng.standard_normal(40) * 0.1, rng.standard_normal(40) * 4.0]).astype(np.float32)
    logits[2, :3] = logits[2].max() + 0.5  # tied largest tokens
    draw = jax.jit(jax.vmap(lambda key, x: sampling.draw_from_nucleus(key, x, 0.8), in_axes=(0, None)))
    probs = np.exp(np.asarray(sampling.log_probs(jnp.asarray(logits), Sampling(1.0, 0, 0.8)), np.float64))
    assert (probs[[0, 2]] > 0).sum(-1).max() < 8 < (probs[1] > 0).sum()  # rows 0 and 2 within the candidates, row 1 wider
    for rows in ([0, 1, 2], [0, 2]):  # the last: every row among the candidates, the row never sorted
        tokens = np.asarray(draw(jax.random.split(jax.random.key(5), 20000), jnp.asarray(logits[rows])))
        for column, row in enumerate(rows):
            counts = np.bincount(tokens[:, column], minlength=40)
            assert counts[probs[row] == 0].sum() == 0, f"row {row} drew a token outside its nucleus"
            kept = probs[row] > 0
            expected = probs[row][kept] / probs[row][kept].sum() * len(tokens)
            assert chisquare(counts[kept], expected).pvalue > 1e-3, row


# ------------------------------------------------------------------ compilation


@pytest.mark.parametrize("top_k, top_p", [(0, 0.9), (40, 1.0), (40, 0.9)])
def test_a_sampled_token_costs_no_sort_of_the_vocabulary(top_k, top_p):
    """Top-k and top-p read the largest logits through `lax.top_k`, outside any fallback branch, and
    never as a sort of the row: XLA's CPU backend turns a top-k whose last value is sliced out
    (`values[..., -1:]`) into a sort of the whole row, 13 ms for a 49k vocabulary."""
    settings = Sampling(0.7, top_k, top_p)
    compiled = jax.jit(lambda key, x: sampling.choose(key, x, settings)).lower(jax.random.key(0), jnp.zeros((2, 4096))).compile()
    text = compiled.as_text()
    entry = text[text.index("\nENTRY") :]
    assert "sort(" not in entry[: entry.index("\n}")], "the compiled draw sorts the vocabulary outside its fallback branch"


@pytest.mark.parametrize("top_p", [0.05, 0.5, 0.9, 0.999])
def test_the_whole_row_cutoff_is_found_without_sorting(top_p):
    """`whole_row_cutoff` bisects over the logits' order keys: the least logit whose larger ones hold
    less than `top_p` of the mass, on rows of either sign, with ties and with tokens already removed."""
    rng = np.random.default_rng(3)
    logits = (rng.standard_normal((4, 3000)) * np.array([[0.05], [1.0], [4.0], [20.0]])).astype(np.float32)
    logits[1, :40] = logits[1].max()  # a tie at the top
    logits[2, ::3] = sampling.NEG_INF  # a top-k's removed tokens
    logits[3] -= 50.0  # every logit negative
    cutoff = np.asarray(jax.jit(lambda x: sampling.whole_row_cutoff(x, top_p))(jnp.asarray(logits)))[:, 0]
    probs = np.exp(logits - logits.max(-1, keepdims=True), dtype=np.float64)
    probs /= probs.sum(-1, keepdims=True)
    for row, (row_logits, row_probs) in enumerate(zip(logits, probs)):
        kept = [v for v in np.unique(row_logits) if row_probs[row_logits > v].sum() < top_p]
        assert cutoff[row] == min(kept), row
