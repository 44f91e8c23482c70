"""The benchmark: metric functions on hand-made inputs, and a CPU smoke run on a tiny model."""

import csv
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from reference import save_chat_model, tiny_model

from s3d_jax import checkpoint
from s3d_jax.bench import harness
from s3d_jax.bench.__main__ import main as bench_main
from s3d_jax.bench.quality import pass_at_1, rouge
from s3d_jax.bench.suites import humaneval_completion
from s3d_jax.metrics import expected_tokens, memory_normalised_speedup


def test_memory_normalised_speedup():
    assert memory_normalised_speedup(30.0, 10.0, 100.0, 100.0) == pytest.approx(3.0)
    assert memory_normalised_speedup(30.0, 10.0, 200.0, 100.0) == pytest.approx(1.5)


def test_the_table_names_the_policy_each_engine_ran():
    """A speedup at the calibrated defaults means little without what they chose on that machine."""
    from s3d_jax.bench.report import render_table, summarize_engine

    def result(policy, seconds):
        records = [{"suite": "mt_bench", "id": i, "turn": 0, "tokens": [1, 2, 3, 4], "text": "", "seconds": seconds,
                    "compile_seconds": 1.0, "histogram": [1, 0, 1], "plain_steps": 1, "policy": policy} for i in (0, 1)]
        return {"records": records, "peak_memory_mib": 100.0, "memory_kind": "process peak RSS"}

    prompts = {"mt_bench": [{"id": 0}, {"id": 1}]}
    base = summarize_engine("ar", "mt_bench", result("", 2.0), prompts)
    chosen = "calibrated policy: tree of 4, never drafts, context branch on; predicted 1.15x"
    row = summarize_engine("s3d", "mt_bench", result(chosen, 1.0), prompts, base, result("", 2.0))
    assert "policy" not in base and row["policy"] == chosen and row["speedup"] == pytest.approx(2.0)
    table = render_table([base, row])
    assert table.splitlines()[-1] == f"- s3d: {chosen}" and table.count("policy") == 1


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


