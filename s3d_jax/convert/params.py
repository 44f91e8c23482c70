"""HF-named weights into this project's params tree, in the config's precision: `params_from_hf`.

Every name, and every shape the source's header states, is checked before any data is read. The
weights outside the layers are read then; each layer stack is a `checkpoint.LayerStack`, whose layers
are read, converted and joined (`layout`'s rules) only as `checkpoint.save` writes them, so a model is
never whole in memory. A quantized dtype quantizes each weight as it is read; a GGUF's blocks
(`GroupedTensor`) are kept as they are wherever the model's format holds them (`kept_formats`).
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Mapping
from typing import NamedTuple

import jax
import numpy as np
from flax.traverse_util import flatten_dict, unflatten_dict
from tqdm.auto import tqdm

from s3d_jax import quant
from s3d_jax.checkpoint import CheckpointError, LayerStack
from s3d_jax.config import ModelConfig
from s3d_jax.convert.layout import IGNORED, VOCAB_TABLE, Rule, hf_names_for, join_parts, match_rule, split_parts, unstack_layers
from s3d_jax.convert.readers import GroupedTensor, LazyTensors
from s3d_jax.model import abstract_params

VOCAB_ROWS_PER_READ = 8192  # a vocabulary table is read and converted this many rows at a time


def params_from_hf(tensors: Mapping[str, np.ndarray | GroupedTensor], config: ModelConfig, progress: bool = False) -> dict:
    """Maps HF-named weights to a params tree in the config's dtype. Every name, and every shape the
    source's header states, is checked first (`_check_names`); then the weights outside the layers are
    read, and each layer stack is a `checkpoint.LayerStack` whose layers are read, converted and
    joined only as `checkpoint.save` writes them, so the model is never whole in memory. For a
    quantized dtype each weight is quantized as it is read, so it is never held in float; a source's
    own groups (`GroupedTensor`) are kept as they are where they are the format wanted, and
    dequantized and quantized again where they are not."""
    fused_expected = flatten_dict(abstract_params(config), sep="/", is_leaf=lambda _, node: quant.is_quantized(node))
    expected = jax.eval_shape(lambda tree: split_parts(unstack_layers(tree), config), fused_expected)  # the parts the rules name
    by_layer = _check_names(tensors, config, expected)
    requantized: dict[str, dict[str, list[float]]] = {}  # source block type -> weight -> [error², value²]

    def read(names: list[str]) -> dict:
        flat = {}
        for name in names:
            rule, layer = match_rule(name, config)
            targets, (rows, *rest) = [t.format(i=layer) for t in rule.targets], rule.hf_shape(config)
            # A vocabulary table in slices of its rows, so that neither its float copy nor a grouped
            # source's scales spread over their entries is ever whole; every other weight is one layer's.
            step = VOCAB_ROWS_PER_READ if rule.params[0][1] is VOCAB_TABLE else rows
            for start in range(0, rows, step):
                w = _read_rows(tensors, name, start, min(start + step, rows)) if step < rows else tensors[name]
                if tuple(w.shape) != (min(step, rows - start), *rest):
                    shape = tuple(w.shape) if step == rows else (rows, *w.shape[1:])
                    raise CheckpointError(f"tensor {name} has shape {shape}, but the config implies {rule.hf_shape(config)}")
                for target, out in zip(targets, _from_hf(rule, w, config), strict=True):
                    part = _in_format(out, target, config)
                    _count_requantized(requantized, target, out, part, config)
                    if step == rows:
                        flat[target] = part
                    else:  # our tables are [D, V]: a slice of the source's rows is a slice of our columns
                        flat.setdefault(target, jax.tree.map(lambda x: np.empty(x.shape, x.dtype), expected[target]))
                        jax.tree.map(lambda whole, p, at=slice(start, start + step): whole.__setitem__((..., at), p), flat[target], part)
                del w
            for target in targets:
                assert jax.tree.map(np.shape, flat[target]) == jax.tree.map(np.shape, expected[target]), (name, target)
        return flat

    bar = tqdm(total=config.num_layers, desc="converting", unit="layer", disable=not progress)

    @functools.lru_cache(maxsize=1)  # the stacks write in step (`LayerStack`): each layer is read once
    def layer(i: int) -> dict:
        prefix = f"layer_{i}/"
        joined = {path.removeprefix(prefix): w for path, w in join_parts(read(by_layer.get(str(i), [])), config).items()}
        bar.update()
        if i == config.num_layers - 1:
            bar.close()
            _warn_requantized(requantized, config)
        return joined

    def stack(name: str, want):  # a quantized weight's values, scale and min are stacks of their own
        if quant.is_quantized(want):
            return {key: LayerStack(part.shape, part.dtype, lambda i, key=key: layer(i)[name][key]) for key, part in want.items()}
        return LayerStack(want.shape, want.dtype, lambda i: layer(i)[name])

    top = join_parts(read(by_layer.get(None, [])), config)
    stacks = {path: stack(path.removeprefix("layers/"), want) for path, want in fused_expected.items() if path.startswith("layers/")}
    return unflatten_dict({**top, **stacks}, sep="/")


def _check_names(tensors: Mapping, config: ModelConfig, expected: Mapping) -> dict[str | None, list[str]]:
    """The source's tensor names by layer (None: outside the layers), once each is known to set
    weights of this config, none twice, with nothing missing, and (where the source states shapes
    without reading the data: `LazyTensors.shape`) the shape the config implies."""
    by_layer: dict[str | None, list[str]] = {}
    source_of: dict[str, str] = {}
    for name in tensors:
        if any(p.fullmatch(name) for p in IGNORED) or (name == "lm_head.weight" and config.tie_embeddings):
            continue
        found = match_rule(name, config)
        if found is None:
            raise CheckpointError(f"unexpected tensor {name}: no {config.architecture} weight has this name")
        rule, layer = found
        if layer is not None and int(layer) >= config.num_layers:
            raise CheckpointError(f"unexpected tensor {name}: the config has only {config.num_layers} layers")
        shape = tensors.shape(name) if isinstance(tensors, LazyTensors) else None
        if shape is not None and tuple(shape) != rule.hf_shape(config):
            raise CheckpointError(f"tensor {name} has shape {tuple(shape)}, but the config implies {rule.hf_shape(config)}")
        for target in rule.targets:
            target = target.format(i=layer)
            if target in source_of:
                raise CheckpointError(f"tensor {name} sets {target}, which {source_of[target]} already set")
            source_of[target] = name
        by_layer.setdefault(layer, []).append(name)
    missing = [t for t in expected if t not in source_of]
    if missing:
        raise CheckpointError(f"missing weight {hf_names_for(missing[0], config)} (needed for {missing[0]})")
    return by_layer


def _read_rows(tensors: Mapping, name: str, start: int, stop: int):
    return tensors.rows(name, start, stop) if isinstance(tensors, LazyTensors) else tensors[name][start:stop]


def _count_requantized(requantized: dict, target: str, out, converted, config: ModelConfig) -> None:
    """Adds the rounding error of a grouped source's part that was quantized again rather than kept."""
    if not (isinstance(out, _Spread) and quant.is_quantized(converted)) or _holds(target, out.format, config):
        return
    error = np.asarray(quant.dequantize(converted, quant.QUANTIZED_INPUTS[target.rsplit("/", 1)[-1]])) - out.float32()
    sums = requantized.setdefault(out.source_type, {}).setdefault(target, [0.0, 0.0])
    sums[0] += float(np.sum(error.astype(np.float64) ** 2))
    sums[1] += float(np.sum(out.float32().astype(np.float64) ** 2))


