"""What `s3d_jax.cpu` sets in the process: glibc's heap arenas, and the decode loop's compiler options."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from s3d_jax import cpu

_COUNT_HEAPS = """
import ctypes, os, re, sys, tempfile
from concurrent.futures import ThreadPoolExecutor
if sys.argv[1] == "s3d_jax":
    import s3d_jax.api
import jax.numpy as jnp
with ThreadPoolExecutor(8) as pool:  # threads that allocate at once: glibc gives each an arena of its own
    list(pool.map(lambda i: float((jnp.ones((128, 128)) * i).sum()), range(32)))
libc = ctypes.CDLL("libc.so.6")
libc.fopen.restype = ctypes.c_void_p
path = os.path.join(tempfile.mkdtemp(), "malloc_info.xml")
out = ctypes.c_void_p(libc.fopen(path.encode(), b"w"))
libc.malloc_info(0, out)
libc.fclose(out)
print(len(re.findall("<heap nr=", open(path).read())))
"""


@pytest.mark.skipif(cpu.glibc() is None, reason="glibc's heap arenas")
def test_importing_s3d_jax_limits_the_heap_arenas():
    """Imported before JAX starts its threads, s3d_jax has glibc share `cpu.HEAP_ARENAS` heaps among
    them; without it the same threads make one each (the peak memory of a quantized model, docs/cpu.md)."""
    env = {k: v for k, v in os.environ.items() if k != "MALLOC_ARENA_MAX"}

    def heaps(imports: str) -> int:
        child = subprocess.run([sys.executable, "-c", _COUNT_HEAPS, imports], env=env, check=True, capture_output=True, text=True)
        return int(child.stdout)

    assert heaps("jax alone") > cpu.HEAP_ARENAS
    assert heaps("s3d_jax") <= cpu.HEAP_ARENAS


def test_an_option_that_xla_flags_sets_is_left_to_it(monkeypatch):
    """The decode loop's CPU options yield to the process's own `XLA_FLAGS`, option by option (the test
    run sets LLVM's level there, `reference.TEST_XLA_FLAGS`)."""
    def options(flags: str):
        monkeypatch.setenv("XLA_FLAGS", flags)
        cpu.few_row_compiler_options.cache_clear()
        try:
            return cpu.few_row_compiler_options()
        finally:
            cpu.few_row_compiler_options.cache_clear()

    if options("") is None:
        pytest.skip("not a CPU, or this jaxlib has no YNNPACK fusions")
    assert options("") == cpu.FEW_ROW_OPTIONS
    unset = {k: v for k, v in cpu.FEW_ROW_OPTIONS.items() if k != "xla_backend_optimization_level"}
    assert options("--xla_backend_optimization_level=0") == unset
