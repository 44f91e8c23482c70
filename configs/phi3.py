"""Phi-3-mini-4k with the paper's recipe (`paper_recipe`): AdamW (0.9, 0.95), lr 3e-5, 50 warm-up
steps, gradient clip 0.5, effective batch 64, max length 2048, bf16, and about half the layers
skipped around the middle.

    python tools/convert_hf.py path/to/Phi-3-mini-4k-instruct checkpoints/phi3 --dtype bfloat16
    python -m s3d_jax.train --config configs/phi3.py --config.model_path=checkpoints/phi3
    python -m s3d_jax.train --config configs/phi3.py --dry-run      # no weights needed
"""

from s3d_jax.train.config import default_config, paper_recipe


def get_config():
    c = paper_recipe(default_config())
    c.model_path = "checkpoints/phi3"
    # The public config.json of microsoft/Phi-3-mini-4k-instruct (the dry run uses these); the
    # mask token takes the last of its padding rows.
    c.model.update(architecture="phi3", vocab_size=32064, hidden_size=3072, intermediate_size=8192, num_layers=32,
                   num_heads=32, num_kv_heads=32, head_dim=96, rope_theta=10000.0, rms_norm_eps=1e-5,
                   max_position_embeddings=4096, sliding_window=2047, tie_embeddings=False, mask_token_id=32063)
    c.s3d.skip = (8, 23)
    c.s3d.gamma = 4
    return c
