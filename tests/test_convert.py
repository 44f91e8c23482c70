"""Conversion from Hugging Face checkpoints and GGUF, checked against transformers' PyTorch models.

Tolerances (float32 throughout unless stated): logits must match the reference to a max absolute
error of 1e-4 * max|reference logit| ("relative error" below), for random tiny models here and for the
real SmolLM2 in tests/test_smollm2.py. The bf16 conversion gets 5e-2 of max|reference|.
"""

from __future__ import annotations

import copy
import json
import subprocess
import sys

import jax
import numpy as np
import pytest
from hf_models import REPO, RTOL, VOCAB, hf_logits, random_hf_model, relative_error, save_torch_bin

torch = pytest.importorskip("torch")

import s3d_jax  # noqa: E402
from s3d_jax.bench.random_model import random_qwen2  # noqa: E402
from s3d_jax.checkpoint import CheckpointError  # noqa: E402
from s3d_jax.config import ModelConfig  # noqa: E402
from s3d_jax.convert import add_mask_row, convert, export_hf, mask_row_plan, read_source  # noqa: E402


def our_logits(out_dir, ids, vocab=None) -> np.ndarray:
    logits = np.asarray(s3d_jax.logits(s3d_jax.load(out_dir), ids))
    return logits if vocab is None else logits[..., :vocab]


def random_ids(n=2, t=16, seed=1):
    return np.random.default_rng(seed).integers(0, VOCAB, (n, t))


def assert_parity(label, model, out_dir, ids, rtol=RTOL, vocab=None):
    ref = hf_logits(model, ids)[..., :vocab]
    err = relative_error(our_logits(out_dir, ids, ref.shape[-1]), ref)
    print(f"\nPARITY {label}: max relative error {err:.2e} (tolerance {rtol:.0e})")
    assert err < rtol, f"{label}: max relative error {err:.2e} >= {rtol:.0e}"
    return err


# --------------------------------------------------------------------------------------------
# Random tiny models against transformers.

CASES = {
    "llama-mha-untied": dict(arch="llama", heads=4, kv_heads=4, tied=False, theta=10000.0),
    "llama-gqa-tied": dict(arch="llama", heads=4, kv_heads=2, tied=True, theta=500000.0),
    "llama-mqa-headdim32": dict(arch="llama", heads=8, kv_heads=1, tied=False, theta=10000.0, head_dim=32, layers=3),
    "phi3-mha-untied": dict(arch="phi3", heads=4, kv_heads=4, tied=False, theta=10000.0),
    "phi3-gqa-tied": dict(arch="phi3", heads=8, kv_heads=2, tied=True, theta=50000.0, layers=3),
    "mistral-gqa-window": dict(arch="mistral", heads=4, kv_heads=2, tied=False, theta=10000.0, sliding_window=6),
}


