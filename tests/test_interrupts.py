"""Faults of the running process: Ctrl-C in the command lines, and a damaged kernel in the cache. Each
ends with one clear line or is repaired; none ends in a traceback or a crash."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
from test_train import ROOT


def interrupt_when(command: list[str], ready, timeout: float = 600) -> subprocess.CompletedProcess:
    """Runs `command`, sends it SIGINT (Ctrl-C) once `ready(process)` holds, and waits for it to end."""
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + timeout
    while not ready(process) and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    process.send_signal(signal.SIGINT)
    out, err = process.communicate(timeout=300)
    return subprocess.CompletedProcess(command, process.returncode, out, err)


@pytest.mark.needs("bundled_model")
def test_ctrl_c_in_generate_ends_with_one_line():
    command = [sys.executable, "-m", "s3d_jax.generate", "--chat", "--max-new-tokens", "4000", "--prompt", "Tell me a long story."]
    result = interrupt_when(command, lambda p: p.stdout.read(1) != "")  # it has started streaming the reply
    assert result.returncode == 130, result.stderr
    assert result.stderr.strip().splitlines()[-1] == "interrupted" and "Traceback" not in result.stderr


@pytest.mark.needs("bundled_model", "mt_bench")
def test_ctrl_c_in_train_ends_with_one_line_and_says_how_to_resume(tmp_path):
    metrics = tmp_path / "run" / "metrics.jsonl"
    command = [sys.executable, "-m", "s3d_jax.train", "--config", str(ROOT / "configs" / "tiny.py"), "--workdir", str(tmp_path / "run"),
               "--config.train.steps=100000"]
    result = interrupt_when(command, lambda p: metrics.exists() and metrics.read_text().count("\n") >= 2)
    assert result.returncode == 130, result.stderr
    assert "interrupted: run the same command again to resume from the last checkpoint" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.needs("bundled_model")
@pytest.mark.parametrize("how", ["generate", "api"])
def test_a_truncated_kernel_in_the_cache_is_rebuilt_not_loaded(tmp_path, how):
    """A kernel cut short in the cache (a crash, an interrupted copy) once killed every later run with
    SIGBUS; now the command line and the API rebuild it and go on."""
    from s3d_jax import bundled, few_rows, paths

    if not few_rows.available():
        pytest.skip("no few-row kernel here (no compiler, or switched off)")
    model = bundled.ensure_converted()
    shutil.copytree(paths.cache_root() / "kernels", tmp_path / "kernels")
    for library in (tmp_path / "kernels").glob("few_rows-*.so"):
        os.truncate(library, 4096)
    command = {"generate": ["-m", "s3d_jax.generate", "--model", str(model), "--drafter", "none", "--chat", "--prompt", "Hi",
                            "--max-new-tokens", "4"],
               "api": ["-c", f"import s3d_jax; print(s3d_jax.decode(s3d_jax.load({str(model)!r}), [1, 2, 3], max_new_tokens=4).tokens)"]}
    result = subprocess.run([sys.executable, *command[how]], capture_output=True, text=True, timeout=600,
                            env={**os.environ, "S3D_JAX_CACHE": str(tmp_path)})
    assert result.returncode == 0, result.stderr
    assert "is not the file its build wrote" in result.stderr and "built the few-row CPU kernel" in result.stderr
