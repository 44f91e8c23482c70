"""Phi-3-mini-4k with the paper's recipe: AdamW (0.9, 0.95), lr 3e-5, 50 warm-up steps, gradient clip
0.5, effective batch 64, max length 2048, bf16, about half the layers skipped around the middle.

    python tools/convert_hf.py path/to/Phi-3-mini-4k-instruct checkpoints/phi3 --dtype bfloat16
    python -m s3d_jax.train --config configs/phi3.py --config.model_path=checkpoints/phi3
    python -m s3d_jax.train --config configs/phi3.py --dry-run      # no weights needed
"""

from s3d_jax.train import default_config


def get_config():
    c = default_config()
    c.model_path = "checkpoints/phi3"
    # The public config.json of microsoft/Phi-3-mini-4k-instruct; the dry run uses these.
    c.model.update(architecture="phi3", vocab_size=32064, hidden_size=3072, intermediate_size=8192, num_layers=32,
                   num_heads=32, num_kv_heads=32, head_dim=96, rope_theta=10000.0, rms_norm_eps=1e-5,
                   max_position_embeddings=4096, sliding_window=2047, tie_embeddings=False, mask_token_id=32063)
    c.model_dtype = "bfloat16"
    c.s3d.skip = (8, 23)
    c.s3d.gamma = 4
    c.data.max_len = 2048
    c.train.update(steps=300, batch_size=8, grad_accum=8, lr=3e-5, warmup_steps=50, grad_clip=0.5,
                   b1=0.9, b2=0.95, compute_dtype="bfloat16")
    c.mesh.update(data=-1, model=1, fsdp=True)
    return c
