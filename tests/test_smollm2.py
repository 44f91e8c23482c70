"""Decoding the real SmolLM2-135M-Instruct: plain greedy equals transformers' `generate`, and the
speculative methods equal plain greedy token for token (float32)."""

import subprocess
import sys

import pytest
from reference import assert_exact

import s3d_jax
from s3d_jax import bundled, drafter

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
    # S3D-only flags given explicitly: the plain run of --compare must drop them, not refuse them.
    result = subprocess.run(
        [sys.executable, "-m", "s3d_jax.generate", "--chat", "--compare", "--max-new-tokens", "32", "--tree", "4",
         "--min-certainty", "0.9", "--prompt", CHATS[2]],
        capture_output=True, text=True, timeout=900,
    )
    assert result.returncode == 0, result.stderr
    assert "x plain decoding (plain " in result.stderr
    assert "medians of 3 runs each after a first); its output is identical to plain greedy's" in result.stderr


