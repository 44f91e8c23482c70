"""The speedup predictor recovers known parameters from synthetic acceptance data."""

import numpy as np
import pytest
from reference import tiny_config

from s3d_jax.speedup import draft_ratio, fit_depth_discount, fit_first_acceptance, interpolated, predict_speedup, symmetric_skips


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


def tiny_drafter_dir(path, skip, **draft):
    """A tiny random model with the bundled tokenizer's vocabulary, saved as a trained drafter of `skip`."""
    from reference import tiny_model

    from s3d_jax import bundled, checkpoint

    model = tiny_model(seed=0, vocab_size=49153, mask_token_id=49152, num_layers=6, hidden_size=32, intermediate_size=64, head_dim=8)
    checkpoint.save(str(path), model.params, model.config.replace(eos_token_ids=(2,), draft_skip=skip, **draft), bundled.tokenizer())
    return str(path)


def run_predict(*args):
    import subprocess
    import sys

    result = subprocess.run([sys.executable, "-m", "s3d_jax.predict", *args], capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    return result


@pytest.mark.needs("bundled_model", "mt_bench")
def test_cli_sweep_on_tiny_drafters(tmp_path):
    """The whole command: measure two drafters, fit, predict the grid, measure it, write json and plot."""
    import json

    drafters = [tiny_drafter_dir(tmp_path / f"skip_{skip[0]}_{skip[1]}", skip, draft_gamma=2) for skip in [(2, 3), (1, 4)]]
    out = tmp_path / "predict"
    result = run_predict("--drafters", *drafters, "--questions", "1", "--max-gamma", "2", "--max-new-tokens", "8", "--sweep",
                         "--trees", "2", "4", "--out", str(out))
    report = json.loads((out / "predict.json").read_text())
    assert (out / "predict.png").stat().st_size > 0
    assert sorted(tuple(p["skip"]) for p in report["points"]) == [(1, 4), (2, 3)]
    assert {(tuple(m["skip"]), m["gamma"]) for m in report["measured"]} == {(s, g) for s in [(1, 4), (2, 3)] for g in (1, 2)}
    assert all(m["measured_speedup"] > 0 and m["tokens_per_iteration"] >= 1 for m in report["measured"])
    assert report["best_predicted"]["predicted_speedup"] == max(
        report["best_predicted"]["predicted_speedup"], *(m["predicted_speedup"] for m in report["measured"]))
    assert "best predicted: skip" in result.stdout and "best measured:  skip" in result.stdout
    # Trees, for each drafter at its own gamma: the chain and each size, predicted and measured, and a recommendation.
    assert len(report["trees"]) == 2
    for trees in report["trees"]:
        assert [row["tree"] for row in trees["rows"]] == [0, 2, 4] and trees["recommended_tree"] in (0, 2, 4)
        assert all(row["predicted_e"] >= 1 and row["measured_e"] >= 1 and row["verify_ms"] > 0 for row in trees["rows"])
        assert (out / f"predict_trees_skip{trees['skip'][0]}-{trees['skip'][1]}.png").stat().st_size > 0
    assert "recommended tree:" in result.stdout


@pytest.mark.needs("bundled_model", "mt_bench")
def test_cli_gates_on_a_tiny_drafter(tmp_path):
    """`--gates`: each gate and the oracle replayed along the drafter's own replies, with the gate fixed
    and learning, the kinds of iteration adding up, and the table printed."""
    import json

    drafter = tiny_drafter_dir(tmp_path / "drafter", (2, 3), draft_gamma=2, draft_tree=4)
    out = tmp_path / "predict"
    result = run_predict("--drafters", drafter, "--questions", "1", "--max-gamma", "2", "--max-new-tokens", "16",
                         "--gates", "0", "0.5", "1", "--out", str(out))
    (gates,) = json.loads((out / "predict.json").read_text())["gates"]
    assert (gates["skip"], gates["gamma"], gates["tree"]) == ([2, 3], 2, 4)
    assert gates["costs"]["plain"] == 1.0 and gates["costs"]["drafted"] > 0 and gates["positions"] > 0
    assert [row["min_certainty"] for row in gates["rows"]] == [0.0, 0.5, 1.0, None]
    for row in gates["rows"]:
        assert sum(row[f"{kind}_share"] for kind in ("drafted", "branch", "plain")) == pytest.approx(1.0)
        assert row["predicted_speedup"] > 0
        assert (row.get("learning_speedup", 0) > 0) == (row["min_certainty"] is not None)
    # A fixed gate of 0 drafts every iteration outside the context branch; one of 1 none (no top probability is 1 here).
    assert gates["rows"][0]["plain_share"] == 0 and gates["rows"][2]["drafted_share"] == 0
    assert "| min_certainty | predicted speedup |" in result.stdout and "| oracle |" in result.stdout


# ---------------------------------------------------------------- trees


def test_static_tree_e_counts_the_most_frequent_rank_paths():
    from s3d_jax.speedup import static_tree_e, tree_analysis

    ranks = np.array([[0, 0]] * 4 + [[1, 0]] * 2 + [[0, 1], [9, 0]])  # 8 positions; rank 9 is out of every tree's reach
    # Prefix counts: (0,) 5, (0, 0) 4, (1,) 2, (1, 0) 2, (0, 1) 1.
    assert [static_tree_e(ranks, ranks, n) for n in (1, 2, 3, 4, 5, 9)] == [1 + 5 / 8, 1 + 9 / 8, 1 + 11 / 8, 1 + 13 / 8, 1 + 14 / 8,
                                                                             1 + 14 / 8]
    analysis = tree_analysis([ranks[:4], ranks[4:]], [2, 4])
    assert analysis["positions"] == 8 and analysis["chain_e"] == 1 + 9 / 8
    assert analysis["top_k_acceptance_per_depth"][1] == [5 / 8, 4 / 5] and analysis["top_k_acceptance_per_depth"][2][0] == 7 / 8
    # Two folds: paths chosen on one half, counted on the other. The second half alone picks (1,) first.
    assert analysis["tree_e"][2] == np.mean([static_tree_e(ranks[:4], ranks[4:], 2), static_tree_e(ranks[4:], ranks[:4], 2)])


@pytest.mark.parametrize("draft_vocab", [0, 12])
def test_draft_ranks_equal_a_draft_pass_from_each_prefix(draft_vocab):
    """With a reduced draft head the pass also scores the context so far, as decoding does, and
    never the reply's later tokens (which would leak the answer into the ranks)."""
    import jax.numpy as jnp
    from reference import draft_logits_after, tiny_model

    from s3d_jax.drafter import with_draft_vocab
    from s3d_jax.predict.replies import draft_ranks
    from s3d_jax.speculative import Plan

    model = tiny_model(seed=3)
    params, config = model.params, model.config.replace(draft_skip=(2, 3))
    if draft_vocab:
        params, config = with_draft_vocab(params, config, np.arange(config.vocab_size - 1, dtype=np.int32), draft_vocab)
    model = model.__class__(params, config)
    prompt, reply, gamma = [5, 6, 7], [int(t) for t in np.random.default_rng(0).integers(0, 90, 12)], 3
    got = draft_ranks(model, [(prompt, reply)], gamma)[0]
    ids = prompt + reply
    plan = Plan.make(model.config, "s3d", gamma=gamma, skip=(2, 3))
    want = []
    for n in range(len(prompt), len(ids) - gamma):
        seen = jnp.asarray([ids[: n + 1] + [0] * (len(ids) - n - 1)])  # the tokens so far; later slots hold padding
        logits = np.asarray(draft_logits_after(model.params, model.config, plan, jnp.asarray([ids]), jnp.int32(n), seen))
        own = logits[np.arange(gamma), ids[n + 1: n + 1 + gamma]]
        want.append(np.sum(logits > own[:, None], axis=1))
    np.testing.assert_array_equal(got, np.array(want))


# ---------------------------------------------------------------- drafting gates


def test_replay_counts_each_kind_of_iteration_and_its_cost():
    from s3d_jax.speedup import replay

    reply = {"certainty": np.array([0.95, 0.2, 0.5, 0.99, 0.1, 0.3]), "drafted": np.array([3, 0, 1, 0, 0, 2]),
             "branch": np.array([False, False, False, False, True, False]), "branch_k": np.array([0, 0, 0, 0, 1, 0])}
    costs = {"plain": 1.0, "drafted": 2.5, "branch": 2.0}
    # 0.9: n=0 drafts (4 tokens), n=4 is the branch alone (2 tokens, the reply ends there).
    assert replay([reply], 0.9, costs) == {"tokens": 6, "cost": 4.5, "kinds": {"drafted": 1, "branch": 1, "plain": 0},
                                           "emitted": {"drafted": 4, "branch": 2, "plain": 0}}
    # 1.0: plain steps 0..3, then the branch.
    assert replay([reply], 1.0, costs) == {"tokens": 6, "cost": 6.0, "kinds": {"drafted": 0, "branch": 1, "plain": 4},
                                           "emitted": {"drafted": 0, "branch": 2, "plain": 4}}
    # 0.0: n=0 drafts 4, n=4 branch 2.
    assert replay([reply], 0.0, costs)["kinds"] == {"drafted": 1, "branch": 1, "plain": 0}
    # The oracle drafts only where the tree emits more than it costs (4 > 2.5 at n=0).
    assert replay([reply], None, costs)["kinds"] == {"drafted": 1, "branch": 1, "plain": 0}
    assert replay([{**reply, "drafted": np.array([1, 0, 1, 0, 0, 2])}], None, costs)["kinds"] == {"drafted": 0, "branch": 1, "plain": 4}


def test_the_gate_replay_visits_what_decoding_does(monkeypatch):
    """Along the model's own greedy reply, the replayed choice of each min_certainty runs the very
    iterations that decoding with it runs: as many drafted trees, branches alone and plain steps; and
    so does a calibrated policy's, which learns where its drafts pay."""
    from reference import tiny_model

    import s3d_jax
    from s3d_jax import planning
    from s3d_jax.predict.replies import iteration_outcomes
    from s3d_jax.speedup import replay

    base = tiny_model(seed=1)
    model = base.__class__(base.params, base.config.replace(draft_skip=(2, 3), draft_gamma=3, draft_tree=4))
    prompt = [3, 14, 15, 92, 65, 35] * 2
    reply = s3d_jax.decode(model, prompt, method="ar", max_new_tokens=24, eos_token_ids=()).tokens
    outcomes = iteration_outcomes(model, [(prompt, reply)], planning.plan_for(model.config, s3d_jax.DecodeOptions(min_certainty=0.0)))
    certainties = np.sort(outcomes[0]["certainty"])
    gap = int(np.argmax(np.diff(certainties[len(certainties) // 4: 3 * len(certainties) // 4]))) + len(certainties) // 4
    middle = float(certainties[gap] + certainties[gap + 1]) / 2  # well away from any certainty
    kinds_seen = set()
    for gate in (0.0, middle, 1.0):
        out = s3d_jax.decode(model, prompt, min_certainty=gate, max_new_tokens=24, eos_token_ids=())
        assert out.tokens == reply
        stats = out.stats
        kinds = replay(outcomes, gate, {"plain": 1.0, "drafted": 2.0, "branch": 2.0})["kinds"]
        assert kinds == {"drafted": sum(stats.iterations) - sum(stats.branch_only), "branch": sum(stats.branch_only),
                         "plain": sum(stats.plain_steps)}, gate
        kinds_seen |= {kind for kind, count in kinds.items() if count}
    assert kinds_seen == {"drafted", "branch", "plain"}

    from s3d_jax import calibration
    from s3d_jax.speedup import Policy

    costs = {"plain": 1.0, "drafted": 3.0, "branch": 2.0}  # a drafted tree pays where it accepts two drafts or more
    learned_kinds = []
    for gate in (0.0, middle):
        # Without the context branch, which this reply's repetitions would take nearly everywhere.
        monkeypatch.setattr(calibration, "drafting_policy", lambda m, rows=1, gate=gate: (Policy(4, gate, False, 1.0, costs), "given"))
        out = s3d_jax.decode(model, prompt, max_new_tokens=24, eos_token_ids=())
        assert out.tokens == reply and out.stats.drafted_cost == 3.0 and out.stats.min_certainty == gate
        stats = out.stats
        kinds = replay(outcomes, gate, costs, lookup=False, learns=True)["kinds"]
        assert kinds == {"drafted": sum(stats.iterations) - sum(stats.branch_only), "branch": sum(stats.branch_only),
                         "plain": sum(stats.plain_steps)}, gate
        learned_kinds.append(kinds)
    # Learning changed what the loop did: it took plain steps where the fixed gate 0 drafts at every iteration.
    assert learned_kinds[0]["plain"] > 0 == replay(outcomes, 0.0, costs, lookup=False)["kinds"]["plain"]
