"""The comparison table's rows, and the files they are written to: table.md, results.csv, raw.json,
speedup.png and acceptance.png. No JAX."""

from __future__ import annotations

import csv
import json
import statistics
from pathlib import Path

import numpy as np
from matplotlib.figure import Figure

from s3d_jax.bench.quality import pass_at_1, rouge
from s3d_jax.metrics import acceptance_per_depth, memory_normalised_speedup, tokens_per_iteration


def summarize_engine(engine: str, suite: str, result: dict, prompts: dict, base: dict | None = None, reference: dict | None = None) -> dict:
    """One row: `engine`'s speed, acceptance, memory and quality on `suite`. Ratios are against the
    `base` row (plain greedy, or plain sampling for sampled S3D); `reference` is plain greedy's result, whose outputs a greedy engine
    must reproduce (None for a sampling engine)."""
    records = [r for r in result["records"] if r["suite"] == suite]
    speeds = [len(r["tokens"]) / r["seconds"] for r in records if r["seconds"] > 0]
    row = {"engine": engine, "suite": suite, "prompts": len(records), "tokens_per_s": statistics.median(speeds),
           "peak_memory_mib": result["peak_memory_mib"], "memory_kind": result["memory_kind"],
           "compile_s": sum(r["compile_seconds"] for r in records) if "compile_seconds" in records[0] else None}  # peers: none
    if "histogram" in records[0]:  # the peers record none
        hist = np.sum([r["histogram"] for r in records], axis=0)
        row["acceptance_per_depth"] = acceptance_per_depth(hist)
        row["tokens_per_iteration"] = tokens_per_iteration(hist)
        plain_steps = sum(r.get("plain_steps", 0) for r in records)
        row["plain_step_share"] = plain_steps / max(plain_steps + hist.sum(), 1)  # of every pass that emitted tokens
    else:
        row["acceptance_per_depth"], row["tokens_per_iteration"] = [], float("nan")
    policies = sorted({r["policy"] for r in records if r.get("policy")})
    if policies:  # what S3D did where the calibrated policy chose its defaults: the numbers mean little without it
        row["policy"] = " / ".join(policies)
    if base is not None:
        row["speedup"], row["against"] = row["tokens_per_s"] / base["tokens_per_s"], base["engine"]
        row["msr"] = memory_normalised_speedup(row["tokens_per_s"], base["tokens_per_s"], row["peak_memory_mib"], base["peak_memory_mib"])
    if reference is not None:
        plain = {(r["id"], r["turn"]): r["tokens"] for r in reference["records"] if r["suite"] == suite}
        row["differs_from_plain"] = sum(r["tokens"] != plain.get((r["id"], r["turn"])) for r in records)
    first_turns = [r for r in records if r["turn"] == 0]
    items = {p["id"]: p for p in prompts[suite]}
    if suite == "humaneval":
        row["pass@1"] = pass_at_1([items[r["id"]]["problem"] for r in first_turns], [r["text"] for r in first_turns])
    if suite == "news":
        row.update(rouge([r["text"] for r in first_turns], [items[r["id"]]["reference"] for r in first_turns]))
    return row


def render_table(rows: list[dict]) -> str:
    columns = ["suite", "engine", "tokens/s", "speedup", "E", "plain steps", "acceptance per depth", "peak MiB", "M-SR", "quality",
               "differs from plain", "compile s"]
    lines = ["| " + " | ".join(columns) + " |", "|" + " --- |" * len(columns)]
    for r in rows:
        depth = " ".join(f"{a:.2f}" for a in r["acceptance_per_depth"]) or "-"
        quality = "; ".join(f"{k} {r[k]:.3f}" for k in ("pass@1", "rouge1", "rougeL") if k in r) or "-"
        e = f"{r['tokens_per_iteration']:.2f}" if r["tokens_per_iteration"] == r["tokens_per_iteration"] else "-"
        plain = f"{r['plain_step_share']:.0%}" if "plain_step_share" in r else "-"
        speedup = f"{r.get('speedup', 1.0):.2f}x" + (f" of {r['against']}" if r.get("against", "ar") != "ar" else "")
        lines.append(f"| {r['suite']} | {r['engine']} | {r['tokens_per_s']:.1f} | {speedup} | {e} | {plain} | {depth} | "
                     f"{r['peak_memory_mib']:.0f} | {r.get('msr', 1.0):.2f} | {quality} | {r.get('differs_from_plain', '-')} | "
                     f"{'-' if r['compile_s'] is None else format(r['compile_s'], '.1f')} |")
    policies = dict.fromkeys(f"{r['engine']}: {r['policy']}" for r in rows if r.get("policy"))
    return "\n".join(lines + ([""] if policies else []) + [f"- {p}" for p in policies])


def write_csv(rows: list[dict], path: Path) -> None:
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=sorted({k for r in rows for k in r}))
        writer.writeheader()
        writer.writerows(rows)


def plot_speedup(rows: list[dict], path: Path) -> None:
    """Bars per suite: each engine's speedup over plain decoding (`summarize_engine`'s base)."""
    suites = sorted({r["suite"] for r in rows})
    engines = list(dict.fromkeys(r["engine"] for r in rows))
    fig = Figure(figsize=(8, 4))
    ax = fig.subplots()
    width = 0.8 / len(engines)
    for i, engine in enumerate(engines):
        values = [next((r.get("speedup", 1.0) for r in rows if r["suite"] == s and r["engine"] == engine), 0) for s in suites]
        ax.bar(np.arange(len(suites)) + i * width, values, width, label=engine)
    ax.axhline(1.0, color="gray", ls="--")
    ax.set_xticks(np.arange(len(suites)) + width * (len(engines) - 1) / 2, suites)
    ax.set_ylabel("speedup over plain decoding (same run)")  # greedy, or sampling for a sampled engine
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def plot_acceptance(rows: list[dict], path: Path) -> None:
    """Acceptance per draft depth, one line per speculative engine and suite."""
    fig = Figure(figsize=(6, 4))
    ax = fig.subplots()
    for r in rows:
        depths = np.arange(1, len(r["acceptance_per_depth"]) + 1)
        if len(depths):
            ax.plot(depths, r["acceptance_per_depth"], "o-", label=f"{r['engine']} / {r['suite']}")
    ax.set_xticks(range(1, 1 + max((len(r["acceptance_per_depth"]) for r in rows), default=1)))
    ax.set_xlabel("draft depth")
    ax.set_ylabel("acceptance (given the earlier drafts were accepted)")
    ax.set_ylim(0, 1)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def write_outputs(out: Path, rows: list[dict], raw: dict) -> str:
    """Writes every output file to `out`; returns the markdown table."""
    out.mkdir(parents=True, exist_ok=True)
    table = render_table(rows)
    (out / "table.md").write_text(table + "\n")
    (out / "raw.json").write_text(json.dumps(raw, indent=1))
    write_csv(rows, out / "results.csv")
    plot_speedup(rows, out / "speedup.png")
    plot_acceptance(rows, out / "acceptance.png")
    return table
