"""LLaMA-2-7B with the paper's recipe (`paper_recipe`, see configs/phi3.py).

    python tools/convert_hf.py path/to/Llama-2-7b-chat-hf checkpoints/llama2_7b --dtype bfloat16
    python -m s3d_jax.train --config configs/llama2_7b.py --config.model_path=checkpoints/llama2_7b
"""

from s3d_jax.shapes import SHAPES
from s3d_jax.train.config import default_config, paper_recipe


def get_config():
    c = paper_recipe(default_config())
    c.model_path = "checkpoints/llama2_7b"
    # The shape (s3d_jax.shapes) of meta-llama/Llama-2-7b-hf, plus the appended mask row (id 32000).
    c.model.update(**SHAPES["llama2_7b"])
    c.s3d.skip = (8, 23)
    c.s3d.gamma = 4
    return c
