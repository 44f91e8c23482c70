"""Hugging Face directories of random Qwen2-family weights at a real model's shape, for measuring what
depends on size alone (a conversion's memory) where no such checkpoint is at hand. No JAX."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

# The published config.json fields of the models whose shape `random_qwen2` makes.
SHAPES = {
    "qwen2.5-1.5b": {
        "hidden_size": 1536, "intermediate_size": 8960, "num_hidden_layers": 28, "num_attention_heads": 12,
        "num_key_value_heads": 2, "vocab_size": 151936, "max_position_embeddings": 32768, "rope_theta": 1000000.0,
        "rms_norm_eps": 1e-6, "tie_word_embeddings": True, "bos_token_id": 151643, "eos_token_id": 151643,
    },
}


def random_qwen2(out: Path, shape: dict, seed: int = 0) -> Path:
    """A Qwen2 directory at `out` with `shape`'s config fields and random float16 weights, one shard
    per layer (and one for the rest), written whole into a temporary sibling and renamed into place;
    an existing one is kept."""
    if (out / "model.safetensors.index.json").is_file():
        return out
    D, F, E = shape["hidden_size"], shape["intermediate_size"], shape["hidden_size"] // shape["num_attention_heads"]
    q, kv = shape["num_attention_heads"] * E, shape["num_key_value_heads"] * E
    layer = {"input_layernorm.weight": (D,), "post_attention_layernorm.weight": (D,), "self_attn.q_proj.weight": (q, D),
             "self_attn.k_proj.weight": (kv, D), "self_attn.v_proj.weight": (kv, D), "self_attn.q_proj.bias": (q,),
             "self_attn.k_proj.bias": (kv,), "self_attn.v_proj.bias": (kv,), "self_attn.o_proj.weight": (D, q),
             "mlp.gate_proj.weight": (F, D), "mlp.up_proj.weight": (F, D), "mlp.down_proj.weight": (D, F)}
    shards = [{"model.embed_tokens.weight": (shape["vocab_size"], D), "model.norm.weight": (D,)}]
    if not shape.get("tie_word_embeddings", False):
        shards[0]["lm_head.weight"] = (shape["vocab_size"], D)
    shards += [{f"model.layers.{i}.{name}": s for name, s in layer.items()} for i in range(shape["num_hidden_layers"])]
    rng = np.random.default_rng(seed)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f"{out.name}.tmp-"))
    weight_map = {}
    for index, shard in enumerate(shards):
        name = f"model-{index + 1:05d}-of-{len(shards):05d}.safetensors"
        scale = {k: (1.0, 0.1) if k.endswith("norm.weight") else (0.0, 0.02) for k in shard}
        save_file({k: (scale[k][0] + scale[k][1] * rng.standard_normal(s, np.float32)).astype(np.float16) for k, s in shard.items()},
                  str(tmp / name))
        weight_map.update(dict.fromkeys(shard, name))
    (tmp / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    config = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_act": "silu", "torch_dtype": "float16", **shape}
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    tmp.rename(out)
    return out
