"""The speedup model of docs/design.md ("The speedup model"), and the choice of a drafting
policy from it: plain numpy, so that the decode API and the analyses share it.

Model:
  α_1(r) = 1 - c (1 - r)^κ            first-draft acceptance, → 1 as the draft uses the whole model (r → 1)
  α_j   = α_1 · δ_j                    δ_1 = 1; deeper drafts are discounted (fitted per depth)
  E     = 1 + Σ_{i≤γ} Π_{j≤i} α_j
  speedup = E · t(1) / (r · t(γ) + t(γ+1) + ε · t(1))
where t(T) is the measured time of a full pass over T tokens; with --assume-constant t(T) = C
(a memory-bound device), which gives docs/design.md's E / (1 + r + ε).

Trees (--trees): at every position of the model's own greedy replies, the rank of each of the next γ
tokens in the draft distributions of one S3D pass (0: the draft's first choice). A static tree is a
set of rank paths; it accepts at a position the longest path prefix of that position's ranks that it
holds. Its E is 1 + (the positions each of its paths covers) / positions, so the best tree of N nodes
is the N most frequent rank prefixes. They are chosen on half the replies and counted on the other
half (and the reverse), so the estimate is not fitted to the replies it is scored on. decode's own
trees are built from each pass's probabilities, not from fixed ranks, so they can do better.
The predictor models the draft's own trees: its measured decoding drafts at every iteration, without
the context branch (`lookup=False`), whose acceptance depends on the text, not on the drafter, and
without plain steps (`min_certainty=0`).
  tree speedup = E(N) · t(1) / (t_draft + t_tree(N) + ε · t(1)), the draft pass and t_tree(N) (tree build and
  verify) measured; with --assume-constant t_draft = r · t(1) and t_tree(N) = t(1)

Drafting gates (--gates): at every position of the model's own greedy replies, what each kind of tree
iteration of the drafter's defaults would do from there (docs/design.md, "Drafting only where the text
is predictable"): the drafts its tree would accept, whether the context supplies the branch and what
the branch alone would accept, and the verifier's certainty of x_n. Replaying the decode loop's choice
for each `min_certainty` over those records, with each kind's measured pass cost, predicts its speed:
  speedup = tokens / Σ cost(kind of each iteration), in plain steps; an oracle drafts exactly where
  the tree emits more tokens than it costs.
"""

from __future__ import annotations

import collections
import dataclasses
import math

import numpy as np

from s3d_jax.metrics import expected_tokens

RANKS = 8  # draft ranks the tree analysis tells apart; a token ranked lower is out of every tree's reach
TOP_K = (1, 2, 4, 8)  # reported: acceptance per depth when the tree holds the draft's k first choices


def draft_ratio(config, skip) -> float:
    """r: the fraction of the model's parameters that a draft pass through the layers outside `skip` uses."""
    d, f, e = config.hidden_size, config.intermediate_size, config.head_dim
    per_layer = d * e * (2 * config.num_heads + 2 * config.num_kv_heads) + 3 * d * f + 2 * d
    shared = config.vocab_size * d * (1 if config.tie_embeddings else 2) + d
    low, high = skip
    drafted = config.num_layers - (high - low + 1)
    return (shared + drafted * per_layer) / (shared + config.num_layers * per_layer)


def first_acceptance(r, c: float, kappa: float):
    """α_1(r), clipped to [0, 1]: a fit with c > 1 would go negative for drafts far smaller than measured."""
    return np.clip(1.0 - c * (1.0 - np.asarray(r, float)) ** kappa, 0.0, 1.0)


def fit_first_acceptance(r, alpha1) -> tuple[float, float]:
    """Least-squares (c, κ) of α_1(r) = 1 - c (1 - r)^κ; c in closed form for each κ on a grid."""
    r, y = np.asarray(r, float), 1.0 - np.asarray(alpha1, float)
    best = (np.inf, 1.0, 1.0)
    for kappa in np.linspace(0.05, 8.0, 800):
        x = (1.0 - r) ** kappa
        c = float(np.clip(np.dot(x, y) / max(np.dot(x, x), 1e-12), 0.0, 1.0 / max(x.max(), 1e-12)))
        err = float(np.sum((y - c * x) ** 2))
        if err < best[0]:
            best = (err, c, float(kappa))
    return best[1], best[2]


