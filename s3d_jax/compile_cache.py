"""JAX's persistent compilation cache, turned on by `s3d_jax.load`: a second process loads the decode
loop's executables from disk instead of compiling them again. That is faster (1.2-1.4 s against
5.3-5.8 s for the S3D loop of the bundled model on a 2-core CPU) and costs no memory beyond
plain decoding's, where compiling the loop's three kinds of iteration takes 300-400 MiB more at its
peak (docs/cpu.md, "Memory: the compile and the persistent cache").

The cache lives beside the converted models, in `<cache root>/xla` (the root is `$S3D_JAX_CACHE`,
else `$XDG_CACHE_HOME/s3d_jax` or `~/.cache/s3d_jax`). A directory already set through
`JAX_COMPILATION_CACHE_DIR` is kept; `S3D_JAX_COMPILE_CACHE=0` leaves JAX's setting alone.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import jax

from s3d_jax.paths import cache_root
from s3d_jax.settings import env_switch

ENV_SWITCH = "S3D_JAX_COMPILE_CACHE"

# Low enough that the decode loop and prefill are cached, even small ones on a fast accelerator;
# high enough that the many tiny helper computations are not written out one file each.
MIN_COMPILE_SECONDS = 0.1


def directory() -> Path:
    """Where `enable()` puts the cache by default: `xla` beside the converted bundled model."""
    return cache_root() / "xla"


def enable(path: str | os.PathLike | None = None) -> Path | None:
    """Turns on the persistent compilation cache; returns its directory, or None if it cannot be
    created or `S3D_JAX_COMPILE_CACHE` is off (decoding then simply compiles in each process)."""
    if not env_switch(ENV_SWITCH):
        return None
    if path is None and jax.config.jax_compilation_cache_dir:
        return Path(jax.config.jax_compilation_cache_dir)
    path = Path(path) if path is not None else directory()
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError:
        return None
    jax.config.update("jax_compilation_cache_dir", str(path))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", MIN_COMPILE_SECONDS)
    return path


@contextlib.contextmanager
def keeping_every_compile():
    """Inside (a `with` block or a decorated function), a compile is written to the cache however quick
    it was: for the few computations that every load runs once (a drafter's mask row, its draft head),
    so that a warm process compiles nothing. A compile, even a tiny one, brings some 24 MiB of the
    compiler's own code into memory, which decoding from the cache never touches (docs/cpu.md,
    "Memory: applying a drafter")."""
    before = jax.config.jax_persistent_cache_min_compile_time_secs
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    try:
        yield
    finally:
        jax.config.update("jax_persistent_cache_min_compile_time_secs", before)
