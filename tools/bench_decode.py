"""Decoding speed and memory of SmolLM2 (or any converted model), every figure a ratio against plain
greedy decoding measured in the same run.

    python tools/bench_decode.py                      # bundled SmolLM2, CPU or GPU, float32
    python tools/bench_decode.py --max-new-tokens 64 --prompts 4 --skip-hf

It measures, each engine in its own process so that peak memory is its own (s3d_jax's is this script
again; transformers' is the bench's peer process, which never loads JAX):
  - s3d_jax plain greedy against transformers' PyTorch greedy `generate` on the same chat prompts
    and the same weights (exported with `tools/convert_hf.py --to-hf`);
  - memory: each s3d_jax method alone in a fresh process (load, decode the prompts), its resident
    memory after JAX starts, after the model loads and after decoding, and its peak;
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

from s3d_jax import api, bundled, calibration
from s3d_jax.bench import harness, llama_cpp_peer, timing
from s3d_jax.bench.methods import decode_prompts, memory_now_mib, peak_memory_mib
from s3d_jax.metrics import acceptance_per_depth, tokens_per_iteration
from s3d_jax.options import DEFAULT_GAMMA, DecodeOptions, add_arguments, add_model_arguments, default_skip, load_arguments
from s3d_jax.speedup import draft_ratio

METHODS = ("ar", "selfspec", "s3d")
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
    """The s3d_jax engine, in a process of its own: with `memory_of` set, that one method's memory;
    else the pass costs, then each method on the prompts. `request` holds this command's arguments."""
    args = argparse.Namespace(**request)
    if args.memory_of:
        return method_memory(args)
    model = api.load(**load_arguments(args))
    cfg = model.config
    decode = greedy_options(args, cfg)
    skip = decode.skip
    result = {"device": str(jax.devices()[0]), "model": cfg.architecture, "layers": cfg.num_layers, "skip": skip, "dtype": cfg.dtype,
              "s3d_tree": cfg.draft_tree}  # the drafter's default, which the methods' S3D row uses

    result["bandwidth_gb_s"] = timing.bandwidth_gb_s(param_bytes(model.params))
    passes = {"plain step (1 token)": calibration.verify_ms(model, 1, context=args.context, repeats=args.repeats)}
    full_bytes = timing.pass_bytes(model.params, cfg, cfg.all_layers, args.context)
    floor_bytes = {"plain step (1 token)": full_bytes}
    for g in tqdm(args.gammas, desc="pass timings", disable=args.quiet):
        passes[f"s3d draft, gamma={g}"] = calibration.draft_ms(model, skip, g, context=args.context, repeats=args.repeats)
        passes[f"verify, {g + 1} tokens"] = calibration.verify_ms(model, g + 1, context=args.context, repeats=args.repeats)
        floor_bytes[f"s3d draft, gamma={g}"] = timing.pass_bytes(model.params, cfg, cfg.draft_layers(skip), args.context, draft=True)
        floor_bytes[f"verify, {g + 1} tokens"] = full_bytes
    result["pass_ms"] = passes
    result["pass_floor_ms"] = {name: b / result["bandwidth_gb_s"] / 1e6 for name, b in floor_bytes.items()}

    rows, outputs = {}, {}
    for method in tqdm(METHODS, desc="methods", disable=args.quiet):
        options = decode.replace(method=method, min_certainty=decode.min_certainty if method == "s3d" else None)
        decoded = decode_prompts(model, chat_prompts(args.prompts), options)
        outputs[method] = [r["tokens"] for r in decoded.records]
        rows[method] = {
            "tokens": decoded.tokens,
            "seconds": decoded.seconds,
            "tokens_per_s": decoded.tokens_per_second,
            "tokens_per_iteration": tokens_per_iteration(decoded.histogram),
            "acceptance_per_depth": acceptance_per_depth(decoded.histogram),
        }
    result["methods"] = rows
    result["tree_sweep"] = [row for n in tqdm(args.trees, desc="trees", disable=args.quiet)
                            for row in tree_points(model, args, n, skip, decode, passes["plain step (1 token)"], rows["ar"], outputs["ar"])]
    result["draft_vocab_sweep"] = [draft_vocab_point(args, n, skip, decode, passes["plain step (1 token)"], rows["ar"], outputs["ar"])
                                   for n in tqdm(args.draft_vocabs, desc="draft vocabularies", disable=args.quiet)]
    return result