def fit_depth_discount(acceptances: list[list[float]], depth: int) -> np.ndarray:
    """δ_j for j = 1..depth: the mean of α_j / α_1 over drafters; unmeasured depths repeat the last."""
    ratios = [[] for _ in range(depth)]
    for alphas in acceptances:
        for j, a in enumerate(alphas[:depth]):
            if alphas[0] > 0 and a == a:
                ratios[j].append(a / alphas[0])
    delta = [1.0]
    for j in range(1, depth):
        delta.append(float(np.mean(ratios[j])) if ratios[j] else delta[-1])
    return np.maximum(np.asarray(delta), 0.0)


def predict_speedup(r: float, gamma: int, c: float, kappa: float, delta, pass_ms, epsilon: float = 0.0) -> float:
    alphas = [min(first_acceptance(r, c, kappa) * delta[min(j, len(delta) - 1)], 1.0) for j in range(gamma)]
    e = expected_tokens(alphas)
    return e * pass_ms(1) / (r * pass_ms(gamma) + pass_ms(gamma + 1) + epsilon * pass_ms(1))


def symmetric_skips(num_layers: int) -> list[tuple[int, int]]:
    """Skip ranges centred on the middle, from 2 layers to all but 2."""
    out = []
    for width in range(2, num_layers - 1, 2):
        low = (num_layers - width) // 2
        out.append((low, low + width - 1))
    return out


def interpolated(times: dict[int, float]):
    """t(T) from measured pass times, linear between and beyond the measured token counts."""
    ts = sorted(times)
    return lambda t: float(np.interp(t, ts, [times[k] for k in ts])) if t <= ts[-1] else times[ts[-1]] + (t - ts[-1]) * (
        (times[ts[-1]] - times[ts[0]]) / max(ts[-1] - ts[0], 1))


def rank_prefixes(ranks: np.ndarray) -> collections.Counter:
    """How many positions each rank path covers: every prefix of a position's ranks, up to its first
    rank out of reach."""
    counts = collections.Counter()
    for row in ranks.tolist():
        for depth in range(len(row)):
            if row[depth] >= RANKS:
                break
            counts[tuple(row[: depth + 1])] += 1
    return counts


def static_tree_e(chosen_on: np.ndarray, scored_on: np.ndarray, size: int) -> float:
    """E of the `size` rank paths most frequent in `chosen_on`, counted on `scored_on` (a child never
    covers more positions than its parent, so the most frequent paths form a tree)."""
    paths = [p for p, _ in sorted(rank_prefixes(chosen_on).items(), key=lambda item: (-item[1], len(item[0])))[:size]]
    scored = rank_prefixes(scored_on)
    return 1.0 + sum(scored[p] for p in paths) / max(len(scored_on), 1)


def tree_analysis(ranks: list[np.ndarray], sizes) -> dict:
    """Chain E, top-k acceptance per depth, and the static-tree E of each size, two-fold across replies."""
    folds = [np.concatenate(ranks[i::2]) if ranks[i::2] else np.zeros((0, 1), int) for i in (0, 1)]
    everything = np.concatenate(ranks)
    gamma = everything.shape[1]
    first_choices = np.cumprod(everything == 0, axis=1)  # all earlier depths were the first choice
    reached = np.concatenate([np.ones((len(everything), 1), bool), first_choices[:, :-1].astype(bool)], axis=1)
    top_k = {k: [float(np.mean(everything[reached[:, d], d] < k)) if reached[:, d].any() else float("nan") for d in range(gamma)]
             for k in TOP_K}

    def crossed(size):
        if not (len(folds[0]) and len(folds[1])):  # one reply: nothing to hold out
            return static_tree_e(everything, everything, size)
        return float(np.mean([static_tree_e(folds[i], folds[1 - i], size) for i in (0, 1)]))

    return {"positions": len(everything), "chain_e": 1.0 + float(first_choices.sum(axis=1).mean()),
            "top_k_acceptance_per_depth": top_k, "tree_e": {int(n): crossed(n) for n in sizes}}


