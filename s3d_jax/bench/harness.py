"""Each engine in a process of its own, so that its peak memory is its own. No JAX: the parent and
the transformers peers import it.

The parent calls `run_engine(command, request)`; the child, `python *command REQUEST RESULT`,
calls `serve(engine, REQUEST, RESULT)`, which writes `engine(request)` as JSON. A child ends with its
parent, however the parent ends (a kill included), so no engine is left decoding on its own.
"""

from __future__ import annotations

import ctypes
import json
import os
import resource
import signal
import subprocess
import sys
import tempfile
from pathlib import Path


class EngineFailed(RuntimeError):
    """An engine's process that ended without writing its result."""

    def __init__(self, command: list[str], returncode: int):
        how = f"died of {signal.Signals(-returncode).name}" if returncode < 0 else f"exited with status {returncode}"
        super().__init__(f"the engine `python {' '.join(command)}` {how} (its own output is above)")
        self.returncode = returncode


def run_engine(command: list[str], request: dict) -> dict:
    """Runs `python *command REQUEST RESULT` on the JSON `request` and returns the result it wrote;
    raises EngineFailed where the process fails."""
    with tempfile.TemporaryDirectory() as scratch:
        request_path, result_path = Path(scratch) / "request.json", Path(scratch) / "result.json"
        request_path.write_text(json.dumps(request))
        env = {**os.environ, PARENT_PID: str(os.getpid())}
        done = subprocess.run([sys.executable, *command, str(request_path), str(result_path)], env=env)
        if done.returncode != 0:
            raise EngineFailed(command, done.returncode)
        return json.loads(result_path.read_text())


PARENT_PID = "S3D_JAX_BENCH_PARENT_PID"
_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def end_with_parent() -> None:
    """On Linux, has the kernel send this process SIGTERM when the process that started it ends. A
    parent that ended before the request was made is caught by comparing its pid with the one
    `run_engine` passed down."""
    if sys.platform != "linux":
        return
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM))
    expected = os.environ.get(PARENT_PID)
    if expected is not None and os.getppid() != int(expected):
        sys.exit(f"the benchmark that started this engine (pid {expected}) has already ended")


def serve(engine, request_path: str, result_path: str) -> int:
    """The child's side of `run_engine`: `engine(request) -> result`, both JSON files."""
    end_with_parent()
    result = engine(json.loads(Path(request_path).read_text()))
    Path(result_path).write_text(json.dumps(result))
    return 0


def _status_mib(field: str) -> float | None:
    """A memory figure of this process from /proc/self/status (Linux), in MiB; None elsewhere."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(f"{field}:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


def peak_rss_mib() -> float:
    """This process's peak resident memory: its own (`VmHWM`, Linux). `ru_maxrss` would do elsewhere,
    but Linux carries it across exec, so a child would report at least its parent's size at the fork."""
    peak = _status_mib("VmHWM")
    return peak if peak is not None else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def rss_mib() -> float:
    """This process's resident memory now (Linux); elsewhere its peak so far."""
    now = _status_mib("VmRSS")
    return now if now is not None else peak_rss_mib()


def export_for_transformers(model_dir: str, out: str) -> str:
    """Writes the model under test as a transformers directory, in a child process so that this one
    stays free of the weights."""
    print("exporting the model to transformers for the peers ...", file=sys.stderr, flush=True)
    subprocess.run([sys.executable, "-m", "s3d_jax.convert", model_dir, out, "--to-hf"], check=True)
    return out
