"""The predictor's two analyses of a trained drafter: token trees of each size, and the drafting gate
(`min_certainty`) replayed along the model's own replies; each predicted, and measured with --sweep."""

from __future__ import annotations

import sys

from s3d_jax import planning
from s3d_jax.calibration import draft_ms, tree_verify_ms, verify_ms
from s3d_jax.metrics import tokens_per_iteration
from s3d_jax.options import DecodeOptions
from s3d_jax.predict.replies import draft_ranks, greedy_replies, iteration_outcomes, measure
from s3d_jax.speedup import draft_ratio, replay, tree_analysis


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


def predict_gates(model, args, plain_speed: float | None) -> dict:
    """Each `min_certainty` of `args.gates` (and the oracle): predicted speedup and the share of each
    kind of iteration, with the gate fixed and as a calibrated policy runs it (learning on each side of
    the gate where drafts pay); with `plain_speed` (the --sweep), also the measured speedup of decoding
    with the fixed gate."""
    config = model.config
    plan = planning.plan_for(config, DecodeOptions(min_certainty=0.0))
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
        if gate is not None:
            learned = replay(outcomes, gate, costs, learns=True)
            row["learning_speedup"] = learned["tokens"] / learned["cost"]
        if plain_speed and gate is not None:
            print(f"decoding with min_certainty {gate} ...", file=sys.stderr)
            speed, _ = measure(model, args.questions, DecodeOptions(chat=True, max_new_tokens=args.max_new_tokens, min_certainty=gate))
            row["measured_speedup"] = speed / plain_speed
        rows.append(row)
    return {"skip": list(plan.skip), "gamma": plan.gamma, "tree": plan.tree, "costs": costs,
            "positions": int(sum(len(o["certainty"]) for o in outcomes)), "rows": rows}
