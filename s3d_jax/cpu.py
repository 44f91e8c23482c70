"""What the CPU backend needs from the process, in one place: for `decoding.compiled`, the heap's
arenas (set when this module is imported), and the heap trim after each decode (`api.decode`,
`api.stream`).

- Compiler options for passes of a few tokens per row: XLA's CPU backend hands dots to the YNNPACK
  library by default, whose kernels are the faster ones for training's products of thousands of rows,
  but for the decode loop's few rows against large weights XLA's own dot emitter is faster (verify
  of 5 tokens about 20% cheaper; docs/cpu.md); and LLVM's level 1 and XLA's elemental fusion
  emitters compile the loop faster at the same speed.
- Freed heap handed back to the OS: XLA's CPU compiler and a checkpoint's load free most of what
  they allocate, but glibc keeps those pages; without `malloc_trim` the compiled S3D loop held about
  200 MiB of freed heap, and ten turns of a benchmark in several prompt buckets 40 MiB (docs/cpu.md).
- Two heap arenas instead of glibc's eight per core: each of XLA's threads otherwise allocates in an
  arena of its own, whose freed pages no other thread reuses; an int4 process decoding ten benchmark
  turns peaked about 30 MiB lower at the same speed (docs/cpu.md, "Memory: heap arenas").
  It has to be set before JAX's CPU client starts its threads, hence on import. A `MALLOC_ARENA_MAX`
  in the environment is glibc's own setting and is left as it is.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os

import jax

# LLVM's optimisation level 1 instead of 2, and XLA's elemental fusion emitters instead of its newer
# MLIR ones: the shipped S3D loop compiles in 1.5-1.9 s instead of 2.4-3.4 s, at the same ms per
# iteration and with the same tokens (docs/cpu.md, "Compile time").
FEW_ROW_OPTIONS = {"xla_cpu_experimental_ynn_fusion_type": "", "xla_backend_optimization_level": 1, "xla_cpu_use_fusion_emitters": False}


@functools.cache
def few_row_compiler_options() -> dict | None:
    """`FEW_ROW_OPTIONS` on a CPU backend whose jaxlib knows them, less any that `XLA_FLAGS` sets (the
    process's own choice wins: the test run's optimisation level, for one); elsewhere None (the defaults)."""
    if jax.default_backend() != "cpu":
        return None
    try:
        jax.jit(lambda x: x + 1).lower(1).compile(FEW_ROW_OPTIONS)
    except Exception:  # a jaxlib without YNNPACK, or with the option renamed: its default dots
        return None
    flags = os.environ.get("XLA_FLAGS", "")
    return {name: value for name, value in FEW_ROW_OPTIONS.items() if f"--{name}=" not in flags}


HEAP_ARENAS = 2
_M_ARENA_MAX = -8  # <malloc.h>


@functools.cache
def glibc():
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None
    return libc if hasattr(libc, "malloc_trim") and hasattr(libc, "mallopt") else None  # glibc's, else no heap settings


def limit_heap_arenas() -> None:
    """Has glibc's allocator use `HEAP_ARENAS` arenas for every thread started from now on (a no-op
    elsewhere, or where `MALLOC_ARENA_MAX` is set)."""
    libc = glibc()
    if libc is not None and "MALLOC_ARENA_MAX" not in os.environ:
        libc.mallopt(_M_ARENA_MAX, HEAP_ARENAS)


def release_freed_memory() -> None:
    """Hands the heap pages that are free back to the OS (glibc's `malloc_trim`; a no-op elsewhere)."""
    libc = glibc()
    if libc is not None:
        libc.malloc_trim(0)


limit_heap_arenas()
