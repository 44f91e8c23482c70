"""JAX's persistent compilation cache for the command lines: a second run loads the decode loop's
executables from disk instead of compiling them again.

The cache lives beside the converted models, in `<cache root>/xla` (the root is `$S3D_JAX_CACHE`,
else `$XDG_CACHE_HOME/s3d_jax` or `~/.cache/s3d_jax`). A directory already set through
`JAX_COMPILATION_CACHE_DIR` is kept. Call `enable()` in a main before anything compiles.
"""

from __future__ import annotations

import os
from pathlib import Path

import jax

from s3d_jax.paths import cache_root

# Low enough that the decode loop and prefill are cached, even small ones on a fast accelerator;
# high enough that the many tiny helper computations are not written out one file each.
MIN_COMPILE_SECONDS = 0.1


def directory() -> Path:
    """Where `enable()` puts the cache by default: `xla` beside the converted bundled model."""
    return cache_root() / "xla"


def enable(path: str | os.PathLike | None = None) -> Path | None:
    """Turns on the persistent compilation cache; returns its directory, or None if it cannot be
    created (decoding then simply compiles as before)."""
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
