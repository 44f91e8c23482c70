"""Plain decoding and S3D at each precision of the same model, in one run: speed, peak memory, M-SR,
and how often each precision's greedy tokens agree with float32's.

    python tools/bench_precisions.py                                     # bundled SmolLM2: float32, bfloat16, int8, int4
    python tools/bench_precisions.py --dtypes float32,int8 --suite humaneval --limit 5
    python tools/bench_precisions.py --llama-cpp                         # and llama.cpp at each precision
    python tools/bench_precisions.py --dtypes float32,int4,int4@int8 --llama-cpp   # int4 with int8 activations too

With --llama-cpp (the optional extra llama-cpp-python), llama.cpp decodes the same prompts greedily
from the model's GGUF at the same precision: the shipped file for int4, and for the others a
copy of it made with the `gguf` package (Q8_0 for int8, BF16, F32), cached beside the converted models.
A precision `DTYPE@int8` is DTYPE's weights with int8 activations (`s3d_jax.load(..., activations="int8")`),
beside the same llama.cpp run as DTYPE.

Every engine (precision x method) runs in a process of its own (`s3d_jax.bench.harness`), so its peak
memory is its own. Ratios: plain at each precision against float32 plain, S3D against plain of the
same precision. "agrees with float32" is the share of token positions where a precision's plain
greedy output equals float32's, up to the first difference in each reply (after it the replies
continue from different text). Writes precisions.md, precisions.json and precisions.png to --out.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from s3d_jax import bundled
from s3d_jax.bench import harness, llama_cpp_peer
from s3d_jax.bench.__main__ import method_request
from s3d_jax.bench.suites import SUITES, BenchError, load_suite
from s3d_jax.config import ACTIVATION_MODES, DTYPES
from s3d_jax.metrics import memory_normalised_speedup, tokens_per_iteration
from s3d_jax.options import DecodeOptions, add_model_arguments, load_arguments
from s3d_jax.paths import cache_root


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="tools/bench_precisions.py", description=__doc__.splitlines()[0])
    add_model_arguments(p)
    p.add_argument("--dtypes", default="float32,bfloat16,int8,int4",
                   help=f"precisions among {', '.join(DTYPES)}, each optionally @int8 (int8 activations); float32 first")
    p.add_argument("--llama-cpp", action="store_true", help="also llama.cpp at each precision (needs llama-cpp-python)")
    p.add_argument("--suite", default="mt_bench", choices=SUITES)
    p.add_argument("--limit", type=int, default=5, help="prompts of the suite")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--out", default="results/precisions")
    args = p.parse_args(argv)
    args.dtype_list = [d for d in args.dtypes.split(",") if d]
    unknown = [d for d in args.dtype_list if weights(d) not in DTYPES or activations(d) not in ACTIVATION_MODES]
    if unknown or not args.dtype_list or args.dtype_list[0] != "float32":
        p.error(f"--dtypes must start with float32 (the reference) and name only {', '.join(DTYPES)}; got {args.dtypes!r}")
    if args.limit < 1:
        p.error(f"--limit must be at least 1, got {args.limit}")
    if args.llama_cpp and args.model and not bundled.is_name(args.model):
        p.error("--llama-cpp runs a named model's GGUF (--model smollm2-135m or qwen2.5-coder-0.5b), not a model directory's")
    if args.llama_cpp and {weights(d) for d in args.dtype_list} - set(GGUF_TYPES):
        p.error(f"--llama-cpp has no GGUF for {', '.join(sorted({weights(d) for d in args.dtype_list} - set(GGUF_TYPES)))}")
    return args


def weights(precision: str) -> str:
    """The weights' dtype of a precision (`int4@int8`: int4)."""
    return precision.partition("@")[0]


def activations(precision: str) -> str:
    """The activations of a precision (`int4@int8`: int8; `int4`: float32)."""
    return precision.partition("@")[2] or "float32"


