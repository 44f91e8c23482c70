"""The third stage of the shipped SmolLM2 drafter (`make drafter` runs all four): the second stage's drafter
trained over the model's replies to the next 3,200 ShareGPT first turns (about 0.6M reply tokens).

    python -m s3d_jax.self_data --out runs/smollm2_replies_3.jsonl --skip 8500 --limit 3200 --batch 64 \
        --max-new-tokens 256 --max-prompt-tokens 192
    python -m s3d_jax.train --config configs/smollm2_stage3.py --workdir runs/smollm2_drafter_3
    python -m s3d_jax.predict --drafters runs/smollm2_drafter_3/drafter.safetensors --profile 24 --max-new-tokens 128

`--skip 8500` leaves out the prompts of the first two stages; the held-out prompts are the same hash split.
The second stage's schedule, from its adapters, mask row and ranking.
"""

from s3d_jax.train.config import sibling_config


def get_config():
    c = sibling_config(__file__, "smollm2_stage2")
    c.data.path = "runs/smollm2_replies_3.jsonl"
    c.s3d.init_drafter = "runs/smollm2_drafter_2/drafter.safetensors"
    return c
