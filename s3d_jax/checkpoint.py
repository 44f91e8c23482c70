"""The converted-model format: a directory with the config, an orbax params checkpoint and the tokenizer.

    OUT/s3d_config.json   ModelConfig
    OUT/params/           orbax StandardCheckpointer tree
    OUT/tokenizer.json …  Hugging Face tokenizer files (optional)

Every model directory this project writes (here, by the converter both ways, and by training) is
written whole into a temporary sibling and renamed into place by `atomic_dir`, so a crash midway
leaves the previous directory intact.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import functools
import json
import math
import os
import secrets
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
import tensorstore as ts
from safetensors.numpy import save_file

from s3d_jax import cpu, quant, sharding
from s3d_jax.config import DTYPES, ConfigError, ModelConfig
from s3d_jax.model import abstract_params
from s3d_jax.quant import cast_dtype, cast_params
from s3d_jax.speedup import PassCosts

CONFIG_FILE = "s3d_config.json"
PARAMS_DIR = "params"
# Version of the directory's layout, stored in CONFIG_FILE. 2: vocabulary tables are [D, V] and padded;
# 3: q, k, v and gate, up fused (`model`); 5: quantized weights in the formats `weight_formats` names
# (a GGUF's blocks kept: `quant.Format`). A format-4 directory reads as a format-5 one without them.
FORMAT = 5
READS = (4, 5)


class CheckpointError(ValueError):
    """A checkpoint that is missing, corrupt, or does not match its config."""


@dataclasses.dataclass
class Model:
    """What `s3d_jax.load` returns: params, config and (if known) the tokenizer, the drafter's
    acceptance profile and the pass costs that choose how it drafts."""

    params: Any
    config: ModelConfig
    tokenizer: Any = None
    profile: dict | None = None  # the applied drafter's acceptance profile (`drafter.Drafter.profile`)
    # The model's pass costs on this machine (`calibration`): given here (`model.replace(costs=...)`,
    # `s3d_jax.calibrate`), else decode reads this machine's cached ones or measures them once.
    costs: PassCosts | None = None

    def replace(self, **changes) -> Model:
        return dataclasses.replace(self, **changes)


@dataclasses.dataclass(frozen=True, eq=False)
class LayerStack:
    """A weight of every layer, `[L, ...]`, that is never whole in memory: `save` writes it a layer at a
    time, making layer i's `[...]` with `layer(i)` as it goes (the converter's layer stacks)."""

    shape: tuple[int, ...]
    dtype: np.dtype
    layer: Callable[[int], np.ndarray]

    @property
    def size(self) -> int:  # orbax refuses an empty array by it
        return math.prod(self.shape)


class _StreamingWriter(ocp.type_handlers.NumpyHandler):
    """orbax's writer of host arrays, without its copy of each array (`save` is synchronous: nothing
    changes an array while it is written), and writing `LayerStack`s a layer at a time, every stack
    in step, so that one layer of the model is in memory at once. What it writes reads as any array.
    A layer that cannot be made (a source that turns out corrupt) stops every stack, and `error`
    holds why, for `save` to raise once orbax is done: raised inside orbax, it would be logged with
    orbax's own traceback first."""

    def __init__(self):
        super().__init__(deepcopy_host_arrays=False)
        self.error: Exception | None = None
        self._stacks, self._written, self._step = 0, collections.Counter(), None

    async def serialize(self, values, infos, args=None):
        self._stacks = sum(isinstance(v, LayerStack) for v in values)
        return await super().serialize(values, infos, args)

    async def _open_and_write(self, value, tspec, ts_context):
        if not isinstance(value, LayerStack):
            return await super()._open_and_write(value, tspec, ts_context)
        self._step = self._step or asyncio.Condition()
        stored = None
        for i in range(value.shape[0]):
            if self.error is None:
                try:  # any failure is kept, and raised by `save`: a stack that stopped would leave the others waiting
                    if stored is None:
                        stored = await ts.open(ts.Spec(tspec), create=True, open=True, context=ts_context)
                    layer = np.asarray(value.layer(i), value.dtype)
                    await stored[i].write(layer, can_reference_source_data_indefinitely=True)  # no copy: nothing changes it
                    del layer
                except Exception as e:
                    self.error = e
            async with self._step:  # every stack finishes layer i before any makes layer i + 1
                self._written[i] += 1
                if self._written[i] == self._stacks:
                    # A layer's arrays come from the C heap, and each thread's heap keeps what they free:
                    # without this a conversion's resident memory grows by about half of each layer it writes.
                    cpu.release_freed_memory()
                self._step.notify_all()
                await self._step.wait_for(lambda i=i: self.error is not None or self._written[i] == self._stacks)
            if self.error is not None:
                return


