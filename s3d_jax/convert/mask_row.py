"""The vocabulary's extra rows (docs/design.md). S3D's mask token needs an embedding row: a padded,
unused row when the vocabulary has one (Phi-3, Qwen), else a reserved token's row (Gemma's `<unused0>`,
Llama-3's `<|reserved_special_token_0|>`), else a new row. Then the vocabulary is padded to a multiple
of 128 rows, a shape the head's matmul handles well; padding rows are zero and never produced.
Our vocabulary tables are `[D, V]`: a row of the vocabulary is a column here."""

from __future__ import annotations

import numpy as np

from s3d_jax import quant
from s3d_jax.checkpoint import CheckpointError
from s3d_jax.config import ModelConfig

PAD_MULTIPLE = 128
VOCAB_TABLES = ("embed", "lm_head")
RESERVED_TOKENS = ("<unused0>", "<|reserved_special_token_0|>")  # tokens the models never produce


def mask_row_plan(
    vocab_size: int, tokenizer_size: int | None, recorded: int | None = None, reserved: int | None = None
) -> tuple[int, bool]:
    """(mask token id, whether a row must be appended).

    A directory this project exported records its mask id. A vocabulary padded past the tokenizer
    (Phi-3: 32064 rows, 32011 tokens) has unused rows: the last one becomes the mask. Else a
    `reserved` token the tokenizer has (see `reserved_token_id`) gives its row. Otherwise the mask
    is a new row at index `vocab_size`.
    """
    if recorded is not None:
        if not 0 <= recorded < vocab_size:
            raise CheckpointError(f"config.json records mask token id {recorded}, outside the vocabulary of {vocab_size}")
        return recorded, False
    if tokenizer_size is not None and tokenizer_size < vocab_size:
        return vocab_size - 1, False
    if reserved is not None and 0 <= reserved < vocab_size:
        return reserved, False
    return vocab_size, True


def add_mask_row(
    params: dict, config: ModelConfig, tokenizer_size: int | None, recorded: int | None = None, reserved: int | None = None
) -> tuple[dict, ModelConfig]:
    """Reserves or appends the mask token's embedding row and records its id in the config. A new row
    is the mean embedding, with a zero logit column when the head is untied. The tables are replaced
    in `params` itself, one at a time, so a model's table is never held three times."""
    mask_id, append = mask_row_plan(config.vocab_size, tokenizer_size, recorded, reserved)
    if append:
        mean = _mean_column(params["embed"])
        if quant.is_quantized(params["embed"]):
            mean = quant.quantize(mean, 1, quant.format_of(params["embed"], 1))
            for k in list(params["embed"]):
                params["embed"][k] = np.concatenate([params["embed"][k], mean[k]], axis=1)
        else:
            params["embed"] = np.concatenate([params["embed"], mean.astype(params["embed"].dtype)], axis=1)
        if not config.tie_embeddings:
            params["lm_head"] = _pad(params["lm_head"], 1)
        config = config.replace(vocab_size=config.vocab_size + 1, output_vocab_size=config.produced_vocab_size)
    return params, config.replace(mask_token_id=mask_id)


def _mean_column(table_DV, columns_per_step: int = 8192) -> np.ndarray:
    """The table's mean column `[D, 1]` in float32, summed a slice of columns at a time: a quantized
    table is never dequantized whole."""
    quantized = quant.is_quantized(table_DV)
    vocab = (table_DV["values"] if quantized else table_DV).shape[1]
    total = 0.0
    for start in range(0, vocab, columns_per_step):
        at = (slice(None), slice(start, start + columns_per_step))
        part = {k: v[at] for k, v in table_DV.items()} if quantized else table_DV[at]
        total = total + np.asarray(quant.dense(part), np.float32).sum(axis=1, keepdims=True, dtype=np.float64)
    return (total / vocab).astype(np.float32)


def pad_vocab(params: dict, config: ModelConfig, output_vocab_size: int | None = None) -> tuple[dict, ModelConfig]:
    """Zero rows up to a multiple of PAD_MULTIPLE; rows from `output_vocab_size` (default: the
    vocabulary before padding) on are never produced. In `params` itself, a table at a time."""
    padded = -(-config.vocab_size // PAD_MULTIPLE) * PAD_MULTIPLE
    output = output_vocab_size or config.produced_vocab_size
    for k in VOCAB_TABLES:
        if k in params:
            params[k] = _pad(params[k], padded - config.vocab_size)
    return params, config.replace(vocab_size=padded, output_vocab_size=None if output == padded else output)


def hf_vocab_rows(config: ModelConfig) -> int:
    """The rows an exported model keeps: every row that can be produced, and the mask row."""
    rows = config.produced_vocab_size
    return max(rows, config.mask_token_id + 1) if config.mask_token_id is not None else rows


def unpad_vocab(params: dict, config: ModelConfig) -> tuple[dict, ModelConfig]:
    """The inverse of `pad_vocab` for export: the padding rows are dropped."""
    rows = hf_vocab_rows(config)
    params = {**params, **{k: params[k][:, :rows] for k in VOCAB_TABLES if k in params}}
    return params, config.replace(vocab_size=rows, output_vocab_size=None)


def _pad(table_DV, columns: int):
    """Zero columns appended (to each part of a quantized table: codes and scales of zero are zero)."""
    if quant.is_quantized(table_DV):
        for k in list(table_DV):  # each part replaced as it is padded
            table_DV[k] = _pad(table_DV[k], columns)
        return table_DV
    if columns == 0:
        return table_DV  # not a copy: a table is a large part of a model
    return np.concatenate([table_DV, np.zeros((table_DV.shape[0], columns), table_DV.dtype)], axis=1)


def reserved_token_id(tokenizer) -> int | None:
    """The id of the first of `RESERVED_TOKENS` the tokenizer has, if any."""
    if tokenizer is None:
        return None
    vocab = tokenizer.get_vocab()
    return next((vocab[t] for t in RESERVED_TOKENS if t in vocab), None)
