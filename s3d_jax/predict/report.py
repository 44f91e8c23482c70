"""The predictor's tables (markdown) and plots."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from matplotlib.figure import Figure

from s3d_jax.speedup import first_acceptance


def gate_table(gates: dict) -> str:
    """Markdown: each min_certainty's predicted (and measured) speedup and kinds of iteration with the
    gate fixed, and the speedup predicted for a policy that learns on each side of it."""
    measured = any("measured_speedup" in row for row in gates["rows"])
    costs = gates["costs"]
    head = ["min_certainty", "predicted speedup", "drafted", "branch alone", "plain steps", "predicted, learning"] + (
        ["measured speedup"] if measured else [])
    lines = [f"skip {gates['skip']}, gamma {gates['gamma']}, tree {gates['tree']}, {gates['positions']} positions; pass costs in "
             f"plain steps: drafted tree {costs['drafted']:.2f}, branch alone {costs['branch']:.2f}", "",
             "| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for row in gates["rows"]:
        cells = ["oracle" if row["min_certainty"] is None else f"{row['min_certainty']:g}", f"{row['predicted_speedup']:.2f}x",
                 f"{row['drafted_share']:.0%}", f"{row['branch_share']:.0%}", f"{row['plain_share']:.0%}",
                 f"{row['learning_speedup']:.2f}x" if "learning_speedup" in row else "-"]
        if measured:
            cells.append(f"{row['measured_speedup']:.2f}x" if "measured_speedup" in row else "-")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def tree_table(trees: dict) -> str:
    """Markdown: each tree size's predicted (and measured) E, verify cost and speedup; 0 is the chain."""
    measured = "measured_e" in trees["rows"][0]
    head = ["tree N", "predicted E", "verify vs plain step", "predicted speedup"] + (["measured E", "measured speedup"] if measured else [])
    lines = [f"skip {trees['skip']}, gamma {trees['gamma']}, {trees['positions']} positions; "
             f"recommended tree: {trees['recommended_tree'] or 'the chain'}", "", "| " + " | ".join(head) + " |",
             "|" + " --- |" * len(head)]
    for row in trees["rows"]:
        cells = [str(row["tree"] or "chain"), f"{row['predicted_e']:.2f}", f"{row['verify_vs_step']:.2f}x",
                 f"{row['predicted_speedup']:.2f}x"]
        if measured:
            cells += [f"{row['measured_e']:.2f}", f"{row['measured_speedup']:.2f}x"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot_trees(trees: dict, path: Path) -> None:
    fig = Figure(figsize=(10, 3.8))
    left, right = fig.subplots(1, 2)
    rows = trees["rows"]
    sizes = [row["tree"] or trees["gamma"] for row in rows]  # the chain has γ nodes
    for ax, key, label in ((left, "e", "tokens per iteration E"), (right, "speedup", "speedup vs plain")):
        ax.plot(sizes, [row[f"predicted_{key}"] for row in rows], "o--", label="predicted")
        if f"measured_{key}" in rows[0]:
            ax.plot(sizes, [row[f"measured_{key}"] for row in rows], "s-", label="measured")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("tree nodes N (leftmost: the chain)")
        ax.set_ylabel(label)
        ax.legend()
    right.axhline(1.0, color="gray", lw=0.8)
    fig.suptitle(f"skip {trees['skip']}, gamma {trees['gamma']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


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
