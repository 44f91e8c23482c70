"""Command line: fit the speedup model of docs/design.md ("The speedup model"), and pick the best (l, h, γ).

    python -m s3d_jax.predict --drafters runs/skip_a/model runs/skip_b/model runs/skip_c/model
    python -m s3d_jax.predict --drafters ... --sweep          # also measure every setting, and plot both
    python -m s3d_jax.predict --acceptance measured.json --assume-constant --model PATH
    python -m s3d_jax.predict --drafters s3d_jax/drafters/SmolLM2-135M-Instruct.safetensors --trees 8 16 32 64 [--sweep]
    python -m s3d_jax.predict --drafters s3d_jax/drafters/SmolLM2-135M-Instruct.safetensors --gates 0 0.5 0.9 1 [--sweep]
    python -m s3d_jax.predict --drafters s3d_jax/drafters/SmolLM2-135M-Instruct.safetensors --profile 16
    python -m s3d_jax.predict --shape llama3_1b --dtype bfloat16     # pass costs of a named shape here, before any weights

The model and its fit live in `s3d_jax.speedup`; the measurements in `replies.py`, the tree and
gate analyses in `analyses.py`, the drafter's acceptance profile in `profile.py`, the costs of named
shapes in `shapes.py`, tables and plots in `report.py`.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

from s3d_jax import api
from s3d_jax import drafter as drafter_lib
from s3d_jax.calibration import verify_ms
from s3d_jax.config import DTYPES
from s3d_jax.metrics import acceptance_per_depth, tokens_per_iteration
from s3d_jax.options import DecodeOptions
from s3d_jax.predict import profile
from s3d_jax.predict.analyses import predict_gates, predict_trees
from s3d_jax.predict.replies import measure
from s3d_jax.predict.report import gate_table, plot, plot_trees, tree_table
from s3d_jax.predict.shapes import shape_costs
from s3d_jax.shapes import SHAPES
from s3d_jax.speedup import draft_ratio, fit_depth_discount, fit_first_acceptance, interpolated, predict_speedup, symmetric_skips


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
    p.add_argument("--profile", type=int, default=0, metavar="N",
                   help="measure the drafter file's acceptance profile on N held-out prompts and write it into the file")
    p.add_argument("--shape", choices=sorted(SHAPES), help="print the pass costs here of random weights of this named shape, "
                   "and the speedup predicted at the shipped drafter's acceptance (or at that of the one file --drafters names)")
    p.add_argument("--dtype", default="float32", choices=sorted(DTYPES), help="with --shape: the weights' dtype")
    p.add_argument("--out", default="results/predict")
    args = p.parse_args(argv)

    if args.shape:
        if len(args.drafters) > 1:
            p.error("--shape takes at most one drafter file in --drafters")
        return shape_costs(args.shape, args.dtype, args.drafters[0] if args.drafters else None)
    if args.profile:
        if len(args.drafters) != 1 or not args.drafters[0].endswith(drafter_lib.SUFFIX):
            p.error("--profile writes into one drafter file: give it as --drafters FILE")
        profile.write(args.drafters[0], args.profile, args.max_new_tokens, args.model)
        return 0

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


if __name__ == "__main__":
    sys.exit(main())