def _save_params(path: Path, params) -> None:
    writer = _StreamingWriter()
    registry = ocp.type_handlers.create_type_handler_registry(
        (LayerStack, writer), (np.ndarray, writer), (jax.Array, ocp.type_handlers.get_type_handler(jax.Array))
    )
    # A stack is stored in chunks of one layer, so writing a layer never reads or holds the rest.
    save_args = jax.tree.map(lambda x: ocp.SaveArgs(shard_axes=(0,)) if isinstance(x, LayerStack) else ocp.SaveArgs(), params)
    # Synchronous, with at most 1 GB of device arrays in flight: an async save copies every array first.
    handler = ocp.PyTreeCheckpointHandler(save_concurrent_gb=1, type_handler_registry=registry)
    with ocp.Checkpointer(handler) as ckptr:
        ckptr.save(path, args=ocp.args.PyTreeSave(params, save_args=save_args))
    if writer.error is not None:
        raise writer.error


def save(path: str | os.PathLike, params, config: ModelConfig, tokenizer=None, overwrite: bool = False) -> Path:
    """Writes a model directory atomically; a non-empty `path` is refused unless `overwrite`, and then
    replaced whole. Leaves may be arrays or `LayerStack`s, which are written a layer at a time."""
    path = Path(path).absolute()
    check_params(params, config)
    with atomic_dir(path, overwrite) as tmp:
        _save_params(tmp / PARAMS_DIR, params)
        (tmp / CONFIG_FILE).write_text(json.dumps({"format": FORMAT, **json.loads(config.to_json())}, indent=2))
        if tokenizer is not None:
            tokenizer.save_pretrained(str(tmp))
    return path


def save_safetensors(tensors: dict, path: str | os.PathLike, metadata: dict[str, str] | None = None) -> None:
    """safetensors' `save_file`, with the permissions any other new file gets (it creates owner-only files)."""
    save_file(tensors, str(path), metadata=metadata)
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(path, 0o666 & ~umask)


def check_target(out: Path, overwrite: bool) -> None:
    """Refuses an output path that is a file, or a non-empty directory unless `overwrite`; even then only
    a model directory (an s3d_jax model, or a transformers export) is replaced, never the current
    directory or one that holds it."""
    if out.exists() and not out.is_dir():
        raise CheckpointError(f"{out} exists and is not a directory; choose another output path")
    if out.is_dir() and any(out.iterdir()):
        if not overwrite:
            raise CheckpointError(f"{out} already exists and is not empty; pass --overwrite (overwrite=True) to replace it whole")
        if out.resolve() in (Path.cwd(), *Path.cwd().parents):
            raise CheckpointError(f"refusing to replace {out}: it is or holds the current directory")
        if not any((out / name).is_file() for name in (CONFIG_FILE, "config.json")):
            raise CheckpointError(f"refusing to replace {out}: it holds no model ({CONFIG_FILE} or config.json), and --overwrite "
                                  "replaces only a model directory; move it aside or choose another output")


