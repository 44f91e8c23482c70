"""Ctrl-C in the command lines: each ends with one clear line and exit code 130, never a traceback."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

import pytest
from test_train import ROOT


def interrupt_when(command: list[str], ready, timeout: float = 600) -> subprocess.CompletedProcess:
    """Runs `command`, sends it SIGINT (Ctrl-C) once `ready(process)` holds, and waits for it to end.

    The command starts as from a terminal, with SIGINT neither ignored nor blocked: a test runner
    started in the background (or a library in its process) may leave either, and a child inherits
    both, so that Ctrl-C would never reach it."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    blocked = signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    try:
        process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
        signal.signal(signal.SIGINT, previous)
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
    # The step that Ctrl-C interrupted (every step logs) is saved: the run loses nothing.
    last_logged = max(json.loads(line)["step"] for line in metrics.read_text().splitlines())
    saved = max(int(d.name) for d in (tmp_path / "run" / "checkpoints").iterdir() if d.name.isdigit())
    assert saved == last_logged
