"""What a run reports: `metrics.jsonl` (one record per line, split "train" or "eval"), a one-line
description of a record, and the loss and accuracy curves."""

from __future__ import annotations

import json
import math
import os
import sys
import time
from pathlib import Path

from s3d_jax.objective import summarize_metrics


class Throughput:
    """Training tokens (padding excluded) per second since the last reading."""

    def __init__(self):
        self.tokens, self.since = 0, time.perf_counter()

    def add(self, rows: dict) -> int:
        """Counts a step's rows; returns their tokens."""
        tokens = int((rows["segment_ids"] > 0).sum())
        self.tokens += tokens
        return tokens

    def read(self) -> float:
        rate = self.tokens / (time.perf_counter() - self.since)
        self.tokens, self.since = 0, time.perf_counter()
        return rate


def log_step(metrics_file: Path, step: int, metrics, *, lr: float, tokens_per_s: float, data_position: int, tokens_seen: int) -> dict:
    """Appends a training step's record (its metric sums made readable) and returns it."""
    record = {"split": "train", "step": step, **summarize_metrics(metrics), "lr": lr, "grad_norm": float(metrics["grad_norm"]),
              "tokens_per_s": tokens_per_s, "data_position": data_position, "tokens_seen": tokens_seen}
    _append(metrics_file, record)
    return record


def log_eval(metrics_file: Path, step: int, pooled_metrics, tokens_seen: int) -> dict:
    """Appends a held-out evaluation's record and returns it."""
    record = {"split": "eval", "step": step, **summarize_metrics(pooled_metrics), "tokens_seen": tokens_seen}
    _append(metrics_file, record)
    return record


def drop_after(metrics_file: Path, step: int) -> list[dict]:
    """Keeps the records up to `step` (the step a run starts or resumes from) and returns them. Later
    records (a killed run's steps after its last checkpoint, which the resumed run logs again) and
    unreadable lines (a write cut off by the kill) move to `metrics.discarded.jsonl`: nothing is lost."""
    if not metrics_file.exists():
        return []
    kept, dropped = [], []
    for line in metrics_file.read_text().splitlines():
        try:
            record = json.loads(line)
            (kept if int(record["step"]) <= step else dropped).append(record)
        except (ValueError, KeyError, TypeError):
            if line.strip():
                dropped.append(line)
    if dropped:
        with metrics_file.with_name("metrics.discarded.jsonl").open("a") as f:
            f.writelines((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in dropped)
        tmp = metrics_file.with_name(metrics_file.name + ".tmp")
        tmp.write_text("".join(json.dumps(r) + "\n" for r in kept))
        os.replace(tmp, metrics_file)
        print(f"{metrics_file.name}: moved {len(dropped)} lines logged after step {step} (or cut off by a kill) to "
              "metrics.discarded.jsonl; this run logs those steps again", file=sys.stderr)
    return kept


def _append(path: Path, record: dict) -> None:
    with path.open("a") as f:
        f.write(json.dumps(record) + "\n")


def describe(record: dict) -> str:
    """One line: loss, accuracy per depth, expected tokens per iteration (and the verifier's perplexity)."""
    depth = " ".join(f"{a:.2f}" for a in record["accuracy_per_depth"][:6] if not math.isnan(a))
    text = f"loss {record['draft_loss']:.3f} acc/depth [{depth}] E {record['expected_tokens_per_iteration']:.2f}"
    return text + (f" verifier ppl {record['verifier_perplexity']:.2f}" if "verifier_perplexity" in record else "")


def plot_metrics(metrics_file: Path, out: Path) -> None:
    """The learning curve: train and held-out draft loss, held-out accuracy per depth, and the E it
    implies, against the tokens seen (against the step in a log written before tokens were counted)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [json.loads(line) for line in metrics_file.read_text().splitlines() if line.strip()]
    by_tokens = bool(rows) and all("tokens_seen" in r for r in rows)

    def x(records):
        return [r["tokens_seen"] / 1e6 if by_tokens else r["step"] for r in records]

    train = [r for r in rows if r["split"] == "train"]
    held = [r for r in rows if r["split"] == "eval"]
    fig, (loss, accuracy, expected) = plt.subplots(1, 3, figsize=(15, 4))
    if train:
        loss.plot(x(train), [r["draft_loss"] for r in train], label="train", alpha=0.8)
    if held:
        loss.plot(x(held), [r["draft_loss"] for r in held], "o-", label="held-out")
        measured = [d for d in range(len(held[0]["accuracy_per_depth"])) if any(not math.isnan(r["accuracy_per_depth"][d]) for r in held)]
        for d in measured:
            accuracy.plot(x(held), [r["accuracy_per_depth"][d] for r in held], "o-", label=f"depth {d}")
        expected.plot(x(held), [r["expected_tokens_per_iteration"] for r in held], "o-")
    for ax, y_label, title in ((loss, "draft loss", "Drafter loss"), (accuracy, "held-out accuracy", "Draft accuracy per depth"),
                               (expected, "tokens per iteration", "Held-out E (chain of gamma drafts)")):
        ax.set_xlabel("tokens seen (millions)" if by_tokens else "step")
        ax.set_ylabel(y_label)
        ax.set_title(title)
    loss.legend()
    accuracy.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