@contextlib.contextmanager
def atomic_dir(out: str | os.PathLike, overwrite: bool = False):
    """Yields a new temporary directory beside `out` (same filesystem) to write into. When the block
    completes, the temporary becomes `out`: an old `out` is renamed aside first and removed only after
    the new one is in place. On any error the temporary is removed and `out` is left as it was."""
    out = Path(out).absolute()
    out = out.resolve() if out.is_symlink() else out  # replace what the link points to, not the link
    check_target(out, overwrite)
    out.parent.mkdir(parents=True, exist_ok=True)
    tag = f"{os.getpid()}-{secrets.token_hex(4)}"
    tmp, old = out.with_name(f"{out.name}.tmp-{tag}"), out.with_name(f"{out.name}.old-{tag}")
    tmp.mkdir()
    try:
        yield tmp
        check_target(out, overwrite)  # again: another writer may have finished meanwhile
        if out.is_dir() and any(out.iterdir()):
            out.rename(old)
            try:
                tmp.rename(out)
            except OSError:
                old.rename(out)
                raise
            shutil.rmtree(old)
        else:
            tmp.rename(out)  # replaces an empty directory in one step
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def load_config(path: str | os.PathLike) -> ModelConfig:
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"no converted model at {path}: it is not a directory (convert one with tools/convert_hf.py)")
    if not (path / CONFIG_FILE).exists():
        raise CheckpointError(f"{path} is not an s3d_jax model: {CONFIG_FILE} is missing (convert with tools/convert_hf.py)")
    text = (path / CONFIG_FILE).read_text()
    try:
        fields = json.loads(text)
    except ValueError:
        fields = None  # ModelConfig.from_json names the problem below
    if isinstance(fields, dict):
        stored = fields.pop("format", 1)
        if stored not in READS:
            raise CheckpointError(
                f"{path} holds model format {stored}, and this s3d_jax reads formats {READS[0]} to {READS[-1]}: "
                "convert the model again with tools/convert_hf.py"
            )
        text = json.dumps(fields)
    try:
        return ModelConfig.from_json(text)
    except (ValueError, TypeError) as e:
        raise CheckpointError(f"{path / CONFIG_FILE} is not a valid model config: {e}") from None


def load(path: str | os.PathLike, dtype: str | None = None, mesh: jax.sharding.Mesh | None = None) -> Model:
    """A converted model: its params (cast to `dtype`), config and tokenizer. With a `mesh`, each device
    reads only its own part of each weight (`sharding.shardings`); `sharding.place` finishes the layout.
    A model loaded as another quantized dtype (`quant`) is quantized as it loads (from its float32
    value), and a quantized one loaded as a float dtype is dequantized."""
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"a model path must be a str or os.PathLike, got {type(path).__name__}")
    if dtype is not None and dtype not in DTYPES:
        raise ConfigError(f"unsupported dtype {dtype!r}; supported: {', '.join(DTYPES)}")
    path = Path(path).absolute()
    config = load_config(path)
    wanted = config if dtype is None else config.replace(dtype=dtype)  # ConfigError: a shape that cannot be quantized
    expected = abstract_params(config)
    # Float leaves are read in the float type of what is wanted: a quantized format's is float32.
    read_as = wanted.jnp_dtype if dtype else None
    try:
        with ocp.StandardCheckpointer() as ckptr:
            stored = ckptr.metadata(path / PARAMS_DIR)
            stored = getattr(stored, "item_metadata", stored)
            _check_tree(stored, expected, path)
            # A sharding on the target makes orbax restore device arrays, not numpy copies; a dtype
            # on it casts while reading, so the stored dtype is never held whole beside the new one.
            device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
            placement = jax.tree.map(lambda _: device, expected) if mesh is None else sharding.decode_shardings(expected, config, mesh)
            target = jax.tree.map(lambda x, where: _read_target(x, where, read_as), expected, placement, is_leaf=quant.is_quantized)
            params = ckptr.restore(path / PARAMS_DIR, target)
    except CheckpointError:
        raise
    except Exception as e:  # orbax and tensorstore raise many types for unreadable files.
        raise CheckpointError(f"cannot read the params checkpoint at {path / PARAMS_DIR}: {type(e).__name__}: {e}") from None
    if wanted.quantized and wanted.dtype != config.dtype:
        params = quant.quantize_params(params, wanted.dtype)
    elif config.quantized and not wanted.quantized:
        params = cast_params(quant.dequantize_params(params), wanted.jnp_dtype)
    return Model(params, wanted, load_tokenizer(path))


def _read_target(leaf, sharding, float_dtype):
    """What orbax restores a stored leaf as: float leaves in `float_dtype` (if given); a quantized weight's
    parts as they are stored."""
    if quant.is_quantized(leaf):
        return {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=sharding[k]) for k, v in leaf.items()}
    return jax.ShapeDtypeStruct(leaf.shape, cast_dtype(leaf.dtype, float_dtype) if float_dtype else leaf.dtype, sharding=sharding)


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