def replay(outcomes: list[dict], min_certainty: float | None, costs: dict, lookup: bool = True, learns: bool = False) -> dict:
    """The decode loop's choice at each iteration, replayed along the replies (batch 1): the tokens after
    each reply's first, their cost in plain steps, and how many iterations of each kind
    (`drafted`, `branch`, `plain`) ran and how many tokens they emitted. `min_certainty` None is the
    oracle, `NEVER` never drafts; without `lookup` the context branch never runs. With `learns`, each
    side of the gate drafts until its drafted iterations of the reply have emitted, in all, more than
    one iteration's cost fewer tokens than their cost in plain steps, as `decoding.wants_draft` does."""
    tokens, cost, kinds, emitted_by_kind = 0, 0.0, collections.Counter(), collections.Counter()
    for reply in outcomes:
        n, end = 0, len(reply["certainty"])
        surplus = [0.0, 0.0]  # below and at or above the gate: tokens drafted iterations emitted beyond their cost
        while n < end:
            if lookup and reply["branch"][n]:
                kind, emitted = "branch", reply["branch_k"][n] + 1
            else:
                if min_certainty is None:
                    pays = reply["drafted"][n] + 1 > costs["drafted"]
                else:
                    side = int(reply["certainty"][n] >= min_certainty)
                    pays = surplus[side] + costs["drafted"] >= 0 if learns else bool(side)
                kind, emitted = ("drafted", reply["drafted"][n] + 1) if pays else ("plain", 1)
                if pays and learns:
                    surplus[side] += emitted - costs["drafted"]
            emitted = min(int(emitted), end - n)  # the reply ends there
            n, tokens, cost = n + emitted, tokens + emitted, cost + costs[kind]
            kinds[kind] += 1
            emitted_by_kind[kind] += emitted
    return {"tokens": tokens, "cost": cost, "kinds": {kind: kinds[kind] for kind in ("drafted", "branch", "plain")},
            "emitted": {kind: emitted_by_kind[kind] for kind in ("drafted", "branch", "plain")}}


NEVER = math.inf  # a `min_certainty` no certainty reaches: never draft
GATES = (0.0, 0.3, 0.5, 0.7, 0.8, 0.9, 0.95, NEVER)  # the policy's candidate `min_certainty`


@dataclasses.dataclass(frozen=True)
class Policy:
    """How S3D decodes where the caller left it open: the tree, the gate and the context branch, and
    what the replay predicted for them (tokens per plain step's time) from `costs` (plain steps). A
    policy that drafts learns where drafting pays as it decodes, apart below and at or above its gate
    (`drafted_cost`)."""

    tree: int
    min_certainty: float  # NEVER: no iteration drafts
    lookup: bool
    predicted_speedup: float
    costs: dict

    @property
    def drafts(self) -> bool:
        return self.min_certainty != NEVER

    @property
    def drafted_cost(self) -> float:
        """What a drafted iteration's tokens must repay (`Plan.drafted_cost`); 0 where it never drafts."""
        return self.costs["drafted"] if self.drafts else 0.0

    @property
    def plain(self) -> bool:
        """Nothing speculative pays: decode plainly."""
        return not self.drafts and not self.lookup

    def describe(self) -> str:
        if self.plain:
            what = "plain steps (no drafted tree or context branch repays its passes here)"
        else:
            gate = "never drafts" if not self.drafts else "drafts while its drafts pay" if self.min_certainty == 0 else \
                f"drafts while its drafts pay, learned apart below and above a certainty of {self.min_certainty:g}"
            what = f"tree of {self.tree}, {gate}{', context branch on' if self.lookup else ''}"
        costs = ", ".join(f"{kind} {cost:.2f}" for kind, cost in self.costs.items())
        return f"calibrated policy: {what}; predicted {self.predicted_speedup:.2f}x (pass costs in plain steps: {costs})"


# Predictions this close are a tie: quiet calibrations differ by a few percent, and the profile is
# one sample of text. On a tie the policy drafts: measured, it was the faster one every time the
# replay called a tie (docs/experiments.md, "A calibration that a busy machine cannot skew").
TIE = 0.02


