"""Decoding speed and memory of SmolLM2 (or any converted model), every figure a ratio against plain
greedy decoding measured in the same run.

    python tools/bench_decode.py                      # bundled SmolLM2, CPU or GPU, float32
    python tools/bench_decode.py --max-new-tokens 64 --prompts 4 --skip-hf

It measures, each engine in its own process so that peak memory is its own (s3d_jax's is this script
again; transformers' is the bench's peer process, which never loads JAX):
  - s3d_jax plain greedy against transformers' PyTorch greedy `generate` on the same chat prompts
    and the same weights (exported with `tools/convert_hf.py --to-hf`);
  - the cost of one pass: a plain step, an S3D draft pass for several γ, a verify pass of γ+1 tokens,
    each against a plain step and against its memory floor (the bytes it must read / the streaming
    bandwidth that a probe over a buffer the size of the weights measures in the same run);
  - tokens/s of each method (ar, selfspec, s3d) with tokens per iteration and acceptance per depth;
  - with --llama-cpp, llama.cpp on the model's GGUF as shipped (the bundled one is Q4_1), greedy and
    with its prompt-lookup speculative decoding (needs the optional extra llama-cpp-python).
Results go to results/bench_decode.{json,md,png}.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import jax
from matplotlib.figure import Figure
from tqdm import tqdm

from s3d_jax import api, bundled
from s3d_jax.bench import harness, llama_cpp_peer, timing
from s3d_jax.bench.methods import decode_prompts
from s3d_jax.metrics import acceptance_per_depth, tokens_per_iteration
from s3d_jax.options import DEFAULT_GAMMA, DecodeOptions, add_arguments, default_skip

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


def chat_prompts(count: int) -> dict[str, list[dict]]:
    """The first `count` prompts, one chat turn each, as the bench's engines take them."""
    return {"chat": [{"id": f"chat/{i}", "turns": [prompt]} for i, prompt in enumerate(PROMPTS[:count])]}


def run_jax(request: dict) -> dict:
    """The s3d_jax engine, in a process of its own: the pass costs, then each method on the prompts.
    `request` holds this command's arguments."""
    args = argparse.Namespace(**request)
    model = api.load(args.model, dtype=args.dtype)
    cfg = model.config
    skip = tuple(args.skip) if args.skip else default_skip(cfg.num_layers)
    result = {"device": str(jax.devices()[0]), "model": cfg.architecture, "layers": cfg.num_layers, "skip": skip, "dtype": cfg.dtype}

    weight_bytes = sum(x.nbytes for x in jax.tree.leaves(model.params))
    result["bandwidth_gb_s"] = timing.bandwidth_gb_s(weight_bytes)
    passes = {"plain step (1 token)": timing.verify_ms(model, 1, context=args.context, repeats=args.repeats)}
    full_bytes = timing.pass_bytes(model.params, cfg, cfg.all_layers, args.context)
    floor_bytes = {"plain step (1 token)": full_bytes}
    for g in tqdm(args.gammas, desc="pass timings", disable=args.quiet):
        passes[f"s3d draft, gamma={g}"] = timing.draft_ms(model, skip, g, context=args.context, repeats=args.repeats)
        passes[f"verify, {g + 1} tokens"] = timing.verify_ms(model, g + 1, context=args.context, repeats=args.repeats)
        floor_bytes[f"s3d draft, gamma={g}"] = timing.pass_bytes(model.params, cfg, cfg.draft_layers(skip), args.context)
        floor_bytes[f"verify, {g + 1} tokens"] = full_bytes
    result["pass_ms"] = passes
    result["pass_floor_ms"] = {name: b / result["bandwidth_gb_s"] / 1e6 for name, b in floor_bytes.items()}

    # No EOS: every prompt runs to max_new_tokens, as transformers does below with min_new_tokens.
    decode = DecodeOptions.from_args(args, chat=True, eos_token_ids=(), skip=skip)
    rows = {}
    for method in tqdm(("ar", "selfspec", "s3d"), desc="methods", disable=args.quiet):
        decoded = decode_prompts(model, chat_prompts(args.prompts), decode.replace(method=method))
        rows[method] = {
            "tokens": decoded.tokens,
            "seconds": decoded.seconds,
            "tokens_per_s": decoded.tokens_per_second,
            "tokens_per_iteration": tokens_per_iteration(decoded.histogram),
            "acceptance_per_depth": acceptance_per_depth(decoded.histogram),
        }
    result["methods"] = rows
    result["peak_rss_mib"] = harness.peak_rss_mib()
    return result


def run_hf(args, hf_model: str) -> dict:
    """transformers' greedy `generate` on the same prompts, in the bench's peer process."""
    generate = {"max_new_tokens": args.max_new_tokens, "min_new_tokens": args.max_new_tokens}  # no EOS, as run_jax
    request = {"hf_model": hf_model, "prompts": chat_prompts(args.prompts), "generate": generate}
    result = harness.run_engine(["-m", "s3d_jax.bench.peers"], request)
    tokens, seconds = sum(len(r["tokens"]) for r in result["records"]), sum(r["seconds"] for r in result["records"])
    return {"tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds,
            "peak_rss_mib": result["peak_memory_mib"], "torch": result["torch"]}