# llama.cpp's block type at each precision: int4 is the model's own GGUF (the bundled SmolLM2's is
# Q4_1, Qwen2.5-Coder's Q4_K_M); the others are copies of it.
GGUF_TYPES = {"float32": "F32", "bfloat16": "BF16", "int8": "Q8_0", "int4": "shipped"}


def gguf_for(dtype: str, model: str | None) -> str:
    shipped = bundled.gguf_path(model)
    if GGUF_TYPES[dtype] == "shipped":
        return str(shipped)
    return llama_cpp_peer.requantized_gguf(shipped, cache_root() / f"{bundled.named(model).title}.{GGUF_TYPES[dtype]}.gguf",
                                           GGUF_TYPES[dtype])


def speed(result: dict) -> float:
    return statistics.median(len(r["tokens"]) / r["seconds"] for r in result["records"] if r["seconds"] > 0)


def agreement(result: dict, reference: dict) -> float:
    """The share of float32's tokens that `result` reproduces before its first difference, per reply."""
    want = {(r["id"], r["turn"]): r["tokens"] for r in reference["records"]}
    same = total = 0
    for r in result["records"]:
        ref = want[(r["id"], r["turn"])]
        prefix = next((i for i, (a, b) in enumerate(zip(r["tokens"], ref)) if a != b), min(len(r["tokens"]), len(ref)))
        same, total = same + prefix, total + len(ref)
    return same / max(total, 1)


def summarize(results: dict[str, dict[str, dict]]) -> list[dict]:
    base = results["float32"]["ar"]
    rows = []
    for dtype, engines in results.items():
        plain, s3d = engines["ar"], engines["s3d"]
        histogram = [sum(col) for col in zip(*(r["histogram"] for r in s3d["records"]))]
        differs = sum(a["tokens"] != b["tokens"] for a, b in zip(s3d["records"], plain["records"], strict=True))
        rows.append({
            "dtype": dtype, "plain_tokens_per_s": speed(plain), "plain_vs_float32": speed(plain) / speed(base),
            "s3d_vs_plain": speed(s3d) / speed(plain), "E": tokens_per_iteration(histogram),
            "plain_peak_mib": plain["peak_memory_mib"], "s3d_peak_mib": s3d["peak_memory_mib"],
            "plain_rss_vs_float32": plain["peak_memory_mib"] / base["peak_memory_mib"],
            "s3d_msr": memory_normalised_speedup(speed(s3d), speed(plain), s3d["peak_memory_mib"], plain["peak_memory_mib"]),
            "s3d_differs_from_plain": differs, "replies": len(plain["records"]), "agrees_with_float32": agreement(plain, base),
            "s3d_drafted": any(r.get("method", "s3d") != "ar" for r in s3d["records"]),  # False: the policy chose plain steps
        })
        if "llama_cpp" in engines:
            peer = engines["llama_cpp"]
            rows[-1].update(llama_cpp_tokens_per_s=speed(peer), llama_cpp_peak_mib=peer["peak_memory_mib"],
                            plain_vs_llama_cpp=speed(plain) / speed(peer), llama_cpp_version=peer["llama_cpp"])
    return rows


