"""The real SmolLM2-135M-Instruct, converted from its GGUF: its logits, tokenizer and chat template are
transformers' on the same file, plain greedy equals transformers' `generate`, and the speculative
methods equal plain greedy token for token (float32). One module, so that transformers loads the
model once per test run."""

import json
import subprocess
import sys

import numpy as np
import pytest
from hf_models import RTOL, hf_logits, relative_error
from reference import assert_exact, users_env

import s3d_jax
from s3d_jax import bundled, drafter
from s3d_jax.convert import convert, read_source

pytestmark = pytest.mark.slow

CHATS = [
    "What is the capital of France?",
    "Write a Python function that returns the n-th Fibonacci number.",
    "Give me three tips for sleeping better.",
]
NEW_TOKENS = 48


@pytest.fixture(scope="module")
def smollm2(smollm2_dir):
    return s3d_jax.load(smollm2_dir)


@pytest.fixture(scope="module")
def plain(smollm2):
    return s3d_jax.decode(smollm2, CHATS, chat=True, method="ar", max_new_tokens=NEW_TOKENS)


# ---------------------------------------------------------------- the conversion


CONVERSION_PROMPTS = [
    "The capital of France is Paris. The capital of Germany is",
    "def fibonacci(n):\n    if n < 2:\n        return n\n",
]


def test_logits_equal_transformers_on_the_same_gguf(smollm2, hf_smollm2):
    model, tokenizer = hf_smollm2
    loaded = smollm2
    c = loaded.config
    assert (c.architecture, c.num_layers, c.num_heads, c.num_kv_heads, c.tie_embeddings) == ("llama", 30, 9, 3, True)
    # An appended mask row, then zero padding to 385 x 128 rows; only the first 49152 are produced.
    assert (c.vocab_size, c.mask_token_id, c.output_vocab_size) == (49280, 49152, 49152)
    assert c.eos_token_ids == (tokenizer.convert_tokens_to_ids("<|im_end|>"),)
    for prompt in CONVERSION_PROMPTS:
        ids = np.asarray([tokenizer(prompt).input_ids])
        ref = hf_logits(model, ids)
        got = np.asarray(s3d_jax.logits(loaded, ids))
        assert got.shape == ref.shape  # logits cover the model's own vocabulary
        err = relative_error(got, ref)
        print(f"\nPARITY smollm2 {prompt[:20]!r}: max relative error {err:.2e}")
        assert err < RTOL
    ids = np.asarray([tokenizer(CONVERSION_PROMPTS[0]).input_ids])
    assert tokenizer.decode(int(np.asarray(s3d_jax.logits(loaded, ids))[0, -1].argmax())) == " Berlin"


def test_its_tokenizer_and_chat_template_are_transformers(smollm2, hf_smollm2):
    _, reference = hf_smollm2
    loaded = smollm2.tokenizer
    assert loaded is not None and len(loaded) == len(reference) == 49152
    for text in CONVERSION_PROMPTS + ["Hello, world!  Ünïcödé 日本語 <|im_start|>user\nhi<|im_end|>", " leading space\ttab"]:
        assert loaded(text).input_ids == reference(text).input_ids, text
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    text = loaded.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text.endswith("<|im_start|>assistant\n") and "<|im_start|>user\nWhat is the capital of France?<|im_end|>" in text
    assert text == reference.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def test_its_mask_row_is_the_mean_embedding_and_padding_is_zero(smollm2):
    loaded = smollm2
    embed_DV = np.asarray(loaded.params["embed"])
    assert embed_DV.shape == (576, 49280) and loaded.config.output_vocab_size == 49152
    np.testing.assert_allclose(embed_DV[:, 49152], embed_DV[:, :49152].mean(1), rtol=1e-4, atol=1e-6)
    assert not embed_DV[:, 49153:].any()


def test_its_weights_in_phi3_layout_give_the_same_logits(smollm2_gguf, smollm2, tmp_path):
    """SmolLM2's weights fused into Phi-3's qkv_proj / gate_up_proj give the same logits."""
    from safetensors.numpy import save_file

    source = read_source(smollm2_gguf)
    t, cfg = source.tensors, source.config
    fused = {}
    for name in t:
        if ".self_attn.k_proj." in name or ".self_attn.v_proj." in name or ".mlp.up_proj." in name:
            continue
        if ".self_attn.q_proj." in name:
            prefix = name.removesuffix("q_proj.weight")
            fused[prefix + "qkv_proj.weight"] = np.concatenate(
                [t[name], t[prefix + "k_proj.weight"], t[prefix + "v_proj.weight"]]
            )
        elif ".mlp.gate_proj." in name:
            prefix = name.removesuffix("gate_proj.weight")
            fused[prefix + "gate_up_proj.weight"] = np.concatenate([t[name], t[prefix + "up_proj.weight"]])
        else:
            fused[name] = t[name]
    hf_dir = tmp_path / "phi3"
    hf_dir.mkdir()
    save_file(fused, hf_dir / "model.safetensors", metadata={"format": "pt"})
    del fused
    (hf_dir / "config.json").write_text(json.dumps({**cfg, "model_type": "phi3", "architectures": ["Phi3ForCausalLM"]}))

    out = convert(hf_dir, tmp_path / "out", progress=False)
    phi3 = s3d_jax.load(out)
    assert phi3.config.architecture == "phi3" and phi3.config.mask_token_id == 49152
    llama = smollm2
    ids = np.asarray([llama.tokenizer(p).input_ids[:12] for p in CONVERSION_PROMPTS])
    ref = np.asarray(s3d_jax.logits(llama, ids))
    err = relative_error(s3d_jax.logits(phi3, ids), ref)
    print(f"\nPARITY smollm2 phi3-layout vs llama-layout: max relative error {err:.2e}")
    assert err < 1e-6


