"""The speedup model of docs/design.md ("Predicting the speedup"): fit it, and pick the best (l, h, γ).

    python -m s3d_jax.predict --drafters runs/skip_a/model runs/skip_b/model runs/skip_c/model
    python -m s3d_jax.predict --drafters ... --sweep          # also measure every setting, and plot both
    python -m s3d_jax.predict --acceptance measured.json --assume-constant --model PATH

Model:
  α_1(r) = 1 - c (1 - r)^κ            first-draft acceptance, → 1 as the draft uses the whole model (r → 1)
  α_j   = α_1 · δ_j                    δ_1 = 1; deeper drafts are discounted (fitted per depth)
  E     = 1 + Σ_{i≤γ} Π_{j≤i} α_j
  speedup = E · t(1) / (r · t(γ) + t(γ+1) + ε · t(1))
where t(T) is the measured time of a full pass over T tokens; with --assume-constant t(T) = C
(a memory-bound device), which gives docs/design.md's E / (1 + r + ε).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
from matplotlib.figure import Figure

from s3d_jax import api
from s3d_jax import drafter as drafter_lib
from s3d_jax.bench.methods import decode_prompts
from s3d_jax.bench.suites import load_suite
from s3d_jax.bench.timing import verify_ms
from s3d_jax.metrics import acceptance_per_depth, expected_tokens, tokens_per_iteration
from s3d_jax.options import DecodeOptions


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


def measure(model, questions: int, options: DecodeOptions):
    """Decodes the first turn of `questions` MT-Bench questions: (tokens/s, pooled accept histogram)."""
    first_turns = [{**q, "turns": q["turns"][:1]} for q in load_suite("mt_bench", questions)]
    decoded = decode_prompts(model, {"mt_bench": first_turns}, options)
    return decoded.tokens_per_second, decoded.histogram


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
    p.add_argument("--sweep", action="store_true", help="also measure the speedup of every drafter and gamma")
    p.add_argument("--out", default="results/predict")
    args = p.parse_args(argv)

    if not args.drafters and not args.acceptance:
        p.error("give --drafters to measure, or --acceptance with measured values")
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
            plain, _ = measure(drafter, args.questions, greedy.replace(method="ar"))
            r = draft_ratio(config, skip)
            for gamma in gammas:
                options = greedy.replace(gamma=gamma)
                speed, hist = at_max_gamma[skip] if gamma == args.max_gamma else measure(drafter, args.questions, options)
                measured.append({"skip": list(skip), "gamma": gamma, "r": r, "measured_speedup": speed / plain,
                                 "tokens_per_iteration": tokens_per_iteration(hist), "predicted_speedup": predicted(skip, gamma)})
        report["measured"] = measured
        report["best_measured"] = max(measured, key=lambda q: q["measured_speedup"])
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "predict.json").write_text(json.dumps(report, indent=1))
    plot(report, out / "predict.png")
    print(f"fit: alpha_1(r) = 1 - {c:.3f} (1 - r)^{kappa:.2f}; depth discount {np.round(delta, 3).tolist()}")
    print(f"best predicted: skip {best['skip']}, gamma {best['gamma']} -> {best['predicted_speedup']:.2f}x")
    if args.sweep:
        b = report["best_measured"]
        print(f"best measured:  skip {b['skip']}, gamma {b['gamma']} -> {b['measured_speedup']:.2f}x")
    print(f"wrote {out}/predict.json and predict.png")
    return 0


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
