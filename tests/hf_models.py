"""Random tiny transformers models and their PyTorch logits: the reference that the conversion and
family tests compare s3d_jax against."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import s3d_jax  # noqa: E402
from s3d_jax.checkpoint import Model  # noqa: E402
from s3d_jax.convert import main  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
RTOL = 1e-4  # max |ours - reference| / max |reference|, float32
VOCAB = 96  # of the llama, mistral and phi3 models of test_convert.py
FAMILY_VOCAB = 128


def relative_error(got, ref) -> float:
    return float(np.max(np.abs(np.asarray(got, np.float64) - ref)) / np.max(np.abs(ref)))


def random_hf_model(arch: str, *, heads=4, kv_heads=2, tied=False, theta=10000.0, layers=2, seed=0, **extra):
    """A tiny random transformers model, weights scaled up from the 0.02 init so logits are far from flat."""
    from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM, Phi3Config, Phi3ForCausalLM

    config_cls, model_cls = {
        "llama": (LlamaConfig, LlamaForCausalLM),
        "mistral": (MistralConfig, MistralForCausalLM),
        "phi3": (Phi3Config, Phi3ForCausalLM),
    }[arch]
    config = config_cls(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        rope_theta=theta,
        tie_word_embeddings=tied,
        max_position_embeddings=128,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        **extra,
    )
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.2 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.15)
    return model


def hf_logits(model, ids) -> np.ndarray:
    with torch.no_grad():
        return model(torch.as_tensor(np.asarray(ids))).logits.float().numpy()


def save_torch_bin(model, where: Path, shards: int = 1):
    """The pytorch_model.bin layout (transformers 5 only writes safetensors)."""
    model.config.save_pretrained(where)
    state = model.state_dict()  # a tied model's lm_head.weight is in here too
    if shards == 1:
        torch.save(state, where / "pytorch_model.bin")
        return
    names = list(state)
    weight_map = {}
    for k in range(shards):
        file = f"pytorch_model-{k + 1:05d}-of-{shards:05d}.bin"
        part = names[k::shards]
        torch.save({n: state[n] for n in part}, where / file)
        weight_map.update({n: file for n in part})
    (where / "pytorch_model.bin.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def hf_classes(family: str):
    import transformers as tf

    return {
        "llama": (tf.LlamaConfig, tf.LlamaForCausalLM),
        "qwen2": (tf.Qwen2Config, tf.Qwen2ForCausalLM),
        "qwen3": (tf.Qwen3Config, tf.Qwen3ForCausalLM),
        "gemma2": (tf.Gemma2Config, tf.Gemma2ForCausalLM),
        "gemma3_text": (tf.Gemma3TextConfig, tf.Gemma3ForCausalLM),
    }[family]


def random_family_model(family: str, seed: int = 0, **fields):
    """A tiny random model; weights scaled up from the 0.02 init so logits are far from flat, and norm
    weights around 1 (Gemma stores w for a scale of 1 + w, so around 0 there)."""
    config_cls, model_cls = hf_classes(family)
    shape = dict(vocab_size=FAMILY_VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, max_position_embeddings=128, tie_word_embeddings=False,
                 pad_token_id=0, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(seed)
    model = model_cls(config_cls(**{**shape, **fields})).eval()
    centre = 0.0 if family.startswith("gemma") else 1.0
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(centre + 0.2 * torch.randn_like(p)) if "norm" in name else p.normal_(0.0, 0.15)
    return model


def save(model, where, how: str):
    if how == "bin":
        save_torch_bin(model, where)
    else:
        model.save_pretrained(where, max_shard_size="40KB" if how == "sharded" else "50GB")
        assert (where / "model.safetensors.index.json").exists() == (how == "sharded")


def convert_cli(src, out, subprocess_run: bool = False):
    """`tools/convert_hf.py SRC OUT --quiet`: its `main`, or in a subprocess as a user runs it."""
    args = [str(src), str(out), "--quiet"]
    if subprocess_run:
        result = subprocess.run([sys.executable, str(REPO / "tools" / "convert_hf.py"), *args], capture_output=True, text=True)
        assert result.returncode == 0, result.stderr
    else:
        assert main(args) == 0
    return out


def max_abs_diff(model: Model, hf_model, ids) -> tuple[float, float]:
    """(max |ours - transformers| over the original vocabulary, the same relative to max |reference|)."""
    ref = hf_logits(hf_model, ids)
    got = np.asarray(s3d_jax.logits(model, ids))[..., : ref.shape[-1]]
    return float(np.max(np.abs(got - ref))), relative_error(got, ref)