def run_llama_cpp(args, lookup: bool) -> dict:
    """llama.cpp on the GGUF, the same prompts and token counts, in its own process."""
    request = {"gguf": args.gguf or str(bundled.gguf_path()), "tokenizer": args.model, "prompts": chat_prompts(args.prompts),
               "max_new_tokens": args.max_new_tokens, "lookup": lookup, "stop_at_eos": False}
    result = harness.run_engine(["-m", "s3d_jax.bench.llama_cpp_peer"], request)
    tokens, seconds = sum(len(r["tokens"]) for r in result["records"]), sum(r["seconds"] for r in result["records"])
    return {"tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds, "peak_rss_mib": result["peak_memory_mib"],
            "version": result["llama_cpp"]}


def render(jax_result: dict, hf_result: dict | None, args, llama_cpp: dict | None = None) -> str:
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
        lines.append(f"| s3d_jax {name} | {row['tokens_per_s']:.1f} | {row['tokens_per_s'] / base:.2f}x | "
                     f"{row['tokens_per_iteration']:.2f} | {depth} | {jax_result['peak_rss_mib']:.0f} |")
    for name, row in (llama_cpp or {}).items():
        lines.append(f"| llama.cpp {row['version']} {name} (GGUF as shipped) | {row['tokens_per_s']:.1f} | "
                     f"{row['tokens_per_s'] / base:.2f}x | - | - | {row['peak_rss_mib']:.0f} |")
    if hf_result:
        lines.append(f"| transformers {hf_result['torch']} generate (greedy) | {hf_result['tokens_per_s']:.1f} | "
                     f"{hf_result['tokens_per_s'] / base:.2f}x | 1.00 | - | {hf_result['peak_rss_mib']:.0f} |")
        lines.append("")
        lines.append(f"s3d_jax plain greedy / transformers greedy: **{base / hf_result['tokens_per_s']:.2f}x** tokens/s, "
                     f"{jax_result['peak_rss_mib'] / hf_result['peak_rss_mib']:.2f}x peak memory.")
    lines += ["", f"Pass cost at a context of {args.context} tokens (ms per pass, {args.repeats} passes in one jitted loop). "
              f"The floor is the bytes a pass must read (weights, head, cached keys and values) over the streaming bandwidth, "
              f"{jax_result['bandwidth_gb_s']:.1f} GB/s by a probe in the same run:", "",
              "| pass | ms | vs plain step | floor ms | vs floor |", "| --- | --- | --- | --- | --- |"]
    step = jax_result["pass_ms"]["plain step (1 token)"]
    for name, ms in jax_result["pass_ms"].items():
        floor = jax_result["pass_floor_ms"][name]
        lines.append(f"| {name} | {ms:.2f} | {ms / step:.2f} | {floor:.2f} | {ms / floor:.2f} |")
    return "\n".join(lines)


def plot(jax_result: dict, hf_result: dict | None, path: Path) -> None:
    fig = Figure(figsize=(11, 4))
    left, right = fig.subplots(1, 2)
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
    add_arguments(p, methods=False)
    p.set_defaults(gamma=DEFAULT_GAMMA)
    p.add_argument("--gammas", type=int, nargs="+", default=[2, 3, 4, 5], help="draft sizes whose pass costs to time")
    p.add_argument("--context", type=int, default=256)
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--skip-hf", action="store_true", help="do not run the transformers baseline")
    p.add_argument("--llama-cpp", action="store_true", help="also run llama.cpp on the GGUF (needs llama-cpp-python)")
    p.add_argument("--gguf", default=None, help="GGUF for llama.cpp (default: the bundled SmolLM2's)")
    p.add_argument("--out", default="results")
    p.add_argument("--quiet", action="store_true")
    p.add_argument("--engine", nargs=2, metavar=("REQUEST", "RESULT"), help=argparse.SUPPRESS)  # the s3d_jax engine's process
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.engine:
        return harness.serve(run_jax, *args.engine)
    if args.llama_cpp:
        try:
            llama_cpp_peer.require()
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
    args.model = args.model or str(bundled.ensure_converted())
    results = {"jax": harness.run_engine([__file__, "--engine"], vars(args))}
    if args.llama_cpp:
        results["llama_cpp"] = {"greedy": run_llama_cpp(args, lookup=False), "prompt lookup": run_llama_cpp(args, lookup=True)}
    if not args.skip_hf:
        with tempfile.TemporaryDirectory() as scratch:  # transformers runs the very weights under test
            results["hf"] = run_hf(args, harness.export_for_transformers(args.model, f"{scratch}/hf"))
    table = render(results["jax"], results.get("hf"), args, results.get("llama_cpp"))
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
