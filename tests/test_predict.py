"""The speedup predictor recovers known parameters from synthetic acceptance data."""

import numpy as np
import pytest
from reference import tiny_config

from s3d_jax.predict import draft_ratio, fit_depth_discount, fit_first_acceptance, interpolated, predict_speedup, symmetric_skips


def test_fit_recovers_first_acceptance_curve():
    c, kappa = 0.7, 1.8
    r = np.array([0.3, 0.45, 0.6, 0.75, 0.9, 1.0])
    alpha1 = 1 - c * (1 - r) ** kappa
    fitted_c, fitted_kappa = fit_first_acceptance(r, alpha1)
    assert fitted_c == pytest.approx(c, abs=0.01) and fitted_kappa == pytest.approx(kappa, abs=0.02)
    noisy = alpha1 + np.random.default_rng(0).normal(0, 0.005, len(r))
    fitted_c, fitted_kappa = fit_first_acceptance(r, np.clip(noisy, 0, 1))
    assert fitted_c == pytest.approx(c, abs=0.05) and fitted_kappa == pytest.approx(kappa, abs=0.3)


def test_fit_recovers_depth_discount():
    delta = np.array([1.0, 0.8, 0.65, 0.5])
    acceptances = [list(a1 * delta) for a1 in (0.4, 0.6, 0.8)]
    np.testing.assert_allclose(fit_depth_discount(acceptances, 6), [1.0, 0.8, 0.65, 0.5, 0.5, 0.5], atol=1e-9)


def test_speedup_formula():
    constant = interpolated({1: 1.0, 5: 1.0})
    # All drafts accepted (c = 0): E = γ + 1, so the speedup is (γ + 1) / (1 + r + ε).
    assert predict_speedup(0.5, 3, 0.0, 1.0, [1.0], constant, epsilon=0.1) == pytest.approx(4 / 1.6)
    # Nothing accepted: one token per iteration that costs a draft and a verify.
    assert predict_speedup(0.5, 3, 1.0, 0.0, [1.0], constant) == pytest.approx(1 / 1.5)
    # Measured costs replace the constant: a verify of 4 tokens costing 2 plain steps halves the gain.
    measured = interpolated({1: 1.0, 4: 2.0})
    assert predict_speedup(0.5, 3, 0.0, 1.0, [1.0], measured) == pytest.approx(4 / (0.5 * measured(3) + 2.0))


def test_draft_ratio_and_grid():
    config = tiny_config(num_layers=8)
    assert draft_ratio(config, (0, 0)) < 1.0
    assert draft_ratio(config, (2, 5)) < draft_ratio(config, (3, 4))
    skips = symmetric_skips(8)
    assert skips == [(3, 4), (2, 5), (1, 6)]