@pytest.mark.needs("bundled_model", "mt_bench", "humaneval", "news")
def test_bench_smoke_on_a_tiny_model(tmp_path):
    save_chat_model(tmp_path / "model")
    out = tmp_path / "bench"
    result = subprocess.run(
        [sys.executable, "-m", "s3d_jax.bench", "--model", str(tmp_path / "model"), "--suite", "mt_bench,humaneval,news",
         "--limit", "1", "--max-new-tokens", "8", "--methods", "ar,s3d,ar_sample,s3d_sample", "--peers", "hf", "--skip", "2", "3",
         "--gamma", "3", "--max-len", "512", "--out", str(out)],
        capture_output=True, text=True, timeout=900,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    for name in ("table.md", "results.csv", "raw.json", "speedup.png", "acceptance.png"):
        assert (out / name).stat().st_size > 0, name
    rows = list(csv.DictReader((out / "results.csv").open()))
    engines = ("ar", "s3d", "ar_sample", "s3d_sample", "hf")
    assert {(r["suite"], r["engine"]) for r in rows} == {(s, e) for s in ("mt_bench", "humaneval", "news") for e in engines}
    for r in rows:
        if r["engine"] in ("s3d", "hf"):
            # Greedy speculative output equals plain greedy; so does transformers on the exported weights.
            assert r["differs_from_plain"] == "0", r
    by = {(r["suite"], r["engine"]): r for r in rows}
    sampled, plain_sampled = by["news", "s3d_sample"], by["news", "ar_sample"]  # sampled S3D against plain sampling
    assert float(sampled["speedup"]) == pytest.approx(float(sampled["tokens_per_s"]) / float(plain_sampled["tokens_per_s"]), rel=1e-3)
    raw = json.loads((out / "raw.json").read_text())
    assert [r["turn"] for r in raw["results"]["ar"]["records"] if r["suite"] == "mt_bench"] == [0, 1]  # both MT-Bench turns
    assert "| mt_bench | s3d |" in (out / "table.md").read_text()


@pytest.mark.parametrize("args,message", [(["--suite", "gsm8k"], "unknown suite"), (["--methods", "medusa"], "unknown method"),
                                          (["--limit", "0"], "--limit must be at least 1"),
                                          (["--gamma", "0"], "gamma must be >= 1, got 0"),
                                          (["--max-len", "0"], "max_len must be >= 1, got 0")])
def test_bench_bad_input(capsys, args, message):
    assert bench_exit_code(args) == 2 and message in capsys.readouterr().err


def bench_exit_code(argv: list[str]) -> int:
    """`python -m s3d_jax.bench ARGV`'s exit status, run in this process."""
    try:
        return bench_main(argv)
    except SystemExit as e:  # argparse's own usage errors
        return e.code


@pytest.mark.needs("mt_bench")
def test_bench_refuses_s3d_without_a_mask_row(tmp_path, capsys):
    model = tiny_model(mask_token_id=None)
    checkpoint.save(tmp_path / "model", model.params, model.config)
    assert bench_exit_code(["--model", str(tmp_path / "model"), "--suite", "mt_bench", "--limit", "1"]) == 2
    assert "no mask token row" in capsys.readouterr().err


def test_the_bench_module_leaves_jax_out():
    """Each transformers peer runs in a process that imports s3d_jax.bench and its peers module; JAX's own memory must not count
    against it."""
    code = "import sys, s3d_jax.bench, s3d_jax.bench.peers, s3d_jax.bench.report; sys.exit(int('jax' in sys.modules))"
    assert subprocess.run([sys.executable, "-c", code], timeout=120).returncode == 0


@pytest.mark.needs("bundled_model")
def test_bench_decode_on_a_tiny_model(tmp_path):
    """tools/bench_decode.py: pass costs and every method in s3d_jax's process, transformers in the bench's peer process."""
    save_chat_model(tmp_path / "model")
    command = [sys.executable, "tools/bench_decode.py", "--model", str(tmp_path / "model"), "--prompts", "2", "--max-new-tokens", "6",
               "--gamma", "2", "--gammas", "2", "--context", "16", "--repeats", "2", "--quiet", "--out", str(tmp_path / "out"),
               "--trees", "0", "3"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=900, cwd=Path(__file__).parents[1])
    assert result.returncode == 0, result.stderr[-3000:]
    results = json.loads((tmp_path / "out" / "bench_decode.json").read_text())
    # The tree sweep: the chain, then each size without and with the context branch, all exact.
    sweep = results["jax"]["tree_sweep"]
    assert [(row["tree"], row["lookup"]) for row in sweep] == [(0, False), (3, False), (3, True)]
    assert all(row["same_as_plain"] and row["verify_ms"] > 0 for row in sweep)
    assert "| 3 + lookup |" in (tmp_path / "out" / "bench_decode.md").read_text()
    assert (tmp_path / "out" / "bench_decode_trees.png").stat().st_size > 0
    assert set(results["jax"]["pass_ms"]) == {"plain step (1 token)", "s3d draft, gamma=2", "verify, 3 tokens"}
    # No EOS on either side: every prompt runs to --max-new-tokens.
    assert [results["jax"]["methods"][m]["tokens"] for m in ("ar", "selfspec", "s3d")] == [12, 12, 12]
    assert results["hf"]["tokens"] == 12 and results["hf"]["tokens_per_s"] > 0
    # Each method's memory from a process of its own: the stages in order, none above the peak.
    memory = results["jax"]["memory"]
    assert set(memory) == {"ar", "selfspec", "s3d"}
    for row in memory.values():
        assert list(row["stages_mib"]) == ["JAX runtime", "model loaded", "after decoding"]
        assert 0 < row["stages_mib"]["JAX runtime"] <= row["peak_mib"] and max(row["stages_mib"].values()) <= row["peak_mib"] + 1
    assert "Memory of each method alone in a fresh process (MiB, resident" in (tmp_path / "out" / "bench_decode.md").read_text()
    assert (tmp_path / "out" / "bench_decode.png").stat().st_size > 0


@pytest.mark.needs("mt_bench")
def test_llama_cpp_peer_missing_names_the_extra(monkeypatch, tmp_path, capsys):
    import importlib.util

    from s3d_jax.bench import llama_cpp_peer
    from s3d_jax.bench.suites import BenchError

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llama_cpp" else real_find_spec(name, *a))
    with pytest.raises(BenchError, match=r"llama-cpp-python: pip install 's3d-jax\[llama\]'"):
        llama_cpp_peer.require()
    model = tiny_model(seed=0)
    checkpoint.save(tmp_path / "model", model.params, model.config)
    assert bench_exit_code(["--model", str(tmp_path / "model"), "--suite", "mt_bench", "--limit", "1", "--peers", "llama_cpp",
                            "--out", str(tmp_path)]) == 2
    assert "s3d-jax[llama]" in capsys.readouterr().err


def test_every_command_line_passes_its_dtype_to_load():
    """`--dtype` is one model flag: generate, the bench and bench_decode all hand it to `s3d_jax.load`."""
    import importlib.util

    from s3d_jax import generate
    from s3d_jax.bench import __main__ as bench
    from s3d_jax.options import load_arguments

    spec = importlib.util.spec_from_file_location("bench_decode", Path(__file__).parents[1] / "tools" / "bench_decode.py")
    bench_decode = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench_decode)
    for parse, argv in ((generate.parse_args, ["--prompt", "hi"]), (bench.parse_args, []), (bench_decode.parse_args, [])):
        assert load_arguments(parse(argv))["dtype"] is None
        assert load_arguments(parse([*argv, "--dtype", "bfloat16"]))["dtype"] == "bfloat16"
        assert load_arguments(parse([*argv, "--dtype", "int8"]))["dtype"] == "int8"


