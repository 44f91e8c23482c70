"""Llama-3.1-8B-Instruct with the paper's recipe (`paper_recipe`, see configs/phi3.py).

    python tools/convert_hf.py path/to/Llama-3.1-8B-Instruct checkpoints/llama3_8b --dtype bfloat16
    python -m s3d_jax.train --config configs/llama3_8b.py --config.model_path=checkpoints/llama3_8b
    python -m s3d_jax.train --config configs/llama3_8b.py --dry-run      # no weights needed
"""

from s3d_jax.shapes import SHAPES
from s3d_jax.train.config import default_config, paper_recipe


def get_config():
    c = paper_recipe(default_config())
    c.model_path = "checkpoints/llama3_8b"
    # The shape (s3d_jax.shapes) of meta-llama/Llama-3.1-8B-Instruct (the dry run uses these). The mask
    # token takes the row of <|reserved_special_token_0|> (id 128002), which the model never produces.
    c.model.update(**SHAPES["llama3_8b"])
    c.s3d.skip = (8, 23)
    c.s3d.gamma = 4
    return c
