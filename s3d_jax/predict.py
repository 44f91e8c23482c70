"""The speedup model of docs/design.md ("Predicting the speedup"): fit it, and pick the best (l, h, γ).

    python -m s3d_jax.predict --drafters runs/skip_a/model runs/skip_b/model runs/skip_c/model
    python -m s3d_jax.predict --drafters ... --sweep          # also measure every setting, and plot both
    python -m s3d_jax.predict --acceptance measured.json --assume-constant --model PATH
    python -m s3d_jax.predict --drafters s3d_jax/drafters/SmolLM2-135M-Instruct.safetensors --trees 8 16 32 64 [--sweep]
    python -m s3d_jax.predict --drafters s3d_jax/drafters/SmolLM2-135M-Instruct.safetensors --gates 0 0.5 0.9 1 [--sweep]

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

import argparse
import collections
import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from matplotlib.figure import Figure

from s3d_jax import api, tree
from s3d_jax import drafter as drafter_lib
from s3d_jax.bench.methods import decode_prompts
from s3d_jax.bench.suites import load_suite
from s3d_jax.bench.timing import draft_ms, tree_verify_ms, verify_ms
from s3d_jax.cache import prompt_forward
from s3d_jax.decoding import top_probability
from s3d_jax.metrics import acceptance_per_depth, expected_tokens, tokens_per_iteration
from s3d_jax.model import head_logits
from s3d_jax.options import DecodeOptions
from s3d_jax.speculative import Plan, draft, draft_s3d

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


def first_turns(questions: int) -> list[dict]:
    return [{**q, "turns": q["turns"][:1]} for q in load_suite("mt_bench", questions)]


def measure(model, questions: int, options: DecodeOptions):
    """Decodes the first turn of `questions` MT-Bench questions: (tokens/s, pooled accept histogram)."""
    decoded = decode_prompts(model, {"mt_bench": first_turns(questions)}, options)
    return decoded.tokens_per_second, decoded.histogram


# ------------------------------------------------------------------ trees


def greedy_replies(model, questions: int, max_new_tokens: int) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, the model's plain greedy reply) for the first turn of `questions` MT-Bench questions."""
    replies = []
    for q in first_turns(questions):
        messages = [{"role": "user", "content": q["turns"][0]}]
        reply = api.decode(model, messages, chat=True, method="ar", max_new_tokens=max_new_tokens).tokens
        replies.append((api.encode(model, messages, chat=True)[0][0], reply))
    return replies


def draft_ranks(model, replies, gamma: int) -> list[np.ndarray]:
    """Per reply, `[positions, γ]`: at every position n of the reply, the rank (0: the first choice) of
    the tokens n+1 .. n+γ in the draft distributions of one S3D pass from x_n, the cache holding the
    full model's entries before n, as in decoding. Greedy decoding visits exactly these tokens."""
    config = model.config
    plan = Plan.make(config, "s3d", gamma, config.draft_skip)

    @jax.jit
    def ranks(params, ids, positions):
        _, cache = prompt_forward(params, config, ids[None], ids.shape[0])

        def at(n):
            seen = jnp.where(jnp.arange(ids.shape[0]) <= n, ids, 0)[None]  # the context so far, as decoding has it
            _, logits, _ = draft_s3d(params, config, plan, cache.replace(lengths=n[None]), ids[n][None], jax.random.key(0), seen)
            own = jnp.take_along_axis(logits[0], jax.lax.dynamic_slice(ids, (n + 1,), (gamma,))[:, None], axis=1)
            return jnp.sum(logits[0] > own, axis=1)

        return jax.lax.map(at, positions)

    out = []
    for prompt, reply in replies:
        positions = np.arange(len(prompt), len(prompt) + len(reply) - gamma)
        if len(positions):
            out.append(np.asarray(ranks(model.params, *bucketed(prompt + reply, positions)))[: len(positions)])
    return out


