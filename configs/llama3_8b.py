"""Llama-3.1-8B-Instruct with the paper's recipe (`paper_recipe`, see configs/phi3.py).

    python tools/convert_hf.py path/to/Llama-3.1-8B-Instruct checkpoints/llama3_8b --dtype bfloat16
    python -m s3d_jax.train --config configs/llama3_8b.py --config.model_path=checkpoints/llama3_8b
    python -m s3d_jax.train --config configs/llama3_8b.py --dry-run      # no weights needed
"""

from s3d_jax.train.config import default_config, paper_recipe


def get_config():
    c = paper_recipe(default_config())
    c.model_path = "checkpoints/llama3_8b"
    # The public config.json of meta-llama/Llama-3.1-8B-Instruct (the dry run uses these). The mask
    # token takes the row of <|reserved_special_token_0|> (id 128002), which the model never produces.
    c.model.update(architecture="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32,
                   num_heads=32, num_kv_heads=8, head_dim=128, rope_theta=500000.0, rms_norm_eps=1e-5,
                   max_position_embeddings=131072, tie_embeddings=False, mask_token_id=128002,
                   rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                     original_max_position_embeddings=8192))
    c.s3d.skip = (8, 23)
    c.s3d.gamma = 4
    return c
