"""s3d-jax: Skippy Simultaneous Speculative Decoding in JAX/Flax."""

from s3d_jax.api import decode, load, logits, stream
from s3d_jax.checkpoint import Model
from s3d_jax.config import ModelConfig

__all__ = ["Model", "ModelConfig", "decode", "load", "logits", "stream"]