def method_memory(args) -> dict:
    """One method alone in this fresh process: memory (the device's on a GPU, else resident) once
    JAX is up, after loading the model, after decoding the prompts (compiles included), and the peak.
    Its loops come from JAX's persistent cache (`api.load` turns it on), where the first process put them."""
    jax.devices()
    stages = {"JAX runtime": memory_now_mib()}
    model = api.load(**load_arguments(args))
    stages["model loaded"] = memory_now_mib()
    decode_prompts(model, chat_prompts(args.prompts), greedy_options(args, model.config).replace(method=args.memory_of))
    stages["after decoding"] = memory_now_mib()
    peak, kind = peak_memory_mib()
    return {"stages_mib": stages, "peak_mib": peak, "memory_kind": kind, "weights_mib": param_bytes(model.params) / 2**20}


def greedy_options(args, config) -> DecodeOptions:
    """The options every method decodes the prompts with: the command's skip range, else the
    drafter's, else the middle half; no EOS, so every prompt runs to max_new_tokens, as transformers
    does below with min_new_tokens; S3D's tree is the drafter's default (sizes to sweep: --trees)."""
    skip = tuple(args.skip) if args.skip else config.draft_skip or default_skip(config.num_layers)
    return DecodeOptions.from_args(args, chat=True, eos_token_ids=(), skip=skip, tree=None, lookup=None)


def param_bytes(params) -> int:
    return sum(x.nbytes for x in jax.tree.leaves(params))


def tree_points(model, args, size: int, skip, decode: DecodeOptions, step_ms: float, plain: dict, plain_outputs: list) -> list[dict]:
    """S3D with a tree of `size` nodes (0: the chain), without and with the context branch: its verify
    pass, its decoding, and the speedup predicted for a memory-bound device (every pass as long as a
    step): E / (1 + r + 0.05)."""
    lookups = (False, True) if size else (False,)
    return [tree_point(model, args, size, lookup, skip, decode, step_ms, plain, plain_outputs) for lookup in lookups]


def tree_point(model, args, size: int, lookup: bool, skip, decode: DecodeOptions, step_ms: float, plain: dict, plain_outputs: list) -> dict:
    timed = dict(context=args.context, repeats=args.repeats)
    verify = calibration.tree_verify_ms(model, size, args.gamma, **timed) if size else calibration.verify_ms(model, args.gamma + 1, **timed)
    decoded = decode_prompts(model, chat_prompts(args.prompts), decode.replace(method="s3d", tree=size, lookup=lookup,
                                                                                      min_certainty=decode.min_certainty if size else None))
    e = tokens_per_iteration(decoded.histogram)
    return {"tree": size, "lookup": lookup, "verify_ms": verify, "verify_vs_step": verify / step_ms, "tokens_per_iteration": e,
            "tokens_per_s": decoded.tokens_per_second, "vs_plain": decoded.tokens_per_second / plain["tokens_per_s"],
            "predicted_memory_bound": e / (1 + draft_ratio(model.config, skip) + 0.05),
            "same_as_plain": [r["tokens"] for r in decoded.records] == plain_outputs}


def draft_vocab_point(args, size: int, skip, decode: DecodeOptions, step_ms: float, plain: dict, plain_outputs: list) -> dict:
    """The drafter with a draft vocabulary of `size` tokens (0: all): its draft pass and its S3D decoding."""
    model = api.load(**{**load_arguments(args), "draft_vocab_size": size})
    ms = calibration.draft_ms(model, skip, args.gamma, context=args.context, repeats=args.repeats)
    decoded = decode_prompts(model, chat_prompts(args.prompts), decode.replace(method="s3d"))
    return {"draft_vocab": size, "draft_ms": ms, "draft_vs_step": ms / step_ms, "tokens_per_s": decoded.tokens_per_second,
            "vs_plain": decoded.tokens_per_second / plain["tokens_per_s"], "tokens_per_iteration": tokens_per_iteration(decoded.histogram),
            "acceptance_per_depth": acceptance_per_depth(decoded.histogram),
            "same_as_plain": [r["tokens"] for r in decoded.records] == plain_outputs}


def run_hf(args, hf_model: str) -> dict:
    """transformers' greedy `generate` on the same prompts, in the bench's peer process."""
    generate = {"max_new_tokens": args.max_new_tokens, "min_new_tokens": args.max_new_tokens}  # no EOS, as run_jax
    request = {"hf_model": hf_model, "prompts": chat_prompts(args.prompts), "generate": generate}
    result = harness.run_engine(["-m", "s3d_jax.bench.peers"], request)
    tokens, seconds = sum(len(r["tokens"]) for r in result["records"]), sum(r["seconds"] for r in result["records"])
    return {"tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds,
            "peak_mib": result["peak_memory_mib"], "torch": result["torch"]}


def run_llama_cpp(args, lookup: bool) -> dict:
    """llama.cpp on the GGUF, the same prompts and token counts, in its own process."""
    request = {"gguf": args.gguf or str(bundled.gguf_path(args.model)), "tokenizer": args.model_dir, "prompts": chat_prompts(args.prompts),
               "max_new_tokens": args.max_new_tokens, "lookup": lookup, "stop_at_eos": False}
    result = llama_cpp_peer.run(request)
    tokens, seconds = sum(len(r["tokens"]) for r in result["records"]), sum(r["seconds"] for r in result["records"])
    return {"tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds, "peak_mib": result["peak_memory_mib"],
            "version": result["llama_cpp"]}


