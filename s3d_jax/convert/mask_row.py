"""S3D's mask token needs an embedding row (docs/design.md): a padded, unused row when the
vocabulary has one (Phi-3, Qwen), else a reserved token's row (Gemma's `<unused0>`, Llama-3's
`<|reserved_special_token_0|>`), else a new row."""

from __future__ import annotations

import numpy as np

from s3d_jax.checkpoint import CheckpointError
from s3d_jax.config import ModelConfig

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
    """Reserves or appends the mask token's embedding row and records its id in the config.
    A new row is the mean embedding, with a zero logit column when the head is untied."""
    mask_id, append = mask_row_plan(config.vocab_size, tokenizer_size, recorded, reserved)
    if append:
        embed = params["embed"]
        mean = embed.astype(np.float32).mean(axis=0, keepdims=True).astype(embed.dtype)
        params = {**params, "embed": np.concatenate([embed, mean], axis=0)}
        if not config.tie_embeddings:
            head = params["lm_head"]
            params["lm_head"] = np.concatenate([head, np.zeros((head.shape[0], 1), head.dtype)], axis=1)
        config = config.replace(vocab_size=config.vocab_size + 1)
    return params, config.replace(mask_token_id=mask_id)


def reserved_token_id(tokenizer) -> int | None:
    """The id of the first of `RESERVED_TOKENS` the tokenizer has, if any."""
    if tokenizer is None:
        return None
    vocab = tokenizer.get_vocab()
    return next((vocab[t] for t in RESERVED_TOKENS if t in vocab), None)