def _warn_requantized(requantized: Mapping[str, Mapping[str, list[float]]], config: ModelConfig) -> None:
    for kind, weights in requantized.items():  # the nearest format, with the error it costs
        errors = [np.sqrt(error / max(value, 1e-30)) for error, value in weights.values()]
        warnings.warn(f"{len(errors)} {kind} weights are not {config.dtype}'s blocks: quantized again from their values, "
                      f"relative RMS rounding error {np.mean(errors):.2%} on average, {max(errors):.2%} at most", stacklevel=3)


class _Spread(NamedTuple):
    """A grouped tensor's part for one target, in our layout, its scales repeated over their groups."""

    codes: np.ndarray
    scale: np.ndarray
    min: np.ndarray | None
    format: quant.Format
    source_type: str

    def float32(self) -> np.ndarray:
        value = self.codes.astype(np.float32) * self.scale.astype(np.float32)
        return value if self.min is None else value + self.min.astype(np.float32)


def _from_hf(rule: Rule, w: np.ndarray | GroupedTensor, config: ModelConfig) -> tuple:
    """`rule.from_hf`; a grouped tensor's codes, scales and minimums each take the weight's layout."""
    if not isinstance(w, GroupedTensor):
        return rule.from_hf(w, config)
    none = (None,) * len(rule.targets)
    scale, low = (none if a is None else rule.from_hf(np.repeat(a, w.format.group, axis=1), config) for a in (w.scale, w.min))
    return tuple(_Spread(*parts, w.format, w.source_type) for parts in zip(rule.from_hf(w.codes, config), scale, low, strict=True))


