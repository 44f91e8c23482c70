"""This project's model -> a float32 Hugging Face directory that transformers loads (the inverse of
`convert`), e.g. to run a trained drafter's full model under transformers."""

from __future__ import annotations

import json
from pathlib import Path

from s3d_jax import quant
from s3d_jax.checkpoint import Model, atomic_dir, save_safetensors
from s3d_jax.config import ModelConfig, RopeScaling
from s3d_jax.convert.layout import params_to_hf
from s3d_jax.convert.mask_row import hf_vocab_rows, unpad_vocab

HF_CLASSES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
}


def export_hf(model: Model, out: str | Path, overwrite: bool = False) -> Path:
    """Writes `model` (params, config, tokenizer) as a float32 Hugging Face directory that transformers loads.
    The mask row stays in the vocabulary and the padding rows are dropped, so converting the directory
    back gives the same model. Written atomically; a non-empty `out` is refused unless `overwrite`, and
    then replaced whole (no stale shard or index of an older model survives beside the new file)."""
    params, config = unpad_vocab(quant.dequantize_params(dict(model.params)), model.config)  # int8 goes out dequantized
    with atomic_dir(out, overwrite) as tmp:
        (tmp / "config.json").write_text(json.dumps(config_to_hf(model.config), indent=1))
        (tmp / "generation_config.json").write_text(json.dumps({"eos_token_id": list(model.config.eos_token_ids)}))
        save_safetensors(params_to_hf(params, config), tmp / "model.safetensors", metadata={"format": "pt"})
        if model.tokenizer is not None:
            model.tokenizer.save_pretrained(str(tmp))
    return Path(out).absolute()


def config_to_hf(config: ModelConfig) -> dict:
    """transformers' `config.json` for `config`, in transformers 5's layout; `ModelConfig.from_hf` reads it back."""
    hf = {
        "architectures": [HF_CLASSES[config.architecture]],
        "model_type": config.architecture,
        "vocab_size": hf_vocab_rows(config),
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_heads,
        "num_key_value_heads": config.num_kv_heads,
        "head_dim": config.head_dim,
        "hidden_act": config.hidden_act,
        "rope_parameters": _rope_parameters(config.rope_theta, config.rope_scaling),
        "rms_norm_eps": config.rms_norm_eps,
        "tie_word_embeddings": config.tie_embeddings,
        "max_position_embeddings": config.max_position_embeddings,
        "eos_token_id": list(config.eos_token_ids),
        "pad_token_id": None,  # else Phi3Config assumes 32000, which a small vocabulary lacks
        "dtype": "float32",
        # Read back by `convert`.
        "s3d": {"mask_token_id": config.mask_token_id, "output_vocab_size": config.output_vocab_size},
    }
    if config.draft_skip is not None and not config.draft_lora_rank:  # LoRA drafters lose their adapters
        hf["s3d"].update(draft_skip=list(config.draft_skip), draft_gamma=config.draft_gamma)
    if config.architecture != "llama":
        hf["sliding_window"] = config.sliding_window
    if config.architecture in ("qwen2", "qwen3", "gemma2", "gemma3_text"):  # these read per-layer types
        hf["layer_types"] = ["sliding_attention" if config.is_sliding(i) else "full_attention" for i in config.all_layers]
    if config.architecture in ("qwen2", "qwen3"):
        hf["use_sliding_window"] = config.sliding_window is not None
    if config.architecture in ("gemma2", "gemma3_text"):
        hf.update(
            hidden_activation=config.hidden_act,
            query_pre_attn_scalar=_int_if_whole(config.query_pre_attn_scalar),  # transformers wants an int
            attn_logit_softcapping=config.attn_softcap,
            final_logit_softcapping=config.final_softcap,
        )
    if config.architecture == "gemma3_text":
        hf["rope_parameters"] = {
            "full_attention": _rope_parameters(config.rope_theta, config.rope_scaling),
            "sliding_attention": _rope_parameters(config.local_rope_theta or config.rope_theta, None),
        }
    return hf


def _rope_parameters(theta: float, scaling: RopeScaling | None) -> dict:
    params = {"rope_type": "default", "rope_theta": theta}
    if scaling is not None:
        params.update(rope_type=scaling.rope_type, factor=scaling.factor)
        if scaling.rope_type == "llama3":
            params.update(
                low_freq_factor=scaling.low_freq_factor,
                high_freq_factor=scaling.high_freq_factor,
                original_max_position_embeddings=scaling.original_max_position_embeddings,
            )
    return params


def _int_if_whole(x: float) -> int | float:
    return int(x) if float(x).is_integer() else x