# ---------------------------------------------------------------- decoding


def test_plain_greedy_equals_transformers_generate(smollm2, plain, hf_smollm2):
    torch = pytest.importorskip("torch")
    hf_model, hf_tokenizer = hf_smollm2
    for chat, ours in zip(CHATS, plain.tokens):
        messages = [{"role": "user", "content": chat}]
        ids = hf_tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)["input_ids"]
        with torch.no_grad():
            out = hf_model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False)
        assert ours == out[0, ids.shape[1] :].tolist()
    assert "Paris" in plain.text[0]
    assert min(len(t) for t in plain.tokens[1:]) >= 32  # long continuations, not only short answers


@pytest.mark.parametrize("method,gamma,skip", [("s3d", 4, (7, 21)), ("s3d", 2, (10, 19)), ("selfspec", 3, (7, 21))])
def test_speculative_equals_plain_greedy_on_real_weights(smollm2, plain, method, gamma, skip):
    # The mask row is untrained here, so acceptance is low; the output must be exact regardless.
    out, _ = assert_exact(smollm2, CHATS, plain=plain, chat=True, method=method, gamma=gamma, skip=skip, max_new_tokens=NEW_TOKENS)
    assert out.stats.tokens_per_iteration >= 1.0


def test_generate_cli_answers(smollm2_dir):
    result = subprocess.run(
        [sys.executable, "-m", "s3d_jax.generate", "--model", str(smollm2_dir), "--chat", "--method", "s3d",
         "--max-new-tokens", "16", "--prompt", "What is the capital of France?"],
        capture_output=True, text=True, timeout=600,
    )
    assert result.returncode == 0, result.stderr
    assert "Paris" in result.stdout
    assert "tokens/s" in result.stderr and "tokens per drafted or branch iteration" in result.stderr


def test_generate_cli_reports_bad_input(smollm2_dir):
    result = subprocess.run(
        [sys.executable, "-m", "s3d_jax.generate", "--model", str(smollm2_dir), "--prompt", "hi", "--skip", "0", "40"],
        capture_output=True, text=True, timeout=600,
    )
    assert result.returncode == 2
    assert "error: skip range [0, 40] is outside the model" in result.stderr
    assert "Traceback" not in result.stderr


# ---------------------------------------------------------------- the shipped drafter


def test_shipped_drafter_is_exact_and_accepted(smollm2, plain):
    drafted = drafter.apply(smollm2, bundled.DRAFTER)
    assert_exact(drafted, CHATS, plain=plain, chat=True, max_new_tokens=NEW_TOKENS)  # the calibrated policy, whatever it chose
    # Drafting at every iteration.
    out, _ = assert_exact(drafted, CHATS, plain=plain, chat=True, max_new_tokens=NEW_TOKENS, min_certainty=0.0)
    untrained = s3d_jax.decode(smollm2, CHATS, chat=True, max_new_tokens=NEW_TOKENS, gamma=out.stats.gamma, skip=out.stats.skip)
    assert out.stats.tokens_per_iteration > untrained.stats.tokens_per_iteration + 0.25, "the trained drafter is accepted more"


@pytest.mark.parametrize("draft_vocab_size", [0, 4096])  # the full head, a smaller one than the drafter's
def test_shipped_drafter_with_another_draft_head_is_exact(smollm2, plain, draft_vocab_size):
    drafted = drafter.apply(smollm2, bundled.DRAFTER, draft_vocab_size)
    assert_exact(drafted, CHATS, plain=plain, chat=True, max_new_tokens=NEW_TOKENS, min_certainty=0.0)


@pytest.mark.needs("bundled_model")
def test_load_applies_the_shipped_drafter_by_default():
    model, bare = s3d_jax.load(), s3d_jax.load(drafter=None)
    assert model.config.draft_lora_rank > 0 and model.config.draft_skip is not None and "draft_vocab" in model.params
    assert bare.config.draft_lora_rank == 0 and "draft_vocab" not in bare.params


@pytest.mark.needs("bundled_model")
def test_demo_command_reports_the_ratio_and_exactness():
    """Compiled as a user's process compiles (the test run's own XLA flags dropped), S3D's output is
    plain greedy's. S3D-only flags given explicitly: the plain run of --compare must drop them, not refuse them."""
    result = subprocess.run(
        [sys.executable, "-m", "s3d_jax.generate", "--chat", "--compare", "--max-new-tokens", "32", "--tree", "4",
         "--min-certainty", "0.9", "--prompt", CHATS[2]],
        capture_output=True, text=True, timeout=900, env=users_env(),
    )
    assert result.returncode == 0, result.stderr
    assert "x plain decoding (plain " in result.stderr
    assert "medians of 3 runs each after a first); its output is identical to plain greedy's" in result.stderr