def _holds(target: str, fmt: quant.Format, config: ModelConfig) -> bool:
    """Whether the model's format of `target` holds every value of format `fmt` exactly."""
    own = quant.format_for(config, target.rsplit("/", 1)[-1])
    return fmt.widest(own) == own


def _in_format(out: np.ndarray | _Spread, target: str, config: ModelConfig):
    """A target's array in the config's format: its float type, or quantized (`quant`), with a
    source's groups kept where that format holds them (wider codes, finer groups, float32 scales
    are exact) and requantized from float32 where not."""
    name = target.rsplit("/", 1)[-1]
    if not (config.quantized and name in quant.QUANTIZED_INPUTS):
        return np.ascontiguousarray(out.float32() if isinstance(out, _Spread) else out, dtype=config.jnp_dtype)
    n_in, fmt = quant.QUANTIZED_INPUTS[name], quant.format_for(config, name)
    if not (isinstance(out, _Spread) and _holds(target, out.format, config)):
        return quant.quantize(np.ascontiguousarray(out.float32() if isinstance(out, _Spread) else out, np.float32), n_in, fmt)
    once = (slice(None),) * (n_in - 1) + (slice(None, None, fmt.group),)  # one entry per group
    scale = out.scale[once].astype(fmt.scale_dtype)
    if fmt.bits == 4:
        kept = {"values": quant.pack_nibbles(out.codes, n_in), "scale": scale, "min": out.min[once].astype(fmt.scale_dtype)}
    else:
        kept = {"values": out.codes.astype(np.int8), "scale": scale}  # 4-bit codes 0..15 widen exactly
        if fmt.min:
            kept["min"] = np.zeros_like(scale) if out.min is None else out.min[once].astype(np.float32)
    return {k: np.ascontiguousarray(v) for k, v in kept.items()}


def kept_formats(source_formats: Mapping[str, quant.Format], config: ModelConfig) -> tuple[tuple[str, str], ...]:
    """The `weight_formats` of a quantized model that holds a source's blocks exactly: per weight, the
    narrowest format that holds each of its tensors' kept formats (`HFSource.kept_formats`) and has
    the dtype's bits at least (vocabulary tables 8). A weight with no kept tensor takes the dtype's format."""
    formats: dict[str, quant.Format] = {}
    for hf, fmt in source_formats.items():
        found = match_rule(hf, config)
        if found is None:
            continue
        for target in found[0].targets:
            part = target.rsplit("/", 1)[-1]
            if part in quant.QUANTIZED_INPUTS:
                name = quant.FUSED_INTO.get(part, part)
                formats[name] = formats[name].widest(fmt) if name in formats else fmt
    if config.dtype == "int8":
        formats = {name: fmt.widest(quant.INT8) for name, fmt in formats.items()}
    formats = {name: fmt.widest(quant.INT8) if name in quant.VOCABULARY_TABLES else fmt for name, fmt in formats.items()}
    return tuple((name, fmt.name) for name, fmt in sorted(formats.items()) if fmt != quant.format_for(config, name))
