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

    def add(self, rows: dict) -> None:
        self.tokens += int((rows["segment_ids"] > 0).sum())

    def read(self) -> float:
        rate = self.tokens / (time.perf_counter() - self.since)
        self.tokens, self.since = 0, time.perf_counter()
        return rate


def log_step(metrics_file: Path, step: int, metrics, *, lr: float, tokens_per_s: float, data_position: int) -> dict:
    """Appends a training step's record (its metric sums made readable) and returns it."""
    record = {"split": "train", "step": step, **summarize_metrics(metrics), "lr": lr, "grad_norm": float(metrics["grad_norm"]),
              "tokens_per_s": tokens_per_s, "data_position": data_position}
    _append(metrics_file, record)
    return record


def log_eval(metrics_file: Path, step: int, pooled_metrics) -> dict:
    """Appends a held-out evaluation's record and returns it."""
    record = {"split": "eval", "step": step, **summarize_metrics(pooled_metrics)}
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
    """Train and held-out draft loss, and held-out accuracy per depth, against the step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [json.loads(line) for line in metrics_file.read_text().splitlines() if line.strip()]
    train = [r for r in rows if r["split"] == "train"]
    held = [r for r in rows if r["split"] == "eval"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    if train:
        left.plot([r["step"] for r in train], [r["draft_loss"] for r in train], label="train draft loss", alpha=0.8)
    if held:
        left.plot([r["step"] for r in held], [r["draft_loss"] for r in held], "o-", label="held-out draft loss")
        measured = [d for d in range(len(held[0]["accuracy_per_depth"])) if any(not math.isnan(r["accuracy_per_depth"][d]) for r in held)]
        for d in measured:
            right.plot([r["step"] for r in held], [r["accuracy_per_depth"][d] for r in held], "o-", label=f"depth {d}")
    left.set_xlabel("step")
    left.set_ylabel("cross-entropy")
    left.legend()
    left.set_title("S3D drafter loss")
    right.set_xlabel("step")
    right.set_ylabel("held-out accuracy")
    right.set_title("Draft accuracy per depth")
    right.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