def render(rows: list[dict]) -> str:
    lines = ["| precision | plain tokens/s | plain vs float32 plain | S3D vs plain | E | peak MiB, plain / S3D | "
             "plain peak vs float32's | S3D M-SR | S3D ≠ plain | agrees with float32 |", "|" + " --- |" * 10]
    for r in rows:
        policy_e = f"{r['E']:.2f}" if r["s3d_drafted"] else "— (policy: plain steps)"
        lines.append(f"| {r['dtype']} | {r['plain_tokens_per_s']:.1f} | {r['plain_vs_float32']:.2f}x | {r['s3d_vs_plain']:.2f}x | "
                     f"{policy_e} | {r['plain_peak_mib']:.0f} / {r['s3d_peak_mib']:.0f} | {r['plain_rss_vs_float32']:.2f}x | "
                     f"{r['s3d_msr']:.2f} | {r['s3d_differs_from_plain']} of {r['replies']} | {r['agrees_with_float32']:.1%} |")
    peers = [r for r in rows if "llama_cpp_tokens_per_s" in r]
    if peers:
        lines += ["", f"llama.cpp {peers[0]['llama_cpp_version']}, greedy, the same prompts, the GGUF at each precision:", "",
                  "| precision (GGUF) | llama.cpp tokens/s | llama.cpp peak MiB | our plain vs llama.cpp | our plain peak vs llama.cpp's |",
                  "|" + " --- |" * 5]
        for r in peers:
            lines.append(f"| {r['dtype']} ({GGUF_TYPES[weights(r['dtype'])]}) | {r['llama_cpp_tokens_per_s']:.1f} | "
                         f"{r['llama_cpp_peak_mib']:.0f} | "
                         f"{r['plain_vs_llama_cpp']:.2f}x | {r['plain_peak_mib'] / r['llama_cpp_peak_mib']:.2f}x |")
    return "\n".join(lines)


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [r["dtype"] for r in rows]
    fig, (speed_ax, memory_ax) = plt.subplots(1, 2, figsize=(9, 3.5))
    width = 0.38
    xs = range(len(rows))
    speed_ax.bar([x - width / 2 for x in xs], [r["plain_tokens_per_s"] for r in rows], width, label="plain")
    speed_ax.bar([x + width / 2 for x in xs], [r["plain_tokens_per_s"] * r["s3d_vs_plain"] for r in rows], width, label="S3D")
    speed_ax.set(xticks=list(xs), xticklabels=names, ylabel="tokens/s (median reply)", title="speed")
    speed_ax.legend()
    memory_ax.bar([x - width / 2 for x in xs], [r["plain_peak_mib"] for r in rows], width, label="plain")
    memory_ax.bar([x + width / 2 for x in xs], [r["s3d_peak_mib"] for r in rows], width, label="S3D")
    memory_ax.set(xticks=list(xs), xticklabels=names, ylabel="peak MiB", title="peak memory")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.llama_cpp:
        try:
            llama_cpp_peer.require()
        except BenchError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
    prompts = {args.suite: load_suite(args.suite, args.limit)}
    decode = DecodeOptions(max_new_tokens=args.max_new_tokens)
    results: dict[str, dict[str, dict]] = {}
    for dtype in args.dtype_list:
        load = {**load_arguments(args), "dtype": weights(dtype), "activations": activations(dtype)}
        for method in ("ar", "s3d"):
            print(f"running {method} in {dtype} on {args.limit} {args.suite} prompts ...", file=sys.stderr, flush=True)
            request = method_request(method, load, prompts, decode)
            results.setdefault(dtype, {})[method] = harness.run_engine(["-m", "s3d_jax.bench.methods"], request)
        ran = next((engines["llama_cpp"] for d, engines in results.items()
                    if weights(d) == weights(dtype) and "llama_cpp" in engines), None)
        if args.llama_cpp and ran is not None:  # the same GGUF as another precision's: its run serves both rows
            results[dtype]["llama_cpp"] = ran
        elif args.llama_cpp:
            print(f"running llama.cpp on the {GGUF_TYPES[weights(dtype)]} GGUF ...", file=sys.stderr, flush=True)
            request = {"gguf": gguf_for(weights(dtype), args.model),
                       "tokenizer": str(bundled.ensure_converted(model=bundled.named(args.model))),
                       "prompts": prompts,
                       "max_new_tokens": args.max_new_tokens, "lookup": False, "stop_at_eos": True}
            results[dtype]["llama_cpp"] = llama_cpp_peer.run(request)
    rows = summarize(results)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    table = render(rows)
    command = "python tools/bench_precisions.py " + " ".join(sys.argv[1:] if argv is None else argv)
    (out / "precisions.md").write_text(f"{results['float32']['ar']['device']}; `{command}`\n\n{table}\n")
    (out / "precisions.json").write_text(json.dumps({"args": vars(args), "rows": rows, "results": results}, indent=1))
    plot(rows, out / "precisions.png")
    print(table)
    print(f"\nwrote {out}/precisions.md, precisions.json, precisions.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
