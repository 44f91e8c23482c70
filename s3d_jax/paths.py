"""Where s3d_jax keeps what it makes once per machine: the converted bundled model, the persistent
compilation cache and the few-row kernel. The bottom of the package: it imports nothing of it."""

from __future__ import annotations

import os
from pathlib import Path

ENV_CACHE = "S3D_JAX_CACHE"


def cache_root() -> Path:
    """`$S3D_JAX_CACHE`, else `$XDG_CACHE_HOME/s3d_jax` or `~/.cache/s3d_jax`. A path that exists and
    is not a directory is refused before anything is written under it."""
    chosen = os.environ.get(ENV_CACHE)
    root = Path(chosen) if chosen else Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "s3d_jax"
    if root.exists() and not root.is_dir():
        where = f"{ENV_CACHE}={chosen}" if chosen else str(root)
        raise ValueError(f"the s3d_jax cache {where} is a file, not a directory: point {ENV_CACHE} at a directory")
    return root
