"""Model configuration: a static, hashable dataclass built from a Hugging Face `config.json`."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import jax.numpy as jnp

ARCHITECTURES = ("llama", "mistral", "phi3")
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


class ConfigError(ValueError):
    """A model config that this project cannot run."""


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    tie_embeddings: bool = False
    max_position_embeddings: int = 4096
    sliding_window: int | None = None
    dtype: str = "float32"
    # S3D: the mask token's embedding row, and the drafter defaults a trained checkpoint records.
    mask_token_id: int | None = None
    # Rows of the vocabulary at and past this index are padding (added so the head's matmul has a
    # multiple-of-128 shape): never produced, like the mask row. None: no padding.
    output_vocab_size: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    draft_skip: tuple[int, int] | None = None
    draft_gamma: int | None = None
    draft_lora_rank: int = 0  # > 0: draft passes add LoRA adapters; the verifier never does

    def __post_init__(self):
        if self.architecture not in ARCHITECTURES:
            raise ConfigError(f"unknown architecture {self.architecture!r}; supported: {', '.join(ARCHITECTURES)}")
        if self.dtype not in DTYPES:
            raise ConfigError(f"unsupported dtype {self.dtype!r}; supported: {', '.join(DTYPES)}")
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads", "head_dim"):
            if int(getattr(self, name)) < 1:
                raise ConfigError(f"config field {name} must be a positive integer, got {getattr(self, name)!r}")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")
        if self.head_dim % 2:
            raise ConfigError(f"head_dim must be even for RoPE, got {self.head_dim}")
        if self.mask_token_id is not None and not 0 <= self.mask_token_id < self.vocab_size:
            raise ConfigError(f"mask_token_id {self.mask_token_id} is outside the vocabulary of {self.vocab_size}")
        if self.output_vocab_size is not None and not 0 < self.output_vocab_size <= self.vocab_size:
            raise ConfigError(f"output_vocab_size {self.output_vocab_size} must be in [1, vocab_size {self.vocab_size}]")
        if self.draft_skip is not None:
            validate_skip(self.draft_skip, self.num_layers)
        # Normalise JSON lists into hashable tuples.
        object.__setattr__(self, "eos_token_ids", tuple(int(i) for i in self.eos_token_ids))
        if self.draft_skip is not None:
            object.__setattr__(self, "draft_skip", tuple(int(i) for i in self.draft_skip))

    @property
    def jnp_dtype(self):
        return DTYPES[self.dtype]

    @property
    def all_layers(self) -> tuple[int, ...]:
        return tuple(range(self.num_layers))

    def draft_layers(self, skip: tuple[int, int]) -> tuple[int, ...]:
        """The layers the S3D drafter runs: every layer outside the inclusive skip range [l, h]."""
        low, high = validate_skip(skip, self.num_layers)
        return tuple(i for i in range(self.num_layers) if not low <= i <= high)

    def replace(self, **changes) -> ModelConfig:
        return dataclasses.replace(self, **changes)

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=2)

    @classmethod
    def from_json(cls, text: str) -> ModelConfig:
        fields = json.loads(text)
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(fields) - known)
        if unknown:
            raise ConfigError(f"unknown config fields: {', '.join(unknown)}")
        return cls(**fields)

    @classmethod
    def from_hf(cls, hf: dict[str, Any], dtype: str = "float32") -> ModelConfig:
        """Builds a config from a Hugging Face `config.json` dict, refusing features this model lacks."""
        arch = hf.get("model_type")
        if arch not in ARCHITECTURES:
            raise ConfigError(f"unknown architecture model_type={arch!r}; supported: {', '.join(ARCHITECTURES)}")
        _refuse_unsupported(hf)
        num_heads = hf["num_attention_heads"]
        eos = hf.get("eos_token_id")
        eos = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
        return cls(
            architecture=arch,
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=hf.get("num_key_value_heads") or num_heads,
            head_dim=hf.get("head_dim") or hf["hidden_size"] // num_heads,
            rope_theta=float(_rope_theta(hf)),
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-5)),
            tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
            max_position_embeddings=int(hf.get("max_position_embeddings", 4096)),
            sliding_window=hf.get("sliding_window") if arch != "llama" else None,
            dtype=dtype,
            eos_token_ids=tuple(eos),
        )


def _rope_theta(hf: dict[str, Any]) -> float:
    # transformers 5 moved rope_theta into `rope_parameters`.
    params = hf.get("rope_parameters") or {}
    return params.get("rope_theta", hf.get("rope_theta", 10000.0))


def _refuse_unsupported(hf: dict[str, Any]) -> None:
    act = hf.get("hidden_act", "silu")
    if act != "silu":
        raise ConfigError(f"unsupported config field hidden_act={act!r}: only SwiGLU ('silu') is implemented")
    for flag in ("attention_bias", "mlp_bias"):
        if hf.get(flag):
            raise ConfigError(f"unsupported config field {flag}=True: biases are not implemented")
    scaling = hf.get("rope_scaling") or hf.get("rope_parameters") or {}
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type != "default":
        raise ConfigError(f"unsupported config field rope_scaling type {rope_type!r}: only plain RoPE is implemented")
    # transformers 5 may keep partial_rotary_factor inside `rope_parameters` (Phi-3 does).
    partial = hf.get("partial_rotary_factor", (hf.get("rope_parameters") or {}).get("partial_rotary_factor", 1.0))
    if partial != 1.0:
        raise ConfigError(f"unsupported config field partial_rotary_factor={partial}: only full RoPE is implemented")


def validate_skip(skip, num_layers: int) -> tuple[int, int]:
    """Checks an inclusive skip range [l, h] and returns it as a tuple of ints."""
    try:
        low, high = (int(i) for i in skip)
    except (TypeError, ValueError):
        raise ConfigError(f"skip range must be a pair (l, h), got {skip!r}") from None
    if not 0 <= low <= high < num_layers:
        raise ConfigError(f"skip range [{low}, {high}] is outside the model's layers 0..{num_layers - 1}")
    if high - low + 1 == num_layers:
        raise ConfigError(f"skip range [{low}, {high}] skips every layer and leaves no draft layer")
    return low, high
