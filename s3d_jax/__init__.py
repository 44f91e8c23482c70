"""s3d-jax: Skippy Simultaneous Speculative Decoding in JAX/Flax."""

import importlib

# Loaded on first use, so that `import s3d_jax.bench` in a transformers-only process (a benchmark
# peer) does not pull in JAX and count its memory against the peer.
_HOMES = {
    "decode": "api",
    "load": "api",
    "logits": "api",
    "stream": "api",
    "DecodeOptions": "options",
    "CheckpointError": "checkpoint",
    "ConfigError": "config",
    "Model": "checkpoint",
    "ModelConfig": "config",
    "calibrate": "calibration",
    "random_model": "shapes",
}

__all__ = sorted(_HOMES)


def __getattr__(name: str):
    if name in _HOMES:
        return getattr(importlib.import_module(f"s3d_jax.{_HOMES[name]}"), name)
    raise AttributeError(f"module 's3d_jax' has no attribute {name!r}")
