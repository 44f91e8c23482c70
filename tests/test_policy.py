"""The drafting policy chosen from pass costs (`speedup.choose_policy`), with costs injected: the
choice itself, not the machine's timings."""

import numpy as np
import pytest

from s3d_jax.speedup import GATES, NEVER, TIE, choose_policy, replay

REACH = {4: 8, 8: 12, 16: 20}  # a tree's slots with γ = 4: N + γ


def outcomes(size: int, seed: int = 0, replies: int = 6, length: int = 80, branch_share: float = 0.0) -> list[dict]:
    """Synthetic per-position outcomes: the certainty of x_n, and a tree of `size` accepting more where
    the text is more certain (and a larger tree a little more)."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(replies):
        certainty = rng.uniform(0, 1, length)
        drafted = np.minimum(rng.binomial(4, np.clip(certainty * (0.4 + size / 80), 0, 1)), REACH[size])
        branch = rng.uniform(0, 1, length) < branch_share
        out.append({"certainty": certainty, "drafted": drafted, "branch": branch, "branch_k": np.where(branch, 4, 0)})
    return out


def profile(**kw) -> dict:
    return {size: outcomes(size, **kw) for size in REACH}


def costs(drafted, branch=None) -> dict:
    drafted = drafted if isinstance(drafted, dict) else dict.fromkeys(REACH, drafted)
    branch = branch if isinstance(branch, dict) else dict.fromkeys(REACH, drafted[4] if branch is None else branch)
    return {"drafted": drafted, "branch": branch}


def test_verify_as_cheap_as_a_step_drafts_at_every_iteration():
    policy = choose_policy(costs(1.0), profile())
    assert policy.drafts and policy.min_certainty == 0.0
    assert policy.tree == 16  # equal costs: the tree that accepts most
    assert policy.predicted_speedup > 1.5
    assert "drafts while its drafts pay" in policy.describe() and "apart" not in policy.describe()
    # No drafted iteration emits fewer tokens than it costs, so learning never stops drafting.
    assert replay(profile()[16], 0.0, policy.costs, policy.lookup, learns=True)["kinds"]["plain"] == 0


def test_a_drafted_iteration_no_e_can_repay_never_drafts():
    # An iteration accepts at most REACH[N] drafts, so it emits at most REACH[N] + 1 tokens.
    unpayable = {size: REACH[size] + 1.0 for size in REACH}
    policy = choose_policy(costs(unpayable), profile())
    assert not policy.drafts and policy.plain
    assert policy.predicted_speedup == 1.0
    assert "plain steps" in policy.describe()
    # The same with a context branch that pays: the branch stays on, the draft off.
    policy = choose_policy(costs(unpayable, branch=1.2), profile(branch_share=0.3))
    assert not policy.drafts and policy.lookup and policy.predicted_speedup > 1.0


def test_costs_between_choose_a_gate_where_the_text_is_predictable():
    policy = choose_policy(costs(1.9), profile())
    assert policy.drafts and 0.0 < policy.min_certainty < 1.0
    # The chosen gate beats drafting everywhere and never drafting, by the replay the policy used.
    kinds = policy.costs
    chosen = replay(profile()[policy.tree], policy.min_certainty, kinds, policy.lookup)
    for gate in (0.0, NEVER):
        other = replay(profile()[policy.tree], gate, kinds, policy.lookup)
        assert chosen["tokens"] / chosen["cost"] >= other["tokens"] / other["cost"]


def test_learning_stops_drafting_on_the_side_of_the_gate_where_drafts_stop_paying():
    # Certain and uncertain positions alternate; a drafted tree accepts 2 after a certain x_n (so the
    # next x_n is an uncertain one) and 0 after an uncertain one, and costs 2 plain steps.
    certainty = np.tile([0.95, 0.2], 20)
    reply = {"certainty": certainty, "drafted": np.where(certainty > 0.5, 2, 0), "branch": np.zeros(40, bool),
             "branch_k": np.zeros(40, int)}
    kinds = {"plain": 1.0, "drafted": 2.0, "branch": 2.0}
    fixed = replay([reply], 0.5, kinds, lookup=False)
    learned = replay([reply], 0.5, kinds, lookup=False, learns=True)
    # Fixed at the gate, every uncertain position is a plain step. Learned, the uncertain side drafts
    # until its drafts (1 token for 2 steps each) fall short by more than one iteration's 2 steps, so
    # three times, and the certain side keeps drafting (3 tokens for 2 steps).
    assert fixed["kinds"] == {"drafted": 10, "branch": 0, "plain": 10}
    assert learned["kinds"]["drafted"] == fixed["kinds"]["drafted"] + 3
    assert learned["emitted"]["drafted"] == fixed["emitted"]["drafted"] + 3
    # One side alone (gate 0) learns from every draft: 3 tokens, then 1 (surplus 1, then 0), ... all pay.
    assert replay([reply], 0.0, kinds, lookup=False, learns=True)["kinds"]["plain"] == 0
    # Drafts that never repay stop after the third.
    losing = {**reply, "drafted": np.zeros(40, int)}
    assert replay([losing], 0.0, kinds, lookup=False, learns=True)["kinds"] == {"drafted": 3, "branch": 0, "plain": 37}


def test_a_tree_size_without_costs_is_not_chosen():
    policy = choose_policy({"drafted": {4: 1.0}, "branch": {4: 1.0}}, profile())
    assert policy.tree == 4


@pytest.mark.parametrize("cost", [1.0, 1.5, 2.5, 40.0])
def test_the_policy_never_predicts_below_plain(cost):
    assert choose_policy(costs(cost), profile()).predicted_speedup >= 1.0


def best_prediction(policy_costs, prof, drafting: bool) -> tuple[float, bool]:
    """The replay's best prediction among the policies that draft (or among those that never do), and
    whether that policy's drafted iterations emit as many tokens as plain steps would in their time."""
    best = (0.0, False)
    for size, outs in prof.items():
        kinds = {"plain": 1.0, "drafted": policy_costs["drafted"][size], "branch": policy_costs["branch"][size]}
        for lookup in (False, True):
            for gate in GATES:
                if (gate != NEVER) == drafting and (gate != NEVER or lookup):
                    replayed = replay(outs, gate, kinds, lookup, learns=gate != NEVER)
                    drafted = replayed["kinds"]["drafted"]
                    repays = drafted > 0 and replayed["emitted"]["drafted"] >= drafted * kinds["drafted"] * (1 - TIE)
                    best = max(best, (replayed["tokens"] / replayed["cost"], repays), key=lambda b: b[0])
    return best


def test_a_near_tie_between_drafting_and_never_drafting_drafts():
    prof, ties = profile(branch_share=0.3), 0
    for drafted in np.linspace(1.2, 4.0, 141):  # steps of 0.02: a tie spans a few of them
        injected = costs(float(drafted), branch=1.3)
        policy = choose_policy(injected, prof)
        (drafting, repays), (never, _) = best_prediction(injected, prof, True), best_prediction(injected, prof, False)
        assert policy.drafts == (repays and drafting > 1.0 and drafting >= never * (1 - TIE)), (drafted, drafting, never)
        assert policy.predicted_speedup == pytest.approx(drafting if policy.drafts else max(never, 1.0))
        ties += policy.drafts and drafting < never
    assert ties  # the sweep crossed a tie that the drafting policy took
    # A gate that opens rarely predicts within the tie of never drafting even where each drafted
    # iteration loses: those are not ties to take.
    rare = choose_policy(costs(30.0, branch=1.3), prof)
    assert not rare.drafts and rare.lookup
