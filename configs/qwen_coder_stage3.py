"""The third stage of Qwen2.5-Coder-0.5B-Instruct's drafter: the second stage trained on over the same
2,304 replies, in another order (60 steps of the second stage read about a third of them).

    python -m s3d_jax.train --config configs/qwen_coder_stage3.py --workdir runs/qwen_coder_drafter_3
    python -m s3d_jax.predict --model qwen2.5-coder-0.5b --drafters runs/qwen_coder_drafter_3/drafter.safetensors \
        --profile 8 --max-new-tokens 96

The held-out prompts are the same hash split as the earlier stages'. Run on 2026-12-04: held-out E
1.96 -> 2.02, but no higher E on HumanEval, so the second stage stays shipped (docs/training.md).
"""

from s3d_jax.train.config import sibling_config


def get_config():
    c = sibling_config(__file__, "qwen_coder_stage2")
    c.s3d.init_drafter = "runs/qwen_coder_drafter_2/drafter.safetensors"
    # Another shuffle of the stage's replies: most of its first 60 batches are ones the second stage did not read.
    c.train.seed = 1
    return c
