"""The second stage of Qwen2.5-Coder-0.5B-Instruct's drafter: the shipped first stage trained on, over the
model's own greedy replies to the next 2,304 ShareGPT prompts (the first stage's 1,600 left out).

    python -m s3d_jax.self_data --model qwen2.5-coder-0.5b --out data/qwen_coder_replies_2.jsonl --skip 1600 \
        --limit 2304 --batch 64 --max-new-tokens 256 --max-prompt-tokens 192
    python -m s3d_jax.train --config configs/qwen_coder_stage2.py --workdir runs/qwen_coder_drafter_2
    python -m s3d_jax.predict --model qwen2.5-coder-0.5b --drafters runs/qwen_coder_drafter_2/drafter.safetensors \
        --profile 8 --max-new-tokens 96

`make qwen-drafter` runs both stages. The held-out prompts are the same hash split as the first stage's.
"""

from s3d_jax.train.config import sibling_config


def get_config():
    c = sibling_config(__file__, "qwen_coder")
    c.data.path = "data/qwen_coder_replies_2.jsonl"
    c.s3d.init_drafter = "runs/qwen_coder_drafter/drafter.safetensors"
    # 60 steps of 2,560 tokens (about a third of the stage's replies), about 30 s a step with the CPU to itself.
    c.train.update(steps=60, warmup_steps=4)
    return c