def test_plain_decoding_loads_the_bare_model_and_s3d_its_drafter():
    """The baseline's memory is the model's alone: plain decoding loads no drafter, whatever the flags say."""
    from s3d_jax.bench import __main__ as bench
    from s3d_jax.options import DecodeOptions

    load = {"path": "m", "drafter": "d.safetensors", "draft_vocab_size": 64, "dtype": "int4", "mesh": None}
    plain, s3d = (bench.method_request(m, load, {}, DecodeOptions())["load"] for m in ("ar", "s3d"))
    assert plain == {**load, "drafter": None, "draft_vocab_size": None} and s3d == load


def test_bench_precisions_on_a_tiny_model(tmp_path):
    """Each precision's plain and S3D engines in one run: S3D reproduces plain at every precision, and
    float32 agrees with itself."""
    save_chat_model(tmp_path / "model", hidden_size=64, num_heads=2, num_kv_heads=1, head_dim=32)
    out = tmp_path / "precisions"
    result = subprocess.run(
        [sys.executable, "tools/bench_precisions.py", "--model", str(tmp_path / "model"), "--drafter", "none", "--dtypes", "float32,int8",
         "--suite", "humaneval", "--limit", "1", "--max-new-tokens", "8", "--out", str(out)],
        capture_output=True, text=True, timeout=900, cwd=Path(__file__).parents[1],
    )
    assert result.returncode == 0, result.stderr[-3000:]
    rows = json.loads((out / "precisions.json").read_text())["rows"]
    assert [r["dtype"] for r in rows] == ["float32", "int8"]
    assert all(r["s3d_differs_from_plain"] == 0 for r in rows)
    assert rows[0]["agrees_with_float32"] == 1.0 and rows[0]["plain_vs_float32"] == 1.0
    assert 0.0 <= rows[1]["agrees_with_float32"] <= 1.0
    assert (out / "precisions.png").stat().st_size > 0 and "| int8 |" in (out / "precisions.md").read_text()


