"""s3d_jax's side of the benchmarks: decode prompts with given DecodeOptions and pool what they
measured. Imports JAX: only JAX processes import it (a method's child process, the predictor,
tools/bench_decode.py), never the parent or a transformers peer.

    python -m s3d_jax.bench.methods REQUEST RESULT     # one method, a child of `python -m s3d_jax.bench`
"""

from __future__ import annotations

import dataclasses
import sys

import jax
import numpy as np

from s3d_jax import api
from s3d_jax.bench import harness
from s3d_jax.bench.suites import run_turns
from s3d_jax.options import DecodeOptions


@dataclasses.dataclass
class Decoded:
    """Prompts decoded with the same options: a record per turn, and their totals."""

    records: list[dict]  # per turn: suite, id, turn, tokens, text, seconds, compile_seconds, histogram, plain_steps, method
    tokens: int
    seconds: float  # decoding only: compilation is excluded
    histogram: np.ndarray  # the accept histogram summed over every turn

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds


def decode_prompts(model, prompts: dict[str, list[dict]], options: DecodeOptions) -> Decoded:
    """Decodes every turn of `prompts` (suite -> items, see suites.run_turns) after one warm-up."""

    def generate(item, messages):
        out = api.decode(model, item["text"] if messages is None else messages, options)
        return {"tokens": out.tokens, "text": out.text, "seconds": out.stats.decode_seconds,
                "compile_seconds": out.stats.compile_seconds, "histogram": np.sum(out.stats.accept_histogram, axis=0).tolist(),
                "plain_steps": sum(out.stats.plain_steps), "method": out.stats.method,  # "ar" where the calibrated policy chose plain steps
                "policy": out.stats.policy}

    records = run_turns(prompts, generate)
    return Decoded(records, sum(len(r["tokens"]) for r in records), sum(r["seconds"] for r in records),
                   np.sum([r["histogram"] for r in records], axis=0))


def peak_memory_mib() -> tuple[float, str]:
    """The device's peak memory where it reports one (GPU), else this process's peak RSS."""
    stats = jax.devices()[0].memory_stats() or {}
    if "peak_bytes_in_use" in stats:
        return stats["peak_bytes_in_use"] / 2**20, "device peak"
    return harness.peak_rss_mib(), "process peak RSS"


def memory_now_mib() -> float:
    """The device's memory in use where it reports it (GPU), else this process's resident memory."""
    stats = jax.devices()[0].memory_stats() or {}
    return stats["bytes_in_use"] / 2**20 if "bytes_in_use" in stats else harness.rss_mib()


def run_method(request: dict) -> dict:
    """One method of the comparison table: `load` (`s3d_jax.load` keywords), `prompts` and `options`
    (a DecodeOptions as a dict) -> every turn's record and the peak memory."""
    model = api.load(**request["load"])
    decoded = decode_prompts(model, request["prompts"], DecodeOptions(**request["options"]))
    memory, kind = peak_memory_mib()
    return {"records": decoded.records, "peak_memory_mib": memory, "memory_kind": kind, "device": jax.devices()[0].device_kind,
            "dtype": model.config.dtype}


if __name__ == "__main__":
    sys.exit(harness.serve(run_method, *sys.argv[1:]))