@pytest.mark.parametrize("case", list(CASES))
def test_random_model_parity(case, tmp_path):
    spec = dict(CASES[case])
    model = random_hf_model(spec.pop("arch"), **spec)
    model.save_pretrained(tmp_path / "hf")
    out = convert(tmp_path / "hf", tmp_path / "out", progress=False)
    assert_parity(case, model, out, random_ids())

    loaded = s3d_jax.load(out)
    c = loaded.config
    assert c.rope_theta == spec["theta"]  # transformers 5 keeps theta in rope_parameters
    assert (c.num_heads, c.num_kv_heads, c.tie_embeddings) == (spec["heads"], spec["kv_heads"], spec["tied"])
    assert c.eos_token_ids == (2,)
    # No tokenizer, so the mask token gets a new row: the mean embedding, and a zero logit column.
    # Then zero padding rows up to a multiple of 128, which are never produced.
    assert (c.vocab_size, c.mask_token_id, c.output_vocab_size) == (128, VOCAB, VOCAB)
    embed_DV = np.asarray(loaded.params["embed"])
    np.testing.assert_allclose(embed_DV[:, VOCAB], embed_DV[:, :VOCAB].mean(1), rtol=1e-5, atol=1e-6)
    assert not embed_DV[:, VOCAB + 1 :].any()
    if not c.tie_embeddings:
        assert not np.asarray(loaded.params["lm_head"])[:, VOCAB:].any()

    # Back to transformers (`--to-hf`): the same logits over the vocabulary (the export keeps the mask
    # row and drops the padding), and the same params and config when converted again.
    from transformers import AutoModelForCausalLM

    export_hf(loaded, tmp_path / "back")
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "back", dtype=torch.float32).eval()
    assert type(exported).__name__ == type(model).__name__
    assert exported.config.vocab_size == VOCAB + 1
    assert_parity(f"{case} exported", exported, out, random_ids(), vocab=VOCAB)
    again = s3d_jax.load(convert(tmp_path / "back", tmp_path / "again", progress=False))
    assert again.config == c
    for a, b in zip(jax.tree.leaves(again.params), jax.tree.leaves(loaded.params), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_cli_converts(tmp_path):
    model = random_hf_model("llama", heads=4, kv_heads=2)
    model.save_pretrained(tmp_path / "hf")
    result = subprocess.run(
        [sys.executable, str(REPO / "tools" / "convert_hf.py"), str(tmp_path / "hf"), str(tmp_path / "out"), "--quiet"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr
    assert "llama" in result.stdout and "mask id 96" in result.stdout and str(tmp_path / "out") in result.stdout
    assert_parity("cli", model, tmp_path / "out", random_ids())


def test_sharded_safetensors(tmp_path):
    model = random_hf_model("phi3", heads=4, kv_heads=2)
    model.save_pretrained(tmp_path / "hf", max_shard_size="40KB")
    assert (tmp_path / "hf" / "model.safetensors.index.json").exists()
    assert len(list((tmp_path / "hf").glob("model-*.safetensors"))) > 1
    assert_parity("sharded-safetensors", model, convert(tmp_path / "hf", tmp_path / "out", progress=False), random_ids())




@pytest.mark.parametrize("shards", [1, 2])
def test_pytorch_bin(tmp_path, shards):
    model = random_hf_model("llama", heads=4, kv_heads=2, tied=True)
    save_torch_bin(model, tmp_path / "hf", shards)
    out = convert(tmp_path / "hf", tmp_path / "out", progress=False)
    assert_parity(f"pytorch_model.bin x{shards}", model, out, random_ids())


def test_pytorch_bin_without_torch(tmp_path, monkeypatch):
    save_torch_bin(random_hf_model("llama"), tmp_path / "hf")
    monkeypatch.setitem(sys.modules, "torch", None)  # `import torch` now raises ImportError
    with pytest.raises(CheckpointError, match="pytorch_model.bin.*need torch"):
        convert(tmp_path / "hf", tmp_path / "out", progress=False)


def test_bfloat16_conversion(tmp_path):
    model = random_hf_model("llama", heads=4, kv_heads=2)
    model.save_pretrained(tmp_path / "hf")
    out = convert(tmp_path / "hf", tmp_path / "out", dtype="bfloat16", progress=False)
    loaded = s3d_jax.load(out)
    assert loaded.config.dtype == "bfloat16"
    for leaf in jax.tree.leaves(loaded.params):
        assert leaf.dtype == np.dtype("bfloat16")
    assert_parity("bf16 params vs f32 reference", model, out, random_ids(), rtol=5e-2)


def test_bfloat16_checkpoint_source(tmp_path):
    """A bf16 safetensors checkpoint (numpy has no bf16) converts exactly to float32."""
    model = random_hf_model("phi3", heads=4, kv_heads=2)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.bfloat16().float())  # the f32 reference holds exactly the bf16 weights
    copy.deepcopy(model).to(torch.bfloat16).save_pretrained(tmp_path / "hf")
    out = convert(tmp_path / "hf", tmp_path / "out", dtype="float32", progress=False)
    assert_parity("bf16 checkpoint -> f32", model, out, random_ids())


# --------------------------------------------------------------------------------------------
# The mask row.


# --------------------------------------------------------------------------------------------
# Streaming: a layer at a time.

# Layers of 34 MB in float32, from float16 safetensors.
STREAMED_SHAPE = {"hidden_size": 768, "intermediate_size": 3072, "num_attention_heads": 8, "num_key_value_heads": 2,
                  "vocab_size": 1024, "max_position_embeddings": 256, "rope_theta": 10000.0, "rms_norm_eps": 1e-6,
                  "tie_word_embeddings": True, "eos_token_id": 2}
PEAK_OF_CONVERSION = """
import json, sys
import jax
from s3d_jax.bench.harness import peak_rss_mib, rss_mib
from s3d_jax.convert import convert
jax.numpy.zeros(1).block_until_ready()
before = rss_mib()
convert(sys.argv[1], sys.argv[2], progress=False)
print(json.dumps({"before": before, "peak": peak_rss_mib()}))
"""


def test_conversion_holds_about_a_layer_at_a_time(tmp_path):
    """The layers are read, converted and written one at a time (`checkpoint.LayerStack`): the
    conversion's peak does not grow with the model's depth, where holding the model whole (and
    orbax's copy of it) made it grow by twice the model's size. Every layer lands in its place."""
    raised, size = {}, {}
    for layers in (4, 16):
        src = random_qwen2(tmp_path / f"src{layers}", {**STREAMED_SHAPE, "num_hidden_layers": layers})
        out = tmp_path / f"out{layers}"
        run = subprocess.run([sys.executable, "-c", PEAK_OF_CONVERSION, str(src), str(out)], capture_output=True, text=True)
        assert run.returncode == 0, run.stderr[-3000:]
        memory = json.loads(run.stdout.splitlines()[-1])
        model = s3d_jax.load(out)
        raised[layers], size[layers] = memory["peak"] - memory["before"], sum(x.nbytes for x in jax.tree.leaves(model.params)) / 2**20
        print(f"\nconverting {layers} layers ({size[layers]:.0f} MiB) raised the peak by {raised[layers]:.0f} MiB")
    assert raised[16] - raised[4] < (size[16] - size[4]) / 4, (raised, size)
    source = read_source(src).tensors
    for i in range(16):
        np.testing.assert_array_equal(np.asarray(model.params["layers"]["mlp"]["down"][i]),
                                      source[f"model.layers.{i}.mlp.down_proj.weight"].astype(np.float32).T)


def test_mask_row_plan():
    assert mask_row_plan(32064, 32011) == (32063, False)  # Phi-3: a padded row is reserved
    assert mask_row_plan(49152, 49152) == (49152, True)  # SmolLM2: a row is appended
    assert mask_row_plan(100, None) == (100, True)  # no tokenizer: append
    assert mask_row_plan(100, 120) == (100, True)


def test_add_mask_row_reserved_keeps_shapes():
    config = ModelConfig("phi3", 10, 4, 8, 1, 2, 2, 2)
    params = {"embed": np.ones((4, 10), np.float32), "lm_head": np.ones((4, 10), np.float32)}
    new_params, new_config = add_mask_row(dict(params), config, tokenizer_size=7)
    assert new_config.vocab_size == 10 and new_config.mask_token_id == 9
    assert new_params["embed"].shape == (4, 10) and new_params["lm_head"].shape == (4, 10)


def test_mask_row_reserved_with_small_tokenizer(tmp_path):
    """Phi-3 pads its vocabulary past the tokenizer: the last padded row becomes the mask."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    model = random_hf_model("phi3", heads=4, kv_heads=2)
    model.save_pretrained(tmp_path / "hf")
    vocab = {f"w{i}": i for i in range(80)}
    raw = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=raw, unk_token="w0", eos_token="w2").save_pretrained(tmp_path / "hf")

    out = convert(tmp_path / "hf", tmp_path / "out", progress=False)
    loaded = s3d_jax.load(out)
    # The model's own rows stay (the mask is its last one), then zero padding up to 128 rows.
    assert (loaded.config.vocab_size, loaded.config.mask_token_id, loaded.config.output_vocab_size) == (128, VOCAB - 1, VOCAB)
    assert len(loaded.tokenizer) == 80
    assert loaded.tokenizer("w5 w7").input_ids == [5, 7]
    assert_parity("phi3 reserved mask row", model, out, random_ids())


# --------------------------------------------------------------------------------------------
# Real weights: SmolLM2-135M-Instruct from its GGUF.
