"""Converts a Hugging Face model directory or a GGUF file (llama, qwen2, qwen3, gemma2, gemma3) into an s3d_jax
model directory, and back.

    python -m s3d_jax.convert SRC OUT [--dtype float32|bfloat16|float16|int8|int4] [--quiet] [--overwrite]   (or tools/convert_hf.py)
    python -m s3d_jax.convert MODEL HF_OUT --to-hf      # back to transformers, e.g. a trained drafter

OUT is written whole into a temporary sibling and renamed into place. A non-empty OUT is refused
unless `--overwrite`, which replaces it whole (the old directory goes only once the new one is complete).

The steps, one module each:
  readers.py, gguf_file.py  every source is read into the same `HFSource`: an HF-style config dict,
                            lazy HF-named tensors (loaded one at a time, or a slice of rows; a GGUF's
                            blocks kept as they are for a quantized dtype) and the tokenizer, or None;
  layout.py                 one table of rules maps HF tensor names to this project's params tree and
                            back, checking every weight against the shape the config implies;
  params.py                 the weights into the params tree in the config's precision, the layer
                            stacks made a layer at a time as `checkpoint.save` writes them, so a
                            conversion holds about one layer (docs/models.md, "Conversion memory");
  mask_row.py               S3D's mask token gets an embedding row;
  export.py                 a model back to a transformers directory.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import jax

from s3d_jax import checkpoint
from s3d_jax.checkpoint import CheckpointError
from s3d_jax.config import DTYPES, QUANTIZED_DTYPES, ConfigError, ModelConfig
from s3d_jax.convert.export import config_to_hf, export_hf
from s3d_jax.convert.gguf_file import read_gguf
from s3d_jax.convert.layout import params_to_hf
from s3d_jax.convert.mask_row import add_mask_row, mask_row_plan, pad_vocab, reserved_token_id
from s3d_jax.convert.params import kept_formats, params_from_hf
from s3d_jax.convert.readers import HFSource, read_hf_dir
from s3d_jax.model import abstract_params

__all__ = [
    "HFSource",
    "add_mask_row",
    "config_to_hf",
    "convert",
    "export_hf",
    "main",
    "mask_row_plan",
    "params_from_hf",
    "params_to_hf",
    "read_source",
]


def read_source(src: str | Path, keep_groups: bool = False) -> HFSource:
    """Reads an HF model directory (or its config.json), or a GGUF file (with `keep_groups`, its
    quantized blocks as they are: `read_gguf`)."""
    src = Path(src)
    if src.is_dir():
        return read_hf_dir(src)
    if src.is_file():
        if src.name == "config.json":
            return read_hf_dir(src.parent)
        if src.suffix == ".gguf" or _starts_with(src, b"GGUF"):
            return read_gguf(src, keep_groups)
        raise CheckpointError(f"{src} is neither a GGUF file nor a Hugging Face model directory")
    raise CheckpointError(f"no model at {src}: no such file or directory")


def _starts_with(path: Path, magic: bytes) -> bool:
    with open(path, "rb") as f:
        return f.read(len(magic)) == magic


def check_output(src: str | Path, out: str | Path, overwrite: bool) -> None:
    """Refuses, before any work, an output that would destroy the source or (without `overwrite`) anything else."""
    src, out = Path(src).resolve(), Path(out).resolve()
    if out == src or out in src.parents:
        raise CheckpointError(f"the output {out} would replace the source {src}; choose another output directory")
    checkpoint.check_target(out, overwrite)


def convert(src: str | Path, out: str | Path, dtype: str = "float32", progress: bool = True, overwrite: bool = False) -> Path:
    """Converts an HF model directory or a GGUF file at `src` into an s3d_jax model at `out`
    (written atomically; a non-empty `out` is refused unless `overwrite`, and then replaced whole)."""
    if dtype not in DTYPES:
        raise ConfigError(f"unsupported dtype {dtype!r}; supported: {', '.join(DTYPES)}")
    check_output(src, out, overwrite)
    source = read_source(src, keep_groups=dtype in QUANTIZED_DTYPES)
    try:
        config = ModelConfig.from_hf(source.config, dtype)
        if config.quantized:  # the source's blocks kept as they are, in formats that hold them
            config = config.replace(weight_formats=kept_formats(source.kept_formats, config))
    except KeyError as e:
        raise ConfigError(f"{source.path}: the config lacks the field {e.args[0]}") from None
    params = params_from_hf(source.tensors, config, progress=progress)
    tokenizer_size = len(source.tokenizer) if source.tokenizer is not None else None
    recorded = source.config.get("s3d") or {}  # written by `export_hf`
    reserved = reserved_token_id(source.tokenizer)
    params, config = add_mask_row(params, config, tokenizer_size, recorded.get("mask_token_id"), reserved)
    params, config = pad_vocab(params, config, recorded.get("output_vocab_size"))
    if recorded.get("draft_skip"):
        config = config.replace(draft_skip=tuple(recorded["draft_skip"]), draft_gamma=recorded.get("draft_gamma", config.draft_gamma))
    return checkpoint.save(out, params, config, source.tokenizer, overwrite=overwrite)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="convert_hf",
        description="Convert a Hugging Face model directory or a GGUF file into an s3d_jax model directory.",
    )
    parser.add_argument("src", help="HF model directory (config.json + safetensors/pytorch_model.bin) or a .gguf file")
    parser.add_argument("out", help="output directory")
    parser.add_argument("--dtype", default="float32", choices=sorted(DTYPES), help="parameter dtype (default float32)")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    parser.add_argument("--overwrite", action="store_true", help="replace a non-empty OUT whole (default: refuse it)")
    parser.add_argument(
        "--to-hf", action="store_true", help="the other way: SRC is an s3d_jax model (a trained drafter), OUT a new HF directory"
    )
    args = parser.parse_args(argv)
    try:
        if args.to_hf:
            check_output(args.src, args.out, args.overwrite)
            out = export_hf(checkpoint.load(args.src), args.out, overwrite=args.overwrite)
            print(f"exported {args.src} -> {out} (float32; draft-only LoRA weights, if any, are not part of it)")
            return 0
        out = convert(args.src, args.out, args.dtype, progress=not args.quiet, overwrite=args.overwrite)
        config = checkpoint.load_config(out)
    except (ConfigError, CheckpointError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"\ninterrupted: {args.out} is as it was (the output is written whole or not at all)", file=sys.stderr)
        return 130
    params = sum(math.prod(x.shape) for x in jax.tree.leaves(abstract_params(config)))
    print(
        f"converted {config.architecture}: {config.num_layers} layers, {params / 1e6:.1f}M params "
        f"({config.dtype}), vocab {config.vocab_size}, mask id {config.mask_token_id} -> {out}"
    )
    return 0
