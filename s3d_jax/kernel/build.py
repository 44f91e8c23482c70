"""Building the kernel's C++ files (`cc/`) with the machine's C++ compiler on first use
(`-march=native`; a line on stderr says so and how long it took), side by side on the usable cores,
into one library in `<cache root>/kernels/`, keyed on everything the binary depends on, and checked
against its recorded digest before every load: a truncated or foreign file is rebuilt. The helper
threads' settings are read here too (docs/cpu.md):
- `S3D_JAX_FEW_ROW_THREADS`: the threads sharing a product, read once per process; by default the
  CPUs this process may run on, at most 8 (more add no bandwidth).
- `S3D_JAX_FEW_ROW_SPIN_US`: how long a helper thread spins after a product before it sleeps, read
  once per process (default 50 µs).
"""

from __future__ import annotations

import concurrent.futures
import functools
import hashlib
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import jax
import jaxlib

from s3d_jax.paths import cache_root
from s3d_jax.settings import env_setting, usable_cores

SOURCES = Path(__file__).with_name("cc")  # its .cc files, each compiled alone, and the headers they share
FLAGS = ["-O3", "-march=native", "-ffp-contract=fast", "-std=c++20", "-fPIC"]
ENV_THREADS = "S3D_JAX_FEW_ROW_THREADS"
ENV_SPIN = "S3D_JAX_FEW_ROW_SPIN_US"
DEFAULT_MAX_THREADS = 8
# Helpers spin this long after a product before sleeping: the products of one pass come a few
# microseconds apart; a longer spin is no faster and keeps a core busy (docs/cpu.md, "Helper threads").
DEFAULT_SPIN_MICROSECONDS = 50


def threads() -> int:
    """`S3D_JAX_FEW_ROW_THREADS`, else the CPUs this process may use, at most `DEFAULT_MAX_THREADS`."""
    return env_setting(ENV_THREADS, max(1, min(DEFAULT_MAX_THREADS, usable_cores())), 1)


def spin_microseconds() -> int:
    return env_setting(ENV_SPIN, DEFAULT_SPIN_MICROSECONDS, 0)


def _compiler() -> list[str]:
    return [os.environ.get("CXX", "c++")]


@functools.cache
def _compiler_version() -> str:
    try:
        return subprocess.run([*_compiler(), "--version"], capture_output=True, text=True).stdout.strip()
    except OSError:
        return ""


@functools.cache
def build_id() -> str:
    """What the binary depends on, hashed: these sources, built by this compiler for this CPU and this jaxlib.
    Pass costs measured with one build are measured again with another (`calibration`)."""
    cpu = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else platform.processor()
    cpu_flags = next((line for line in cpu.splitlines() if line.startswith("flags")), cpu)
    sources = [f"{p.name}\n{p.read_text()}" for p in sorted(SOURCES.iterdir()) if p.suffix in (".cc", ".h")]
    parts = [*sources, " ".join(FLAGS), jaxlib.__version__, _compiler_version(), platform.machine(), cpu_flags]
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:16]


def library_path() -> Path:
    return cache_root() / "kernels" / f"few_rows-{build_id()}.so"


def notice(text: str) -> None:
    """A line on stderr for what happens once per machine, like a progress bar: not a warning."""
    print(f"s3d_jax: {text}", file=sys.stderr, flush=True)


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _digest_path(library: Path) -> Path:
    return library.with_name(library.name + ".sha256")


def intact(library: Path) -> bool:
    """Whether `library` is the file a build wrote: its digest matches the one recorded beside it."""
    recorded = _digest_path(library)
    return library.is_file() and recorded.is_file() and recorded.read_text().strip() == _digest(library)


def _write_durably(path: Path, data: bytes | None = None) -> None:
    """Writes `data` to `path` (or only flushes `path`) and fsyncs it, so a crash cannot leave it short."""
    with open(path, "r+b" if data is None else "wb") as f:
        if data is not None:
            f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _run(command: list[str]) -> None:
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode:
        raise RuntimeError(f"`{' '.join(command)}` failed:\n{result.stderr[-2000:]}")


def build(path: Path) -> None:
    """Compiles the kernel's files, as many at a time as this process has cores (about 40 s of one
    core in all), links them to `path` and records its digest beside it. Both are written under
    temporary names, synced, then renamed, so a crash or a concurrent first use leaves no short
    file; a digest that does not match (a crash between the renames) only causes a rebuild."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
    sources = sorted(SOURCES.glob("*.cc"))
    notice(f"building the few-row CPU kernel for this machine (once), into {path.parent}")
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(dir=path.parent) as scratch:
        objects = [str(Path(scratch) / f"{source.stem}.o") for source in sources]
        compiles = [[*_compiler(), *FLAGS, f"-I{jax.ffi.include_dir()}", "-c", str(source), "-o", obj]
                    for source, obj in zip(sources, objects)]
        with concurrent.futures.ThreadPoolExecutor(min(len(compiles), usable_cores())) as pool:
            list(pool.map(_run, compiles))  # the first failure, with its compiler's message
        _run([*_compiler(), "-shared", *objects, "-o", str(tmp)])
    _write_durably(tmp)
    digest_tmp = _digest_path(tmp)
    _write_durably(digest_tmp, _digest(tmp).encode())
    tmp.replace(path)
    digest_tmp.replace(_digest_path(path))
    notice(f"built the few-row CPU kernel in {time.perf_counter() - start:.1f} s")


def built_library() -> Path:
    """The library for this machine, built now if it is missing or not the file a build wrote."""
    path = library_path()
    if not intact(path):
        if path.exists():
            notice(f"{path} is not the file its build wrote (truncated, replaced, or without its digest); rebuilding it")
        build(path)
    return path
