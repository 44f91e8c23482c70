"""Hugging Face model directories: config.json, the weights (safetensors or pytorch_model.bin, each
whole or sharded) and the tokenizer, read into an `HFSource`."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np
from safetensors import safe_open

from s3d_jax import quant
from s3d_jax.checkpoint import CheckpointError

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "vocab.json")


@dataclasses.dataclass
class HFSource:
    """What every source is read into, whatever its format."""

    config: dict[str, Any]  # HF-style config.json
    tensors: Mapping[str, np.ndarray]  # HF tensor names (`model.layers.3.self_attn.q_proj.weight`), torch layouts
    tokenizer: Any  # or None
    path: Path
    # The format (`quant.Format`) that holds each tensor kept as its source's blocks, by HF name, read
    # from the header alone: a GGUF's block types that `quant`'s formats hold exactly.
    kept_formats: Mapping[str, quant.Format] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class GroupedTensor:
    """A tensor a source holds quantized in groups along its input (GGUF's blocks), in HF's `[out, in]`
    orientation: codes and scales (and minimums), each entry worth `code * scale (+ min)`, bit for bit
    the value the source's own dequantization gives. `params_from_hf` keeps them where the model's
    format holds them."""

    codes: np.ndarray  # [out, in]: int8 (8-bit formats), or uint8 0..15 (4 bits)
    scale: np.ndarray  # [out, in / group], float16 or float32
    min: np.ndarray | None  # [out, in / group], the scale's type; always for 4 bits
    format: quant.Format  # the narrowest that holds it exactly
    source_type: str  # as the source names it, e.g. "Q4_K"

    @property
    def shape(self) -> tuple[int, ...]:
        return self.codes.shape

    def rows(self, reorder: Callable[[np.ndarray], np.ndarray]) -> GroupedTensor:
        """The tensor with its rows (outputs) rearranged by `reorder`, which moves whole rows."""
        return dataclasses.replace(self, codes=reorder(self.codes), scale=reorder(self.scale),
                                   min=None if self.min is None else reorder(self.min))

    def dequantized(self) -> np.ndarray:
        groups = self.codes.reshape(*self.scale.shape, -1).astype(np.float32) * self.scale[..., None].astype(np.float32)
        if self.min is not None:
            groups += self.min[..., None].astype(np.float32)
        return groups.reshape(self.shape)


class LazyTensors(Mapping):
    """A read-only name -> numpy array mapping that loads each array only when it is looked up,
    so a big model never sits in memory twice. `rows(name, start, stop)` loads a slice of the rows
    alone, and `shape(name)` is the shape the source's header states.
    `load(name, rows)` reads a tensor's `rows` (a slice)."""

    def __init__(self, names: list[str], load: Callable[[str, slice], np.ndarray], shape: Callable[[str], tuple[int, ...]]):
        self._names = list(names)
        self._known = set(self._names)
        self._load = load
        self._shape = shape

    def shape(self, name: str) -> tuple[int, ...]:
        if name not in self._known:
            raise KeyError(name)
        return tuple(self._shape(name))

    def __getitem__(self, name: str) -> np.ndarray:
        if name not in self._known:
            raise KeyError(name)
        return self._load(name, slice(None))

    def rows(self, name: str, start: int, stop: int) -> np.ndarray:
        if name not in self._known:
            raise KeyError(name)
        return self._load(name, slice(start, stop))

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)


def read_hf_dir(path: Path) -> HFSource:
    config_file = path / "config.json"
    if not config_file.is_file():
        raise CheckpointError(f"{path} is not a Hugging Face model directory: config.json is missing")
    config = _read_json(config_file)
    config["eos_token_id"] = _eos_ids(config, path / "generation_config.json")
    if (path / "model.safetensors.index.json").is_file():
        tensors = _safetensors(path, _shard_map(path / "model.safetensors.index.json"))
    elif (path / "model.safetensors").is_file():
        tensors = _safetensors(path, None)
    elif (path / "pytorch_model.bin.index.json").is_file():
        tensors = _torch_bins(path, _shard_map(path / "pytorch_model.bin.index.json"))
    elif (path / "pytorch_model.bin").is_file():
        tensors = _torch_bins(path, None)
    else:
        raise CheckpointError(
            f"no weights in {path}: expected model.safetensors, model.safetensors.index.json, "
            "pytorch_model.bin or pytorch_model.bin.index.json"
        )
    return HFSource(config, tensors, _tokenizer(path), path)


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"cannot read {path}: {e}") from None