def bucketed(ids: list[int], positions: np.ndarray, room: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """`ids` zero-padded to a bucket with at least `room` slots past the end, and `positions` repeated
    to a bucket: a jitted pass over them compiles once per pair of buckets."""
    padded_ids = np.zeros(api.bucket(len(ids) + room), np.int32)
    padded_ids[: len(ids)] = ids
    return padded_ids, np.resize(positions, api.bucket(len(positions)))


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


def predict_trees(model, args, pass_ms, plain_speed: float | None) -> dict:
    """The drafter's chain (tree 0) and trees of each size in `args.trees`: predicted E, verify cost and
    speedup; with `plain_speed` (the --sweep), also the measured E and speed of decoding with each."""
    config, gamma = model.config, model.config.draft_gamma or args.max_gamma
    print(f"measuring draft ranks of skip {list(config.draft_skip)}, gamma {gamma} on the model's own replies ...", file=sys.stderr)
    analysis = tree_analysis(draft_ranks(model, greedy_replies(model, args.questions, args.max_new_tokens), gamma), args.trees)
    # The draft pass is measured here (it may have a reduced head and adapters), or r plain steps on a memory-bound device.
    draft = draft_ratio(config, config.draft_skip) * pass_ms(1) if args.assume_constant else draft_ms(model, config.draft_skip, gamma)
    rows = []
    for size in [0, *args.trees]:
        e = analysis["tree_e"][size] if size else analysis["chain_e"]
        verify = pass_ms(gamma + 1) if not size or args.assume_constant else tree_verify_ms(model, size, gamma)
        row = {"tree": size, "predicted_e": e, "verify_ms": verify, "verify_vs_step": verify / pass_ms(1),
               "predicted_speedup": e * pass_ms(1) / (draft + verify + args.epsilon * pass_ms(1))}
        if plain_speed:
            print(f"decoding with tree {size} ...", file=sys.stderr)
            # The draft's own tree, as predicted, at every iteration: neither the context branch nor plain steps are part of the model.
            speed, hist = measure(model, args.questions, DecodeOptions(chat=True, max_new_tokens=args.max_new_tokens, gamma=gamma,
                                                                       tree=size, lookup=False, min_certainty=0.0 if size else None))
            row.update(measured_e=tokens_per_iteration(hist), measured_speedup=speed / plain_speed)
        rows.append(row)
    best = max(rows, key=lambda row: row["predicted_speedup"])
    return {"skip": list(config.draft_skip), "gamma": gamma, **analysis, "rows": rows, "recommended_tree": best["tree"]}


# ------------------------------------------------------------------ drafting gates


def iteration_outcomes(model, replies, plan: Plan) -> list[dict]:
    """Per reply, arrays over its positions n (x_n a token of the reply, the cache holding the full
    model's entries before n, as in decoding): `certainty` (the verifier's top probability where it
    picked x_n), `drafted` (drafts the plan's tree would accept), `branch` (whether the context
    supplies the branch alone) and `branch_k` (drafts the branch alone would accept)."""
    config, key = model.config, jax.random.key(0)

    @jax.jit
    def outcomes(params, ids, positions):
        hidden, cache = prompt_forward(params, config, ids[None], ids.shape[0])
        certainty = top_probability(head_logits(params, config, hidden)[0])  # at p: where the verifier picked ids[p + 1]

        def at(n):
            seen = jnp.where(jnp.arange(ids.shape[0]) <= n, ids, 0)[None]  # the context so far, as decoding has it
            at_n, x_n = cache.replace(lengths=n[None]), ids[n][None]

            def accepted(nodes):
                logits, _ = tree.verify_block(params, config, at_n, nodes, plan.reach)
                return tree.accept(key, nodes, logits, plan.reach, plan.sampling)[0][0]

            _, draft_logits, _ = draft(params, config, plan, at_n, x_n, key, seen)
            branch, known, matched = tree.context_branch(seen, n[None], plan.reach)
            suffices = tree.branch_suffices(known[:, : plan.gamma], matched, jnp.zeros((1,), bool))
            return {"certainty": certainty[n - 1], "drafted": accepted(tree.build(x_n, draft_logits, plan.tree)),
                    "branch": suffices, "branch_k": accepted(tree.graft(tree.root(x_n), branch, known))}

        return jax.lax.map(at, positions)

    out = []
    for prompt, reply in replies:
        positions = np.arange(len(prompt), len(prompt) + len(reply) - 1)
        padded = outcomes(model.params, *bucketed(prompt + reply, positions, room=plan.reach))  # room for the tree's slots
        out.append({k: np.asarray(v)[: len(positions)] for k, v in padded.items()})
    return out


def replay(outcomes: list[dict], min_certainty: float | None, costs: dict) -> dict:
    """The decode loop's choice at each iteration, replayed along the replies (batch 1): the tokens after
    each reply's first, their cost in plain steps, and how many iterations of each kind
    (`drafted`, `branch`, `plain`). `min_certainty` None is the oracle."""
    tokens, cost, kinds = 0, 0.0, collections.Counter()
    for reply in outcomes:
        n, end = 0, len(reply["certainty"])
        while n < end:
            if reply["branch"][n]:
                kind, emitted = "branch", reply["branch_k"][n] + 1
            else:
                pays = reply["drafted"][n] + 1 > costs["drafted"] if min_certainty is None else reply["certainty"][n] >= min_certainty
                kind, emitted = ("drafted", reply["drafted"][n] + 1) if pays else ("plain", 1)
            emitted = min(int(emitted), end - n)  # the reply ends there
            n, tokens, cost = n + emitted, tokens + emitted, cost + costs[kind]
            kinds[kind] += 1
    return {"tokens": tokens, "cost": cost, "kinds": {kind: kinds[kind] for kind in ("drafted", "branch", "plain")}}


def predict_gates(model, args, plain_speed: float | None) -> dict:
    """Each `min_certainty` of `args.gates` (and the oracle): predicted speedup and the share of each
    kind of iteration; with `plain_speed` (the --sweep), also the measured speedup of decoding with it."""
    config = model.config
    plan = api.plan_for(config, DecodeOptions(min_certainty=0.0))
    if not plan.tree or not plan.lookup:
        raise SystemExit(f"--gates replays a drafter's tree with the context branch; this drafter's default tree is {plan.tree}")
    print(f"replaying min_certainty {args.gates} on the model's own replies ...", file=sys.stderr)
    outcomes = iteration_outcomes(model, greedy_replies(model, args.questions, args.max_new_tokens), plan)
    step = verify_ms(model, 1)
    costs = {"plain": 1.0, "drafted": (draft_ms(model, plan.skip, plan.gamma) + tree_verify_ms(model, plan.tree, plan.gamma)) / step,
             "branch": tree_verify_ms(model, plan.nodes, plan.gamma) / step}
    rows = []
    for gate in [*args.gates, None]:
        replayed = replay(outcomes, gate, costs)
        iterations = max(sum(replayed["kinds"].values()), 1)
        row = {"min_certainty": gate, "predicted_speedup": replayed["tokens"] / replayed["cost"],
               **{f"{kind}_share": count / iterations for kind, count in replayed["kinds"].items()}}
        if plain_speed and gate is not None:
            print(f"decoding with min_certainty {gate} ...", file=sys.stderr)
            speed, _ = measure(model, args.questions, DecodeOptions(chat=True, max_new_tokens=args.max_new_tokens, min_certainty=gate))
            row["measured_speedup"] = speed / plain_speed
        rows.append(row)
    return {"skip": list(plan.skip), "gamma": plan.gamma, "tree": plan.tree, "costs": costs,
            "positions": int(sum(len(o["certainty"]) for o in outcomes)), "rows": rows}


def gate_table(gates: dict) -> str:
    """Markdown: each min_certainty's predicted (and measured) speedup and kinds of iteration."""
    measured = any("measured_speedup" in row for row in gates["rows"])
    costs = gates["costs"]
    head = ["min_certainty", "predicted speedup", "drafted", "branch alone", "plain steps"] + (["measured speedup"] if measured else [])
    lines = [f"skip {gates['skip']}, gamma {gates['gamma']}, tree {gates['tree']}, {gates['positions']} positions; pass costs in "
             f"plain steps: drafted tree {costs['drafted']:.2f}, branch alone {costs['branch']:.2f}", "",
             "| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for row in gates["rows"]:
        cells = ["oracle" if row["min_certainty"] is None else f"{row['min_certainty']:g}", f"{row['predicted_speedup']:.2f}x",
                 f"{row['drafted_share']:.0%}", f"{row['branch_share']:.0%}", f"{row['plain_share']:.0%}"]
        if measured:
            cells.append(f"{row['measured_speedup']:.2f}x" if "measured_speedup" in row else "-")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m s3d_jax.predict", description=__doc__.splitlines()[0])
    p.add_argument("--drafters", nargs="*", default=[],
                   help="trained drafters: drafter files (applied to --model) or model dirs with a recorded skip range")
    p.add_argument("--acceptance", help='json: [{"skip": [l, h], "acceptance_per_depth": [...]}, ...] instead of measuring')
    p.add_argument("--model", default=None,
                   help="the base model, whose pass costs and layer sizes to use (default: the bundled model, or the first drafter dir)")
    p.add_argument("--questions", type=int, default=10, help="MT-Bench questions per measurement")
    p.add_argument("--max-gamma", type=int, default=6)
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--epsilon", type=float, default=0.05, help="fixed overhead per iteration, in plain steps")
    p.add_argument("--assume-constant", action="store_true", help="t(T) = C: a memory-bound device")
    p.add_argument("--sweep", action="store_true", help="also measure the speedup of every drafter and gamma (and tree)")
    p.add_argument("--trees", type=int, nargs="*", default=[], metavar="N",
                   help="also predict token trees of these sizes for each drafter (at its own gamma), and recommend one")
    p.add_argument("--gates", type=float, nargs="*", default=[], metavar="P",
                   help="also replay these min_certainty values for each drafter's default tree (and an oracle)")
    p.add_argument("--out", default="results/predict")
    args = p.parse_args(argv)

    if not args.drafters and not args.acceptance:
        p.error("give --drafters to measure, or --acceptance with measured values")
    if args.trees and (not args.drafters or min(args.trees) < 1):
        p.error("--trees needs --drafters (their draft passes are measured) and sizes >= 1")
    if args.gates and (not args.drafters or not all(0.0 <= g <= 1.0 for g in args.gates)):
        p.error("--gates needs --drafters (their replies are replayed) and probabilities in [0, 1]")
    files = [d for d in args.drafters if d.endswith(drafter_lib.SUFFIX)]
    base = api.load(args.model or (None if files or not args.drafters else args.drafters[0]), drafter=None)
    config = base.config
    points = json.loads(Path(args.acceptance).read_text()) if args.acceptance else []
    greedy = DecodeOptions(chat=True, max_new_tokens=args.max_new_tokens)
    drafters, at_max_gamma = {}, {}  # the γ = max run serves both the fit and the sweep
    for path in args.drafters:
        # A drafter file applies to --model (default: the bundled model); a directory is a trained model.
        drafter = api.load(args.model, drafter=path) if path in files else api.load(path)
        if drafter.config.draft_skip is None:
            p.error(f"{path} records no skip range; train it with s3d_jax.train")
        print(f"measuring acceptance of {path} (skip {drafter.config.draft_skip}) ...", file=sys.stderr)
        skip = tuple(drafter.config.draft_skip)
        drafters[skip] = drafter
        at_max_gamma[skip] = measure(drafter, args.questions, greedy.replace(gamma=args.max_gamma))
        points.append({"skip": list(drafter.config.draft_skip), "acceptance_per_depth": acceptance_per_depth(at_max_gamma[skip][1])})
    for point in points:
        point["r"] = draft_ratio(config, point["skip"])
    c, kappa = fit_first_acceptance([q["r"] for q in points] + [1.0], [q["acceptance_per_depth"][0] for q in points] + [1.0])
    delta = fit_depth_discount([q["acceptance_per_depth"] for q in points], args.max_gamma)
    if args.assume_constant:
        times = {t: 1.0 for t in range(1, args.max_gamma + 2)}
    else:
        times = {t: verify_ms(base, t) for t in (1, 2, 4, args.max_gamma + 1)}
    t = interpolated(times)

    def predicted(skip, gamma: int) -> float:
        return predict_speedup(draft_ratio(config, skip), gamma, c, kappa, delta, t, args.epsilon)

    gammas = range(1, args.max_gamma + 1)
    predictions = [{"skip": list(skip), "gamma": gamma, "r": draft_ratio(config, skip), "predicted_speedup": predicted(skip, gamma)}
                   for skip in symmetric_skips(config.num_layers) for gamma in gammas]
    best = max(predictions, key=lambda q: q["predicted_speedup"])
    report = {"fit": {"c": c, "kappa": kappa, "delta": delta.tolist(), "pass_ms": times}, "points": points, "best_predicted": best}
    if args.sweep:
        measured = []
        for skip, drafter in drafters.items():
            print(f"measuring the speedup of skip {list(skip)} for gamma 1..{args.max_gamma} ...", file=sys.stderr)
            plain, _ = measure(drafter, args.questions, greedy.plain())
            r = draft_ratio(config, skip)
            for gamma in gammas:
                options = greedy.replace(gamma=gamma)
                speed, hist = at_max_gamma[skip] if gamma == args.max_gamma else measure(drafter, args.questions, options)
                measured.append({"skip": list(skip), "gamma": gamma, "r": r, "measured_speedup": speed / plain,
                                 "tokens_per_iteration": tokens_per_iteration(hist), "predicted_speedup": predicted(skip, gamma)})
        report["measured"] = measured
        report["best_measured"] = max(measured, key=lambda q: q["measured_speedup"])
    plain_speed = measure(base, args.questions, greedy.plain())[0] if args.sweep and (args.trees or args.gates) else None
    if args.trees:
        report["trees"] = [predict_trees(drafter, args, t, plain_speed) for drafter in drafters.values()]
    if args.gates:
        report["gates"] = [predict_gates(drafter, args, plain_speed) for drafter in drafters.values()]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "predict.json").write_text(json.dumps(report, indent=1))
    plot(report, out / "predict.png")
    print(f"fit: alpha_1(r) = 1 - {c:.3f} (1 - r)^{kappa:.2f}; depth discount {np.round(delta, 3).tolist()}")
    print(f"best predicted: skip {best['skip']}, gamma {best['gamma']} -> {best['predicted_speedup']:.2f}x")
    if args.sweep:
        b = report["best_measured"]
        print(f"best measured:  skip {b['skip']}, gamma {b['gamma']} -> {b['measured_speedup']:.2f}x")
    for trees in report.get("trees", []):
        print(tree_table(trees))
        plot_trees(trees, out / f"predict_trees_skip{trees['skip'][0]}-{trees['skip'][1]}.png")
    for gates in report.get("gates", []):
        print(gate_table(gates))
    print(f"wrote {out}/predict.json and the plots")
    return 0


def tree_table(trees: dict) -> str:
    """Markdown: each tree size's predicted (and measured) E, verify cost and speedup; 0 is the chain."""
    measured = "measured_e" in trees["rows"][0]
    head = ["tree N", "predicted E", "verify vs plain step", "predicted speedup"] + (["measured E", "measured speedup"] if measured else [])
    lines = [f"skip {trees['skip']}, gamma {trees['gamma']}, {trees['positions']} positions; "
             f"recommended tree: {trees['recommended_tree'] or 'the chain'}", "", "| " + " | ".join(head) + " |",
             "|" + " --- |" * len(head)]
    for row in trees["rows"]:
        cells = [str(row["tree"] or "chain"), f"{row['predicted_e']:.2f}", f"{row['verify_vs_step']:.2f}x",
                 f"{row['predicted_speedup']:.2f}x"]
        if measured:
            cells += [f"{row['measured_e']:.2f}", f"{row['measured_speedup']:.2f}x"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot_trees(trees: dict, path: Path) -> None:
    fig = Figure(figsize=(10, 3.8))
    left, right = fig.subplots(1, 2)
    rows = trees["rows"]
    sizes = [row["tree"] or trees["gamma"] for row in rows]  # the chain has γ nodes
    for ax, key, label in ((left, "e", "tokens per iteration E"), (right, "speedup", "speedup vs plain")):
        ax.plot(sizes, [row[f"predicted_{key}"] for row in rows], "o--", label="predicted")
        if f"measured_{key}" in rows[0]:
            ax.plot(sizes, [row[f"measured_{key}"] for row in rows], "s-", label="measured")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("tree nodes N (leftmost: the chain)")
        ax.set_ylabel(label)
        ax.legend()
    right.axhline(1.0, color="gray", lw=0.8)
    fig.suptitle(f"skip {trees['skip']}, gamma {trees['gamma']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def plot(report: dict, path: Path) -> None:
    fig = Figure(figsize=(11, 4))
    left, right = fig.subplots(1, 2)
    rs = np.linspace(0.05, 1.0, 100)
    fit = report["fit"]
    left.plot(rs, first_acceptance(rs, fit["c"], fit["kappa"]), label="fitted alpha_1(r)")
    left.plot([q["r"] for q in report["points"]], [q["acceptance_per_depth"][0] for q in report["points"]], "o", label="measured")
    left.set_xlabel("r (fraction of parameters the draft uses)")
    left.set_ylabel("first-draft acceptance")
    left.legend()
    for gamma in sorted({q["gamma"] for q in report.get("measured", [])}):
        rows = [q for q in report["measured"] if q["gamma"] == gamma]
        rows.sort(key=lambda q: q["r"])
        dots = right.plot([q["r"] for q in rows], [q["measured_speedup"] for q in rows], "o", label=f"measured, gamma={gamma}")
        right.plot([q["r"] for q in rows], [q["predicted_speedup"] for q in rows], "--", color=dots[0].get_color(), alpha=0.7)
    right.axhline(1.0, color="gray", lw=0.8)
    right.set_xlabel("r")
    right.set_ylabel("speedup (dashed: predicted)")
    if report.get("measured"):
        right.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    sys.exit(main())
