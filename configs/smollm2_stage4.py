"""The fourth stage of the shipped SmolLM2 drafter (`make drafter` runs all four): the third stage's drafter
trained over the model's replies to the last 2,647 usable ShareGPT first turns (about 0.5M reply tokens).

    python -m s3d_jax.self_data --out runs/smollm2_replies_4.jsonl --skip 11700 --limit 3200 --batch 64 \
        --max-new-tokens 256 --max-prompt-tokens 192
    python -m s3d_jax.train --config configs/smollm2_stage4.py --workdir runs/smollm2_drafter_4
    python -m s3d_jax.predict --drafters runs/smollm2_drafter_4/drafter.safetensors --profile 24 --max-new-tokens 128

`--skip 11700` leaves out the prompts of the first three stages; the held-out prompts are the same hash split.
Fewer prompts remain than `--limit` asks for, so this stage takes 240 steps rather than 290.
"""

from s3d_jax.train.config import sibling_config


def get_config():
    c = sibling_config(__file__, "smollm2_stage3")
    c.data.path = "runs/smollm2_replies_4.jsonl"
    c.s3d.init_drafter = "runs/smollm2_drafter_3/drafter.safetensors"
    c.train.steps = 240
    return c
