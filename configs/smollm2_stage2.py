"""The second stage of the shipped SmolLM2 drafter (`make drafter` runs all four stages): configs/smollm2.py's drafter
trained over the model's replies to 3,200 ShareGPT first turns it has not seen (about 0.6M reply tokens).

    python -m s3d_jax.self_data --out runs/smollm2_replies_2.jsonl --skip 5300 --limit 3200 --batch 64 \
        --max-new-tokens 256 --max-prompt-tokens 192
    python -m s3d_jax.train --config configs/smollm2_stage2.py --workdir runs/smollm2_drafter_2
    python -m s3d_jax.predict --drafters runs/smollm2_drafter_2/drafter.safetensors --profile 24 --max-new-tokens 128

`--config.s3d.init_drafter=FILE` continues another drafter file instead of the first stage made here.
`--skip 5300` leaves out the first stage's prompts; the held-out prompts of both stages (5%, by a hash
of the prompt id) are the same hash split, so neither stage trains on the prompts `predict --profile`
measures.

The first stage's recipe, with its adapters, mask row and token ranking as the start (`s3d.init_drafter`)
and a new warm-up to half its peak learning rate: one pass over the new replies.
"""

from s3d_jax.train.config import sibling_config


def get_config():
    c = sibling_config(__file__, "smollm2")
    c.data.path = "runs/smollm2_replies_2.jsonl"
    c.s3d.init_drafter = "runs/smollm2_drafter/drafter.safetensors"
    c.train.update(steps=290, warmup_steps=20, lr=5e-4, eval_every=40, checkpoint_every=20)
    return c