def _eos_ids(config: dict, generation_config: Path) -> list[int]:
    """The union of config.json's and generation_config.json's eos_token_id (each an int or a list)."""
    found = [config.get("eos_token_id")]
    if generation_config.is_file():
        found.append(_read_json(generation_config).get("eos_token_id"))
    ids: list[int] = []
    for eos in found:
        for i in [] if eos is None else [eos] if isinstance(eos, int) else eos:
            if int(i) not in ids:
                ids.append(int(i))
    return ids


def _shard_map(index_file: Path) -> dict[str, str]:
    index = _read_json(index_file)
    weight_map = index.get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        raise CheckpointError(f"{index_file} has no weight_map")
    for shard in sorted(set(weight_map.values())):
        if not (index_file.parent / shard).is_file():
            raise CheckpointError(f"shard {index_file.parent / shard} named in {index_file.name} is missing")
    return weight_map


def _safetensors(path: Path, weight_map: dict[str, str] | None) -> LazyTensors:
    files = sorted(set(weight_map.values())) if weight_map else ["model.safetensors"]
    handles, names, where = {}, [], {}
    for file in files:
        try:
            handles[file] = safe_open(str(path / file), framework="numpy")
            keys = list(handles[file].keys())
        except Exception as e:  # SafetensorError for truncated or garbled files, OSError.
            raise CheckpointError(f"cannot read {path / file}: {e}") from None
        for key in keys:
            if weight_map is None or weight_map.get(key) == file:
                names.append(key)
                where[key] = file
    if weight_map:
        lost = sorted(set(weight_map) - set(where))
        if lost:
            raise CheckpointError(f"{lost[0]} is listed in the index but missing from {path / weight_map[lost[0]]}")

    def load(name: str, rows: slice) -> np.ndarray:
        file = where[name]
        try:
            # A file of its own for each read: the pages of the file's memory map that a read touches
            # stay resident while it is open, the whole checkpoint by the end of a conversion.
            with safe_open(str(path / file), framework="numpy") as f:
                return f.get_tensor(name) if rows == slice(None) else f.get_slice(name)[rows]
        except TypeError:  # older safetensors: numpy has no bfloat16, flax does.
            with safe_open(str(path / file), framework="flax") as f:
                return np.asarray(f.get_slice(name)[rows])
        except Exception as e:
            raise CheckpointError(f"cannot read tensor {name} from {path / file}: {e}") from None

    return LazyTensors(names, load, lambda name: handles[where[name]].get_slice(name).get_shape())


def _torch_bins(path: Path, weight_map: dict[str, str] | None) -> LazyTensors:
    try:
        import torch  # optional: only .bin checkpoints need it
    except ImportError:
        raise CheckpointError(
            f"{path} holds PyTorch weights (pytorch_model.bin), which need torch to read: "
            "install it (pip install torch==2.13.0) or convert the checkpoint to safetensors"
        ) from None
    files = sorted(set(weight_map.values())) if weight_map else ["pytorch_model.bin"]
    shards, names, where = {}, [], {}
    for file in files:
        try:
            try:
                shards[file] = torch.load(path / file, map_location="cpu", weights_only=True, mmap=True)
            except RuntimeError as e:
                if "mmap" not in str(e):
                    raise
                shards[file] = torch.load(path / file, map_location="cpu", weights_only=True)  # pre-zip format
        except Exception as e:
            raise CheckpointError(f"cannot read {path / file}: {type(e).__name__}: {e}") from None
        if not isinstance(shards[file], dict):
            raise CheckpointError(f"{path / file} does not hold a state dict")
        for key in shards[file]:
            if weight_map is None or weight_map.get(key) == file:
                names.append(key)
                where[key] = file

    def load(name: str, rows: slice) -> np.ndarray:
        t = shards[where[name]][name].detach()[rows]
        if t.dtype == torch.bfloat16:  # numpy has no bfloat16; the widening is exact.
            t = t.float()
        return t.numpy()

    return LazyTensors(names, load, lambda name: shards[where[name]][name].shape)


def _tokenizer(path: Path):
    if not any((path / f).is_file() for f in TOKENIZER_FILES):
        return None
    from transformers import AutoTokenizer  # heavy: only sources with a tokenizer pay for it

    try:
        return AutoTokenizer.from_pretrained(str(path))
    except Exception as e:
        raise CheckpointError(f"cannot load the tokenizer in {path}: {type(e).__name__}: {e}") from None