def test_decode_ab_times_each_kind_of_iteration_on_a_tiny_model(tmp_path):
    save_chat_model(tmp_path / "model", hidden_size=64, num_heads=2, num_kv_heads=1, head_dim=32)
    result = subprocess.run(
        [sys.executable, "tools/decode_ab.py", "--model", str(tmp_path / "model"), "--drafter", "none", "--tree", "4",
         "--per-iteration", "3", "--repeats", "1"],
        capture_output=True, text=True, timeout=900, cwd=Path(__file__).parents[1], env={**os.environ, "S3D_JAX_CALIBRATE": "0"},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [line for line in result.stdout.splitlines() if "ms per iteration" in line]
    assert [row.split("  ")[0].strip() for row in rows] == ["plain", "s3d", "s3d, never drafting", "s3d, always drafting"]
    assert rows[0].endswith("1.000x plain's")


def test_decode_ab_on_a_named_shape_times_iterations_only():
    result = subprocess.run([sys.executable, "tools/decode_ab.py", "--shape", "smollm2_135m"], capture_output=True, text=True,
                            timeout=120, cwd=Path(__file__).parents[1])
    assert result.returncode == 2 and "add --per-iteration" in result.stderr
    result = subprocess.run([sys.executable, "tools/decode_ab.py", "--shape", "smollm2_135m", "--per-iteration", "2", "--mesh", "model=2"],
                            capture_output=True, text=True, timeout=120, cwd=Path(__file__).parents[1])
    assert result.returncode == 2 and "--mesh would be ignored" in result.stderr


def test_bench_precisions_needs_float32_first():
    result = subprocess.run([sys.executable, "tools/bench_precisions.py", "--dtypes", "int8"], capture_output=True, text=True,
                            timeout=120, cwd=Path(__file__).parents[1])
    assert result.returncode == 2 and "must start with float32" in result.stderr


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] not in "ZX"
    except OSError:
        return False


@pytest.mark.skipif(sys.platform != "linux", reason="the kernel's parent-death signal is Linux's")
def test_an_engine_ends_when_its_benchmark_is_killed(tmp_path):
    """Killing the benchmark (SIGKILL, so no cleanup of its own runs) ends the engine it started."""
    pid_file = tmp_path / "engine.pid"
    engine = ("import os, sys, time; from s3d_jax.bench import harness; "
              "harness.serve(lambda r: (open(r['pid_file'], 'w').write(str(os.getpid())), time.sleep(120)), *sys.argv[1:])")
    parent = subprocess.Popen([sys.executable, "-c", "import sys; from s3d_jax.bench.harness import run_engine; "
                               f"run_engine(['-c', {engine!r}], {{'pid_file': {str(pid_file)!r}}})"])
    deadline = time.monotonic() + 60
    while not (pid_file.exists() and pid_file.read_text()) and time.monotonic() < deadline:
        time.sleep(0.1)
    engine_pid = int(pid_file.read_text())
    assert _alive(engine_pid)
    parent.kill()
    parent.wait()
    deadline = time.monotonic() + 10
    while _alive(engine_pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    survived = _alive(engine_pid)
    if survived:
        os.kill(engine_pid, signal.SIGKILL)
    assert not survived, "the engine went on running after its benchmark was killed"


def test_an_engine_that_crashes_is_named_with_its_signal():
    """A crashed engine (llama.cpp's build for AMX segfaulted on quantized GGUFs) names itself and the
    signal, and a failing one its exit status, instead of a bare CalledProcessError."""
    crash = "import os, signal; os.kill(os.getpid(), signal.SIGSEGV)"
    with pytest.raises(harness.EngineFailed, match=r"`python -c .*` died of SIGSEGV"):
        harness.run_engine(["-c", crash], {})
    with pytest.raises(harness.EngineFailed, match=r"exited with status 3"):
        harness.run_engine(["-c", "raise SystemExit(3)"], {})
