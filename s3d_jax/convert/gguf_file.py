"""llama.cpp's GGUF files (llama architecture), read into an `HFSource`: the metadata becomes an
HF-style config, the tensor names HF names, and q/k rows go back to HF's rotate-half order."""

from __future__ import annotations

import re
import warnings
from pathlib import Path

import numpy as np

from s3d_jax.checkpoint import CheckpointError
from s3d_jax.config import ConfigError
from s3d_jax.convert.readers import HFSource, LazyTensors

GGUF_NAMES = {  # GGUF tensor name -> HF tensor name; {i} is the layer.
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
    "blk.{i}.attn_norm.weight": "model.layers.{i}.input_layernorm.weight",
    "blk.{i}.ffn_norm.weight": "model.layers.{i}.post_attention_layernorm.weight",
    "blk.{i}.attn_q.weight": "model.layers.{i}.self_attn.q_proj.weight",
    "blk.{i}.attn_k.weight": "model.layers.{i}.self_attn.k_proj.weight",
    "blk.{i}.attn_v.weight": "model.layers.{i}.self_attn.v_proj.weight",
    "blk.{i}.attn_output.weight": "model.layers.{i}.self_attn.o_proj.weight",
    "blk.{i}.ffn_gate.weight": "model.layers.{i}.mlp.gate_proj.weight",
    "blk.{i}.ffn_up.weight": "model.layers.{i}.mlp.up_proj.weight",
    "blk.{i}.ffn_down.weight": "model.layers.{i}.mlp.down_proj.weight",
}


def read_gguf(path: Path) -> HFSource:
    import gguf  # ~0.25 s to import; only GGUF sources need it

    try:
        reader = gguf.GGUFReader(str(path))
    except Exception as e:  # bad magic, truncated data: numpy and struct errors.
        raise CheckpointError(f"cannot read {path} as a GGUF file: {type(e).__name__}: {e}") from None

    def field(key: str, default=None):
        f = reader.fields.get(key)
        return default if f is None else f.contents()

    arch = field("general.architecture")
    if arch != "llama":
        raise ConfigError(f"unsupported GGUF architecture {arch!r} in {path}: only 'llama' GGUF files are supported")
    if field("llama.expert_count", 0):
        raise ConfigError(f"unsupported GGUF {path}: mixture-of-experts (llama.expert_count) is not implemented")
    tokens = field("tokenizer.ggml.tokens")
    names = {t.name: t for t in reader.tensors}
    hidden, heads = field("llama.embedding_length"), field("llama.attention.head_count")
    head_dim = field("llama.attention.key_length") or hidden // heads
    kv_heads = field("llama.attention.head_count_kv") or heads
    config = {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": len(tokens) if tokens else field("llama.vocab_size"),
        "hidden_size": hidden,
        "intermediate_size": field("llama.feed_forward_length"),
        "num_hidden_layers": field("llama.block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "rope_theta": float(field("llama.rope.freq_base", 10000.0)),
        "rms_norm_eps": float(field("llama.attention.layer_norm_rms_epsilon", 1e-5)),
        "max_position_embeddings": int(field("llama.context_length", 4096)),
        "tie_word_embeddings": "output.weight" not in names,
        "hidden_act": "silu",
        "bos_token_id": field("tokenizer.ggml.bos_token_id"),
        "eos_token_id": list(
            dict.fromkeys(i for i in (field("tokenizer.ggml.eos_token_id"), field("tokenizer.ggml.eot_token_id")) if i is not None)
        ),
    }
    scaling = field("llama.rope.scaling.type")
    if scaling not in (None, "none"):
        config["rope_scaling"] = {"rope_type": scaling}
    rope_dim = field("llama.rope.dimension_count")
    if rope_dim and rope_dim != head_dim:
        config["partial_rotary_factor"] = rope_dim / head_dim
    for key, value in config.items():
        if value is None and key != "bos_token_id":
            raise CheckpointError(f"{path} lacks the metadata for {key}")

    hf_names = {hf_name(n): n for n in names}

    def load(name: str) -> np.ndarray:
        t = names[hf_names[name]]
        try:
            w = gguf.quants.dequantize(t.data, t.tensor_type)
        except Exception as e:
            raise CheckpointError(f"cannot dequantize {t.name} ({t.tensor_type.name}) in {path}: {e}") from None
        if name.endswith("q_proj.weight"):
            w = unpermute_rows(w, heads)
        elif name.endswith("k_proj.weight"):
            w = unpermute_rows(w, kv_heads)
        return w

    return HFSource(config, LazyTensors(list(hf_names), load), _tokenizer(path), path)


def hf_name(name: str) -> str:
    """The HF name of a GGUF tensor; unknown names pass through (and are refused later)."""
    m = re.fullmatch(r"blk\.(\d+)\.(.+)", name)
    key, i = (f"blk.{{i}}.{m.group(2)}", m.group(1)) if m else (name, None)
    return GGUF_NAMES[key].format(i=i) if key in GGUF_NAMES else name


def unpermute_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undoes llama.cpp's interleaving of q/k rows for its RoPE layout (back to rotate-half)."""
    rows, cols = w.shape
    return w.reshape(n_head, rows // n_head // 2, 2, cols).swapaxes(1, 2).reshape(rows, cols)


def _tokenizer(path: Path):
    from transformers import AutoTokenizer  # heavy: imported only when a tokenizer is read

    try:
        return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    except Exception as e:  # the model converts without one; token ids still work.
        warnings.warn(f"no tokenizer from {path}: {type(e).__name__}: {e}", stacklevel=2)
        return None
