"""The benchmark: metric functions on hand-made inputs, and a CPU smoke run on a tiny model."""

import csv
import json
import subprocess
import sys

import pytest
from reference import tiny_model

from s3d_jax import bundled, checkpoint
from s3d_jax.bench import expected_tokens, humaneval_completion, memory_normalised_speedup, pass_at_1, rouge


def test_memory_normalised_speedup():
    assert memory_normalised_speedup(30.0, 10.0, 100.0, 100.0) == pytest.approx(3.0)
    assert memory_normalised_speedup(30.0, 10.0, 200.0, 100.0) == pytest.approx(1.5)


def test_expected_tokens_from_acceptance_per_depth():
    assert expected_tokens([]) == 1.0
    assert expected_tokens([1.0, 1.0, 1.0]) == 4.0
    assert expected_tokens([0.5, 0.5]) == pytest.approx(1 + 0.5 + 0.25)
    assert expected_tokens([0.0, 1.0]) == 1.0


def test_rouge_on_known_pairs():
    assert rouge(["the cat sat on the mat"], ["the cat sat on the mat"]) == {"rouge1": 1.0, "rougeL": 1.0}
    assert rouge(["dogs bark"], ["the cat sat"]) == {"rouge1": 0.0, "rougeL": 0.0}
    # 5 of 6 unigrams shared, and the longest common subsequence is 5 long.
    scores = rouge(["the cat was on the mat"], ["the cat sat on the mat"])
    assert scores["rouge1"] == pytest.approx(5 / 6) and scores["rougeL"] == pytest.approx(5 / 6)


def test_humaneval_harness_runs_completions():
    problem = {"task_id": "t/0", "prompt": 'def add(a, b):\n    """The sum."""\n', "entry_point": "add",
               "test": "def check(candidate):\n    assert candidate(2, 3) == 5\n"}
    assert humaneval_completion("    return a + b\n\ndef unused():\n    pass", "add") == "    return a + b\n"
    restated = "\ndef add(a, b):\n    return a + b\n\ndef unused():\n    pass"
    assert humaneval_completion(restated, "add") == "\ndef add(a, b):\n    return a + b\n"
    assert pass_at_1([problem] * 3, ["    return a + b\n", "    return a - b\n", restated]) == pytest.approx(2 / 3)


def test_bench_smoke_on_a_tiny_model(tmp_path):
    model = tiny_model(seed=0, vocab_size=49153, mask_token_id=49152, hidden_size=32, intermediate_size=64, head_dim=8)
    tokenizer = bundled.tokenizer()
    checkpoint.save(tmp_path / "model", model.params, model.config.replace(eos_token_ids=(2,)), tokenizer)
    out = tmp_path / "bench"
    result = subprocess.run(
        [sys.executable, "-m", "s3d_jax.bench", "--model", str(tmp_path / "model"), "--suite", "mt_bench,humaneval,news",
         "--limit", "2", "--max-new-tokens", "8", "--peers", "hf", "--skip", "2", "3", "--gamma", "3", "--out", str(out)],
        capture_output=True, text=True, timeout=900,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    for name in ("table.md", "results.csv", "raw.json", "speedup.png", "acceptance.png"):
        assert (out / name).stat().st_size > 0, name
    rows = list(csv.DictReader((out / "results.csv").open()))
    assert {(r["suite"], r["engine"]) for r in rows} == {(s, e) for s in ("mt_bench", "humaneval", "news") for e in ("ar", "selfspec", "s3d", "s3d_sample", "hf")}
    for r in rows:
        if r["engine"] in ("selfspec", "s3d", "hf"):
            # Greedy speculative output equals plain greedy; so does transformers on the exported weights.
            assert r["differs_from_plain"] == "0", r
    raw = json.loads((out / "raw.json").read_text())
    assert sum(r["turn"] == 1 for r in raw["results"]["ar"]["records"]) == 2  # both MT-Bench turns
    assert "| mt_bench | s3d |" in (out / "table.md").read_text()


@pytest.mark.parametrize("args,message", [(["--suite", "gsm8k"], "unknown suite"), (["--methods", "medusa"], "unknown method"), (["--limit", "0"], "--limit must be at least 1")])
def test_bench_bad_input(args, message):
    result = subprocess.run([sys.executable, "-m", "s3d_jax.bench", *args], capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and message in result.stderr


def test_bench_refuses_s3d_without_a_mask_row(tmp_path):
    model = tiny_model(mask_token_id=None)
    checkpoint.save(tmp_path / "model", model.params, model.config)
    result = subprocess.run([sys.executable, "-m", "s3d_jax.bench", "--model", str(tmp_path / "model"), "--suite", "mt_bench", "--limit", "1"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and "no mask token row" in result.stderr


def test_the_bench_module_leaves_jax_out():
    """Each transformers peer runs in a process that imports s3d_jax.bench; JAX's own memory must not count against it."""
    code = "import sys, s3d_jax.bench; sys.exit(int('jax' in sys.modules))"
    assert subprocess.run([sys.executable, "-c", code], timeout=120).returncode == 0
