"""Phi-3-mini-4k with the paper's recipe (`paper_recipe`): AdamW (0.9, 0.95), lr 3e-5, 50 warm-up
steps, gradient clip 0.5, effective batch 64, max length 2048, bf16, and about half the layers
skipped around the middle.

    python tools/convert_hf.py path/to/Phi-3-mini-4k-instruct checkpoints/phi3 --dtype bfloat16
    python -m s3d_jax.train --config configs/phi3.py --config.model_path=checkpoints/phi3
    python -m s3d_jax.train --config configs/phi3.py --dry-run      # no weights needed
"""

from s3d_jax.shapes import SHAPES
from s3d_jax.train.config import default_config, paper_recipe


def get_config():
    c = paper_recipe(default_config())
    c.model_path = "checkpoints/phi3"
    # The shape (s3d_jax.shapes) of microsoft/Phi-3-mini-4k-instruct (the dry run uses these); the
    # mask token takes the last of its padding rows.
    c.model.update(**SHAPES["phi3_mini"])
    c.s3d.skip = (8, 23)
    c.s3d.gamma = 4
    return c