def render(jax_result: dict, hf_result: dict | None, args, llama_cpp: dict | None = None) -> str:
    methods, memory = jax_result["methods"], jax_result["memory"]
    base = methods["ar"]["tokens_per_s"]
    memory_kind = "device" if memory["ar"]["memory_kind"] == "device peak" else "resident"
    lines = [
        f"Device: {jax_result['device']}; {jax_result['dtype']}; {args.prompts} chat prompts x {args.max_new_tokens} new tokens, batch 1; "
        f"skip {list(jax_result['skip'])}, gamma {args.gamma}; "
        f"S3D drafts {f'a tree of {tree} nodes' if (tree := jax_result.get('s3d_tree')) else 'the argmax chain'}.",
        "",
        f"| engine / method | tokens/s | speed vs s3d_jax plain | tokens/iteration | acceptance per depth | peak MiB ({memory_kind}) |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for name, row in methods.items():
        depth = " ".join(f"{a:.2f}" for a in row["acceptance_per_depth"]) or "-"
        lines.append(f"| s3d_jax {name} | {row['tokens_per_s']:.1f} | {row['tokens_per_s'] / base:.2f}x | "
                     f"{row['tokens_per_iteration']:.2f} | {depth} | {memory[name]['peak_mib']:.0f} |")
    for name, row in (llama_cpp or {}).items():
        lines.append(f"| llama.cpp {row['version']} {name} (GGUF as shipped) | {row['tokens_per_s']:.1f} | "
                     f"{row['tokens_per_s'] / base:.2f}x | - | - | {row['peak_mib']:.0f} |")
    if hf_result:
        lines.append(f"| transformers {hf_result['torch']} generate (greedy) | {hf_result['tokens_per_s']:.1f} | "
                     f"{hf_result['tokens_per_s'] / base:.2f}x | 1.00 | - | {hf_result['peak_mib']:.0f} |")
        lines.append("")
        lines.append(f"s3d_jax plain greedy / transformers greedy: **{base / hf_result['tokens_per_s']:.2f}x** tokens/s, "
                     f"{memory['ar']['peak_mib'] / hf_result['peak_mib']:.2f}x peak memory.")
    weights = memory["ar"]["weights_mib"]
    lines += ["", f"Memory of each method alone in a fresh process (MiB, {memory_kind}; float weights {weights:.0f}):", "",
              "| method | " + " | ".join(memory["ar"]["stages_mib"]) + " | peak |", "| --- " * (len(memory["ar"]["stages_mib"]) + 2) + "|"]
    for name, row in memory.items():
        lines.append(f"| {name} | " + " | ".join(f"{v:.0f}" for v in row["stages_mib"].values()) + f" | {row['peak_mib']:.0f} |")
    lines += ["", f"Pass cost at a context of {args.context} tokens (ms per pass, at least {args.repeats} passes in one jitted loop). "
              f"The floor is the bytes a pass must read (weights, head, cached keys and values) over the streaming bandwidth, "
              f"{jax_result['bandwidth_gb_s']:.1f} GB/s by a probe in the same run:", "",
              "| pass | ms | vs plain step | floor ms | vs floor |", "| --- | --- | --- | --- | --- |"]
    step = jax_result["pass_ms"]["plain step (1 token)"]
    for name, ms in jax_result["pass_ms"].items():
        floor = jax_result["pass_floor_ms"][name]
        lines.append(f"| {name} | {ms:.2f} | {ms / step:.2f} | {floor:.2f} | {ms / floor:.2f} |")
    if jax_result.get("tree_sweep"):
        lines += ["", f"Tree drafting (S3D, gamma {args.gamma}; N = 0 is the argmax chain; + lookup: with the context branch, "
                  "verified alone when the context supplies it; verify ms: the drafted tree's pass; plain decoding in the same run "
                  "is 1.00x):",
                  "", "| tree nodes N | verify ms | vs plain step | tokens/iteration | S3D vs plain | predicted, memory-bound | "
                  "output equals plain |", "| --- | --- | --- | --- | --- | --- | --- |"]
        for row in jax_result["tree_sweep"]:
            lines.append(f"| {tree_label(row)} | {row['verify_ms']:.2f} | {row['verify_vs_step']:.2f} | "
                         f"{row['tokens_per_iteration']:.2f} | {row['vs_plain']:.2f}x | {row['predicted_memory_bound']:.2f}x | "
                         f"{row['same_as_plain']} |")
    if jax_result.get("draft_vocab_sweep"):
        lines += ["", f"The draft vocabulary (S3D, gamma {args.gamma}; plain decoding in the same run is the 1.00x):", "",
                  "| draft vocabulary | draft pass ms | vs plain step | tokens/iteration | acceptance per depth | S3D vs plain | "
                  "output equals plain |", "| --- | --- | --- | --- | --- | --- | --- |"]
        for row in jax_result["draft_vocab_sweep"]:
            depth = " ".join(f"{a:.2f}" for a in row["acceptance_per_depth"])
            lines.append(f"| {row['draft_vocab'] or 'full'} | {row['draft_ms']:.2f} | {row['draft_vs_step']:.2f} | "
                         f"{row['tokens_per_iteration']:.2f} | {depth} | {row['vs_plain']:.2f}x | {row['same_as_plain']} |")
    return "\n".join(lines)


def tree_label(row: dict) -> str:
    return f"{row['tree']} + lookup" if row.get("lookup") else str(row["tree"] or "chain")


def plot_trees(sweep: list[dict], path: Path) -> None:
    """Tokens per iteration and speed against plain decoding, by tree size, without and with the context branch."""
    fig = Figure(figsize=(7, 4.5))
    ax = fig.subplots()
    for lookup, style, suffix in ((False, "-", ""), (True, "--", ", + lookup")):
        rows = [row for row in sweep if not row["tree"] or row["lookup"] == lookup]
        if len(rows) < 2 and lookup:
            continue
        sizes = [row["tree"] for row in rows]
        ax.plot(sizes, [row["tokens_per_iteration"] for row in rows], "o" + style, color="C0", label="tokens/iteration (E)" + suffix)
        ax.plot(sizes, [row["vs_plain"] for row in rows], "s" + style, color="C1", label="S3D speed vs plain, this machine" + suffix)
        ax.plot(sizes, [row["predicted_memory_bound"] for row in rows], "^" + style, color="C2", alpha=0.6,
                label="predicted, memory-bound device" + suffix)
    ax.axhline(1.0, color="gray", ls=":")
    ax.set_xlabel("tree nodes N (0: the chain)")
    ax.set_title("Tree drafting")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


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
    add_model_arguments(p)
    p.add_argument("--prompts", type=int, default=8)
    add_arguments(p, methods=False)
    p.set_defaults(gamma=DEFAULT_GAMMA)
    p.add_argument("--gammas", type=int, nargs="+", default=[2, 3, 4, 5], help="draft sizes whose pass costs to time")
    p.add_argument("--trees", type=int, nargs="*", default=[], metavar="N",
                   help="also run S3D with each tree size (0: the chain), e.g. 0 8 16 32 64")
    p.add_argument("--draft-vocabs", type=int, nargs="*", default=[], metavar="N",
                   help="also time the drafter with each draft vocabulary size (0: the full head), e.g. 4096 8192 16384 0")
    p.add_argument("--context", type=int, default=256)
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--skip-hf", action="store_true", help="do not run the transformers baseline")
    p.add_argument("--llama-cpp", action="store_true", help="also run llama.cpp on the GGUF (needs llama-cpp-python)")
    p.add_argument("--gguf", default=None, help="GGUF for llama.cpp (default: the bundled SmolLM2's)")
    p.add_argument("--out", default="results")
    p.add_argument("--quiet", action="store_true")
    p.set_defaults(memory_of=None)  # set in the request of a memory process
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
    args.model_dir = str(bundled.model_directory(args.model))  # for transformers and llama.cpp's tokenizer
    results = {"jax": harness.run_engine([__file__, "--engine"], vars(args))}
    results["jax"]["memory"] = {method: harness.run_engine([__file__, "--engine"], {**vars(args), "memory_of": method})
                                for method in tqdm(METHODS, desc="memory, one process per method", disable=args.quiet)}
    if args.llama_cpp:
        results["llama_cpp"] = {"greedy": run_llama_cpp(args, lookup=False), "prompt lookup": run_llama_cpp(args, lookup=True)}
    if not args.skip_hf:
        with tempfile.TemporaryDirectory() as scratch:  # transformers runs the very weights under test
            results["hf"] = run_hf(args, harness.export_for_transformers(args.model_dir, f"{scratch}/hf"))
    table = render(results["jax"], results.get("hf"), args, results.get("llama_cpp"))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_decode.json").write_text(json.dumps(results, indent=2))
    (out / "bench_decode.md").write_text(table + "\n")
    plot(results["jax"], results.get("hf"), out / "bench_decode.png")
    if results["jax"]["tree_sweep"]:
        plot_trees(results["jax"]["tree_sweep"], out / "bench_decode_trees.png")
    print(table)
    print(f"\nwrote {out}/bench_decode.{{json,md,png}}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
