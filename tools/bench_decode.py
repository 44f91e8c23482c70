"""Decoding speed and memory of SmolLM2 (or any converted model), every figure a ratio against plain
greedy decoding measured in the same run.

    python tools/bench_decode.py                      # bundled SmolLM2, CPU or GPU, float32
    python tools/bench_decode.py --max-new-tokens 64 --prompts 4 --skip-hf

It measures, each engine in its own process so that peak memory is its own:
  - s3d_jax plain greedy against transformers' PyTorch greedy `generate` on the same chat prompts
    and the same weights (exported with `tools/convert_hf.py --to-hf`);
  - the cost of one pass: a plain step, an S3D draft pass for several γ, a verify pass of γ+1 tokens;
  - tokens/s of each method (ar, selfspec, s3d) with tokens per iteration and acceptance per depth.
Results go to results/bench_decode.{json,md,png}.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from s3d_jax.bench import export_for_transformers, load_transformers, peak_rss_mib

PROMPTS = [
    "What is the capital of France?",
    "Write a Python function that checks whether a string is a palindrome.",
    "Explain the difference between a list and a tuple in Python.",
    "Give me three tips for sleeping better.",
    "Summarise the plot of Romeo and Juliet in a few sentences.",
    "What causes the seasons on Earth?",
    "Write a short poem about the sea.",
    "How do I make a cup of green tea?",
]


def run_jax(args) -> dict:
    import jax
    import numpy as np
    from tqdm import tqdm

    import s3d_jax
    from s3d_jax import api
    from s3d_jax.bench import draft_ms, verify_ms

    model = s3d_jax.load(args.model, dtype=args.dtype)
    cfg = model.config
    skip = tuple(args.skip) if args.skip else api.default_skip(cfg.num_layers)
    prompts = PROMPTS[: args.prompts]
    result = {"device": str(jax.devices()[0]), "model": cfg.architecture, "layers": cfg.num_layers, "skip": skip, "dtype": cfg.dtype}

    timing = dict(context=args.context, repeats=args.repeats)
    passes = {"plain step (1 token)": verify_ms(model, 1, **timing)}
    for g in tqdm(args.gammas, desc="pass timings", disable=args.quiet):
        passes[f"s3d draft, gamma={g}"] = draft_ms(model, skip, g, **timing)
        passes[f"verify, {g + 1} tokens"] = verify_ms(model, g + 1, **timing)
    result["pass_ms"] = passes

    methods = {"ar": dict(method="ar"), "selfspec": dict(method="selfspec", gamma=args.gamma, skip=skip), "s3d": dict(method="s3d", gamma=args.gamma, skip=skip)}
    rows = {}
    for name, opts in tqdm(methods.items(), desc="methods", disable=args.quiet):
        common = dict(chat=True, max_new_tokens=args.max_new_tokens, eos_token_ids=(), **opts)
        s3d_jax.decode(model, prompts[0], **common)  # warm-up
        tokens, seconds, hist = 0, 0.0, 0
        for prompt in prompts:
            out = s3d_jax.decode(model, prompt, **common)
            tokens += len(out.tokens)
            seconds += out.stats.decode_seconds
            hist = hist + np.sum(out.stats.accept_histogram, axis=0)
        rows[name] = {
            "tokens": tokens,
            "seconds": seconds,
            "tokens_per_s": tokens / seconds,
            "tokens_per_iteration": api.tokens_per_iteration(hist),
            "acceptance_per_depth": api.acceptance_per_depth(hist),
        }
    result["methods"] = rows
    result["peak_rss_mib"] = peak_rss_mib()
    return result


def run_hf(args) -> dict:
    import torch

    model, tokenizer = load_transformers(args.hf_model)
    prompts = PROMPTS[: args.prompts]

    def generate(prompt):
        ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True, return_tensors="pt", return_dict=True)["input_ids"]
        with torch.inference_mode():
            out = model.generate(ids, max_new_tokens=args.max_new_tokens, min_new_tokens=args.max_new_tokens, do_sample=False)
        return out.shape[1] - ids.shape[1]

    generate(prompts[0])  # warm-up
    tokens, start = 0, time.perf_counter()
    for prompt in prompts:
        tokens += generate(prompt)
    seconds = time.perf_counter() - start
    return {"tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds, "peak_rss_mib": peak_rss_mib(), "torch": torch.__version__}


def render(jax_result: dict, hf_result: dict | None, args) -> str:
    methods = jax_result["methods"]
    base = methods["ar"]["tokens_per_s"]
    lines = [
        f"Device: {jax_result['device']}; {jax_result['dtype']}; {args.prompts} chat prompts x {args.max_new_tokens} new tokens, batch 1; "
        f"skip {list(jax_result['skip'])}, gamma {args.gamma}.",
        "",
        "| engine / method | tokens/s | speed vs s3d_jax plain | tokens/iteration | acceptance per depth | peak RSS (MiB) |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for name, row in methods.items():
        depth = " ".join(f"{a:.2f}" for a in row["acceptance_per_depth"]) or "-"
        lines.append(f"| s3d_jax {name} | {row['tokens_per_s']:.1f} | {row['tokens_per_s'] / base:.2f}x | {row['tokens_per_iteration']:.2f} | {depth} | {jax_result['peak_rss_mib']:.0f} |")
    if hf_result:
        lines.append(f"| transformers {hf_result['torch']} generate (greedy) | {hf_result['tokens_per_s']:.1f} | {hf_result['tokens_per_s'] / base:.2f}x | 1.00 | - | {hf_result['peak_rss_mib']:.0f} |")
        lines.append("")
        lines.append(f"s3d_jax plain greedy / transformers greedy: **{base / hf_result['tokens_per_s']:.2f}x** tokens/s, "
                     f"{jax_result['peak_rss_mib'] / hf_result['peak_rss_mib']:.2f}x peak memory.")
    lines += ["", f"Pass cost at a context of {args.context} tokens (ms per pass, {args.repeats} passes in one jitted loop):", "", "| pass | ms | vs plain step |", "| --- | --- | --- |"]
    step = jax_result["pass_ms"]["plain step (1 token)"]
    for name, ms in jax_result["pass_ms"].items():
        lines.append(f"| {name} | {ms:.2f} | {ms / step:.2f} |")
    return "\n".join(lines)


def plot(jax_result: dict, hf_result: dict | None, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    names = [f"s3d_jax {m}" for m in jax_result["methods"]]
    speeds = [r["tokens_per_s"] for r in jax_result["methods"].values()]
    if hf_result:
        names.append("transformers")
        speeds.append(hf_result["tokens_per_s"])
    left.bar(names, speeds, color=["#4c72b0", "#dd8452", "#55a868", "#8172b3"][: len(names)])
    left.set_ylabel("tokens/s")
    left.set_title("Decoding speed (batch 1)")
    left.tick_params(axis="x", rotation=20)
    passes = jax_result["pass_ms"]
    gammas = [int(k.split("=")[1]) for k in passes if k.startswith("s3d draft")]
    right.plot(gammas, [passes[f"s3d draft, gamma={g}"] for g in gammas], "o-", label="S3D draft pass")
    right.plot(gammas, [passes[f"verify, {g + 1} tokens"] for g in gammas], "s-", label="verify pass (gamma+1 tokens)")
    right.axhline(passes["plain step (1 token)"], color="gray", ls="--", label="plain step")
    right.set_xlabel("gamma")
    right.set_ylabel("ms")
    right.set_title("Cost of one pass")
    right.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="converted model (default: bundled SmolLM2)")
    p.add_argument("--dtype", default=None, choices=("float32", "bfloat16", "float16"))
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--gamma", type=int, default=4)
    p.add_argument("--gammas", type=int, nargs="+", default=[2, 3, 4, 5])
    p.add_argument("--skip", type=int, nargs=2, default=None)
    p.add_argument("--context", type=int, default=256)
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--skip-hf", action="store_true", help="do not run the transformers baseline")
    p.add_argument("--out", default="results")
    p.add_argument("--quiet", action="store_true")
    p.add_argument("--engine", choices=("jax", "hf"), help=argparse.SUPPRESS)
    p.add_argument("--hf-model", help=argparse.SUPPRESS)
    p.add_argument("--json", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.engine:  # a child process: one engine, results as JSON
        result = run_jax(args) if args.engine == "jax" else run_hf(args)
        Path(args.json).write_text(json.dumps(result))
        return 0
    from s3d_jax import bundled

    results = {}
    argv_child = list(argv if argv is not None else sys.argv[1:])
    with tempfile.TemporaryDirectory() as scratch:
        if not args.skip_hf:  # transformers runs the very weights under test
            argv_child += ["--hf-model", export_for_transformers(args.model or str(bundled.ensure_converted()), f"{scratch}/hf")]
        for engine in ("jax",) + (() if args.skip_hf else ("hf",)):
            with tempfile.NamedTemporaryFile(suffix=".json") as f:
                subprocess.run([sys.executable, __file__, *argv_child, "--engine", engine, "--json", f.name], check=True)
                results[engine] = json.loads(Path(f.name).read_text())
    table = render(results["jax"], results.get("hf"), args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_decode.json").write_text(json.dumps(results, indent=2))
    (out / "bench_decode.md").write_text(table + "\n")
    plot(results["jax"], results.get("hf"), out / "bench_decode.png")
    print(table)
    print(f"\nwrote {out}/bench_decode.{{json,md,png}}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