def choose_policy(costs: dict, profile: dict) -> Policy:
    """The tree size, gate and context branch whose replay over the drafter's measured outcomes emits
    the most tokens per unit of plain-step time. `costs`: {"drafted": {N: steps}, "branch": {N: steps}}
    (`PassCosts.in_steps`); `profile`: {N: outcomes of a tree of N} (`iteration_outcomes`).
    Plain decoding (1.0) is the baseline, and no policy predicted below it is chosen. A drafting
    policy learns as it decodes (`replay(learns=True)`), so a gate only splits what it learns; on
    equal predictions the lowest gate wins, the one split that learning needs least. The best drafting policy
    wins over a better policy that never drafts when it predicts within `TIE` of it and its drafted
    iterations repay their cost within `TIE` (emit as many tokens as the plain steps of their time)."""
    best = {False: Policy(0, NEVER, False, 1.0, {"plain": 1.0}), True: None}  # by whether it drafts
    drafting_replay = None  # the best drafting policy's replay, which decides whether its drafts repay
    for size in sorted(profile):
        if size not in costs["drafted"]:
            continue
        kinds = {"plain": 1.0, "drafted": costs["drafted"][size], "branch": costs["branch"][size]}
        for lookup in (False, True):
            for gate in GATES:
                if gate == NEVER and not lookup:
                    continue  # that is plain decoding, the baseline
                replayed = replay(profile[size], gate, kinds, lookup, learns=gate != NEVER)
                speedup = replayed["tokens"] / max(replayed["cost"], 1e-9)
                known = best[gate != NEVER]
                if known is None or speedup > known.predicted_speedup * (1 + 1e-9):
                    best[gate != NEVER] = Policy(size, gate, lookup, speedup, kinds)
                    if gate != NEVER:
                        drafting_replay = replayed
    drafting, other = best[True], best[False]
    if drafting is None or drafting.predicted_speedup <= 1.0 or drafting.predicted_speedup < other.predicted_speedup * (1 - TIE):
        return other
    drafted = drafting_replay["kinds"]["drafted"]  # a gate the profile never saw open repays nothing
    repays = drafted > 0 and drafting_replay["emitted"]["drafted"] >= drafted * drafting.costs["drafted"] * (1 - TIE)
    return drafting if repays else other


@dataclasses.dataclass(frozen=True)
class PassCosts:
    """Milliseconds of each pass on this machine, for one model: `step` (one token through the full
    model), `verify` (γ+1 tokens), `draft` (one S3D pass of γ), `trees[N]` (build and verify a tree of N
    nodes; an N the calibration did not time is interpolated by rows), the seconds it took, whether the
    machine was busy with other work meanwhile, and how many calibrations in a row found it so."""

    step: float
    verify: float
    draft: float
    trees: dict
    gamma: int
    seconds: float
    machine: str
    busy: bool = False
    tries: int = 1

    def tree(self, nodes: int) -> float:
        points = sorted({0: self.step, **self.trees}.items())
        return float(np.interp(nodes, [n for n, _ in points], [ms for _, ms in points]))

    def in_steps(self, sizes, branch_slots: int) -> dict:
        """The policy's costs in plain steps: a drafted tree of each size, and the branch verified alone
        through that tree's slots (N + `branch_slots`)."""
        return {"drafted": {n: (self.draft + self.tree(n)) / self.step for n in sizes},
                "branch": {n: self.tree(n + branch_slots) / self.step for n in sizes}}

    def policy(self, profile: dict) -> Policy:
        """The drafting policy these costs and a drafter's acceptance profile choose (`speedup.choose_policy`)."""
        return choose_policy(self.in_steps(sorted(profile), branch_slots=self.gamma), profile)

    def summary(self) -> str:
        trees = ", ".join(f"tree {n} {ms / self.step:.2f}" for n, ms in sorted(self.trees.items()))
        return (f"step {self.step:.1f} ms; in steps: verify of {self.gamma + 1} {self.verify / self.step:.2f}, "
                f"draft of {self.gamma} {self.draft / self.step:.2f}, {trees}")
