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


def test_cli_sweep_on_tiny_drafters(tmp_path):
    """The whole command: measure two drafters, fit, predict the grid, measure it, write json and plot."""
    import json
    import subprocess
    import sys

    from reference import tiny_model

    from s3d_jax import bundled, checkpoint

    tokenizer = bundled.tokenizer()
    model = tiny_model(seed=0, vocab_size=49153, mask_token_id=49152, num_layers=6, hidden_size=32, intermediate_size=64, head_dim=8)
    drafters = []
    for skip in [(2, 3), (1, 4)]:
        drafters.append(str(tmp_path / f"skip_{skip[0]}_{skip[1]}"))
        checkpoint.save(drafters[-1], model.params, model.config.replace(eos_token_ids=(2,), draft_skip=skip, draft_gamma=2), tokenizer)
    out = tmp_path / "predict"
    result = subprocess.run(
        [sys.executable, "-m", "s3d_jax.predict", "--drafters", *drafters, "--questions", "1", "--max-gamma", "2",
         "--max-new-tokens", "8", "--sweep", "--out", str(out)],
        capture_output=True, text=True, timeout=900,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads((out / "predict.json").read_text())
    assert (out / "predict.png").stat().st_size > 0
    assert sorted(tuple(p["skip"]) for p in report["points"]) == [(1, 4), (2, 3)]
    assert {(tuple(m["skip"]), m["gamma"]) for m in report["measured"]} == {(s, g) for s in [(1, 4), (2, 3)] for g in (1, 2)}
    assert all(m["measured_speedup"] > 0 and m["tokens_per_iteration"] >= 1 for m in report["measured"])
    assert report["best_predicted"]["predicted_speedup"] == max(
        report["best_predicted"]["predicted_speedup"], *(m["predicted_speedup"] for m in report["measured"]))
    assert "best predicted: skip" in result.stdout and "best measured:  skip" in result.stdout
