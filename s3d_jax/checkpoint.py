"""The converted-model format: a directory with the config, an orbax params checkpoint and the tokenizer.

    OUT/s3d_config.json   ModelConfig
    OUT/params/           orbax StandardCheckpointer tree
    OUT/tokenizer.json …  Hugging Face tokenizer files (optional)
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import shutil
from pathlib import Path
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp

from s3d_jax.config import DTYPES, ConfigError, ModelConfig
from s3d_jax.model import abstract_params

CONFIG_FILE = "s3d_config.json"
PARAMS_DIR = "params"
# Version of the directory's layout, stored in CONFIG_FILE. 2: vocabulary tables are [D, V] and padded.
FORMAT = 2


class CheckpointError(ValueError):
    """A checkpoint that is missing, corrupt, or does not match its config."""


@dataclasses.dataclass
class Model:
    """What `s3d_jax.load` returns: params, config and (if known) the tokenizer."""

    params: Any
    config: ModelConfig
    tokenizer: Any = None


def save(path: str | os.PathLike, params, config: ModelConfig, tokenizer=None) -> Path:
    path = Path(path).absolute()
    check_params(params, config)
    path.mkdir(parents=True, exist_ok=True)
    if (path / PARAMS_DIR).exists():
        shutil.rmtree(path / PARAMS_DIR)
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(path / PARAMS_DIR, params)
    (path / CONFIG_FILE).write_text(json.dumps({"format": FORMAT, **json.loads(config.to_json())}, indent=2))
    if tokenizer is not None:
        tokenizer.save_pretrained(str(path))
    return path


def load_config(path: str | os.PathLike) -> ModelConfig:
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"no converted model at {path}: it is not a directory (convert one with tools/convert_hf.py)")
    if not (path / CONFIG_FILE).exists():
        raise CheckpointError(f"{path} is not an s3d_jax model: {CONFIG_FILE} is missing (convert with tools/convert_hf.py)")
    try:
        fields = json.loads((path / CONFIG_FILE).read_text())
        stored = fields.pop("format", 1) if isinstance(fields, dict) else None
    except ValueError as e:
        raise CheckpointError(f"{path / CONFIG_FILE} is not valid JSON: {e}") from None
    if stored != FORMAT:
        raise CheckpointError(
            f"{path} holds model format {stored}, and this s3d_jax reads format {FORMAT}: convert the model again with tools/convert_hf.py"
        )
    try:
        return ModelConfig.from_json(json.dumps(fields))
    except (ValueError, TypeError) as e:
        raise CheckpointError(f"{path / CONFIG_FILE} is not a valid model config: {e}") from None


def load(path: str | os.PathLike, dtype: str | None = None) -> Model:
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"a model path must be a str or os.PathLike, got {type(path).__name__}")
    if dtype is not None and dtype not in DTYPES:
        raise ConfigError(f"unsupported dtype {dtype!r}; supported: {', '.join(DTYPES)}")
    path = Path(path).absolute()
    config = load_config(path)
    expected = abstract_params(config)
    try:
        with ocp.StandardCheckpointer() as ckptr:
            stored = ckptr.metadata(path / PARAMS_DIR)
            stored = getattr(stored, "item_metadata", stored)
            _check_tree(stored, expected, path)
            # A sharding on the target makes orbax restore device arrays, not numpy copies.
            device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
            target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=device), expected)
            params = ckptr.restore(path / PARAMS_DIR, target)
    except CheckpointError:
        raise
    except Exception as e:  # orbax and tensorstore raise many types for unreadable files.
        raise CheckpointError(f"cannot read the params checkpoint at {path / PARAMS_DIR}: {type(e).__name__}: {e}") from None
    if dtype is not None and dtype != config.dtype:
        config = config.replace(dtype=dtype)
        params = jax.tree.map(lambda x: x.astype(config.jnp_dtype), params)
    return Model(params, config, load_tokenizer(path))


def load_tokenizer(path: Path):
    """The tokenizer saved beside a model, or None. A `tokenizer.json` loads as a fast tokenizer
    directly: `AutoTokenizer` would import PyTorch when it is installed, some 250 MB of memory."""
    if (path / "tokenizer.json").exists():
        from transformers import PreTrainedTokenizerFast as tokenizer_class
    elif (path / "tokenizer_config.json").exists():
        from transformers import AutoTokenizer as tokenizer_class
    else:
        return None
    try:
        return tokenizer_class.from_pretrained(str(path))
    except Exception as e:  # tokenizers and transformers raise many types for unreadable files
        raise CheckpointError(f"cannot read the tokenizer at {path}: {type(e).__name__}: {e}") from None


def check_params(params, config: ModelConfig) -> None:
    """Raises CheckpointError naming the first parameter whose shape or dtype disagrees with the config."""
    _check_tree(params, _abstract_params(config), "params")


_abstract_params = functools.lru_cache(maxsize=8)(abstract_params)  # tracing the init takes a second


def _check_tree(actual, expected, where) -> None:
    flat_actual = {jax.tree_util.keystr(k): v for k, v in jax.tree_util.tree_leaves_with_path(actual)}
    flat_expected = {jax.tree_util.keystr(k): v for k, v in jax.tree_util.tree_leaves_with_path(expected)}
    missing = sorted(set(flat_expected) - set(flat_actual))
    extra = sorted(set(flat_actual) - set(flat_expected))
    if missing or extra:
        raise CheckpointError(
            f"{where} does not match the model config: missing {missing[:5]}, unexpected {extra[:5]}"
        )
    for name, want in flat_expected.items():
        got = flat_actual[name]
        if tuple(got.shape) != tuple(want.shape):
            raise CheckpointError(f"{where}: parameter {name} has shape {tuple(got.shape)}, the config implies {tuple(want.shape)}")
        if np.dtype(got.dtype) != np.dtype(want.dtype):
            raise CheckpointError(f"{where}: parameter {name} has dtype {got.dtype}, the config says {want.dtype}")
