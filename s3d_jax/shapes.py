"""Named model shapes, from each model's published `config.json`, and random weights of those shapes.

A pass's cost depends on the shapes and the dtype, not on the weights' values, so `random_model`
answers "what would S3D cost here for model X?" before X's weights, or any drafter, exist
(`s3d_jax.calibrate`, `python -m s3d_jax.predict --shape NAME`). The training configs read their
shapes from here too. Each mask row is a token the model never produces (a reserved or padding id).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from s3d_jax.checkpoint import Model
from s3d_jax.config import DTYPES, ConfigError, ModelConfig
from s3d_jax.model import RANDOM_INIT_OPTIONS, abstract_params, default_draft_vocab

_LLAMA3_ROPE = dict(rope_type="llama3", low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192)

SHAPES: dict[str, dict] = {
    # HuggingFaceTB/SmolLM2-135M-Instruct
    "smollm2_135m": dict(architecture="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30,
                         num_heads=9, num_kv_heads=3, head_dim=64, rope_theta=100000.0, rms_norm_eps=1e-5,
                         max_position_embeddings=8192, tie_embeddings=True, mask_token_id=49151),
    # Qwen/Qwen2.5-Coder-0.5B-Instruct as converted (rows padded to 152,064; the mask takes the first padding row)
    "qwen2_5_coder_0_5b": dict(architecture="qwen2", vocab_size=152064, output_vocab_size=151936, hidden_size=896,
                               intermediate_size=4864, num_layers=24, num_heads=14, num_kv_heads=2, head_dim=64,
                               rope_theta=1000000.0, rms_norm_eps=1e-6, max_position_embeddings=32768,
                               tie_embeddings=False, mask_token_id=151936, qkv_bias=True),
    # Qwen/Qwen3-0.6B
    "qwen3_0_6b": dict(architecture="qwen3", vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_layers=28,
                       num_heads=16, num_kv_heads=8, head_dim=128, rope_theta=1000000.0, rms_norm_eps=1e-6,
                       max_position_embeddings=40960, tie_embeddings=True, mask_token_id=151935, qk_norm=True),
    # meta-llama/Llama-3.2-1B-Instruct; the mask takes <|reserved_special_token_0|>
    "llama3_1b": dict(architecture="llama", vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_layers=16,
                      num_heads=32, num_kv_heads=8, head_dim=64, rope_theta=500000.0, rms_norm_eps=1e-5,
                      max_position_embeddings=131072, tie_embeddings=True, mask_token_id=128002,
                      rope_scaling=dict(factor=32.0, **_LLAMA3_ROPE)),
    # microsoft/Phi-3-mini-4k-instruct (3.8B); the mask takes a padding row past the tokenizer's 32011
    "phi3_mini": dict(architecture="phi3", vocab_size=32064, hidden_size=3072, intermediate_size=8192, num_layers=32,
                      num_heads=32, num_kv_heads=32, head_dim=96, rope_theta=10000.0, rms_norm_eps=1e-5,
                      max_position_embeddings=4096, sliding_window=2047, tie_embeddings=False, mask_token_id=32063),
    # meta-llama/Llama-2-7b-chat-hf with one added row for the mask (the paper's base model)
    "llama2_7b": dict(architecture="llama", vocab_size=32001, hidden_size=4096, intermediate_size=11008, num_layers=32,
                      num_heads=32, num_kv_heads=32, head_dim=128, rope_theta=10000.0, rms_norm_eps=1e-5,
                      max_position_embeddings=4096, tie_embeddings=False, mask_token_id=32000),
    # meta-llama/Llama-3.1-8B-Instruct
    "llama3_8b": dict(architecture="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32,
                      num_heads=32, num_kv_heads=8, head_dim=128, rope_theta=500000.0, rms_norm_eps=1e-5,
                      max_position_embeddings=131072, tie_embeddings=False, mask_token_id=128002,
                      rope_scaling=dict(factor=8.0, **_LLAMA3_ROPE)),
    # Qwen/Qwen3-8B
    "qwen3_8b": dict(architecture="qwen3", vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_layers=36,
                     num_heads=32, num_kv_heads=8, head_dim=128, rope_theta=1000000.0, rms_norm_eps=1e-6,
                     max_position_embeddings=40960, tie_embeddings=False, mask_token_id=151935, qk_norm=True),
}


def shape_config(name: str, dtype: str = "float32") -> ModelConfig:
    """The ModelConfig of a named shape."""
    if name not in SHAPES:
        raise ConfigError(f"unknown model shape {name!r}; known: {', '.join(SHAPES)}")
    if dtype not in DTYPES:
        raise ConfigError(f"unsupported dtype {dtype!r}; supported: {', '.join(DTYPES)}")
    return ModelConfig(**SHAPES[name], dtype=dtype)


def parameter_bytes(config: ModelConfig) -> int:
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(abstract_params(config)))


def available_memory_bytes() -> int | None:
    """Memory this process could still take (Linux's MemAvailable), or None where it cannot tell."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def random_model(name: str, dtype: str = "float32", seed: int = 0) -> Model:
    """Random weights (normal, std 0.02; norms at one) of a named shape, in `dtype`, with no tokenizer."""
    config = shape_config(name, dtype)
    return Model(random_params(config, seed), config)


def random_params(config: ModelConfig, seed: int = 0):
    """Random weights for `config`. Each leaf is drawn in its own dtype, so the model never exists at a
    wider one; a model that would not fit in the memory left is refused before anything is allocated."""
    needed, free = parameter_bytes(config), available_memory_bytes()
    if free is not None and jax.default_backend() == "cpu" and needed > 0.9 * free:
        raise MemoryError(f"{needed / 2**30:.1f} GiB of {config.dtype} weights do not fit the {free / 2**30:.1f} GiB this "
                          "machine has available; try dtype='bfloat16' or a smaller shape")
    leaves, treedef = jax.tree.flatten_with_path(abstract_params(config))
    keys = jax.random.split(jax.random.key(seed), len(leaves))

    def leaf(key, path, like):
        name = jax.tree_util.keystr(path)
        if "draft_vocab" in name:
            return default_draft_vocab(config)
        return jnp.ones(like.shape, like.dtype) if "norm" in name else _normal(key, like.shape, like.dtype)

    return jax.tree.unflatten(treedef, [leaf(key, path, like) for key, (path, like) in zip(keys, leaves, strict=True)])


@functools.partial(jax.jit, static_argnums=(1, 2), compiler_options=RANDOM_INIT_OPTIONS)
def _normal(key, shape, dtype):
    return (0.02 * jax.random.normal(key, shape, jnp.float32)).astype(dtype)


def describe(config: ModelConfig) -> str:
    """`1.24B parameters, 4.6 GiB in float32`."""
    count = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(abstract_params(config)))
    size = f"{count / 1e9:.2f}B" if count >= 1e9 else f"{count / 1e6:.0f}M"
    return f"{size} parameters, {parameter_bytes(config) / 2**30:.1f} GiB in {config.dtype}"
