"""Qwen3-8B with the paper's recipe (`paper_recipe`, see configs/phi3.py).

    python tools/convert_hf.py path/to/Qwen3-8B checkpoints/qwen3_8b --dtype bfloat16
    python -m s3d_jax.train --config configs/qwen3_8b.py --config.model_path=checkpoints/qwen3_8b
    python -m s3d_jax.train --config configs/qwen3_8b.py --dry-run      # no weights needed
"""

from s3d_jax.shapes import SHAPES
from s3d_jax.train.config import default_config, paper_recipe


def get_config():
    c = paper_recipe(default_config())
    c.model_path = "checkpoints/qwen3_8b"
    # The shape (s3d_jax.shapes) of Qwen/Qwen3-8B (the dry run uses these): per-head q/k norms, no biases,
    # no sliding window. The embedding is padded past the tokenizer's 151669 tokens, so the mask
    # token takes the last padding row.
    c.model.update(**SHAPES["qwen3_8b"])
    c.s3d.skip = (9, 26)  # the middle half of 36 layers
    c.s3d.gamma = 4
    return c
