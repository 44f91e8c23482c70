"""The first stage of a drafter for Qwen2.5-Coder-0.5B-Instruct (`s3d_jax.load("qwen2.5-coder-0.5b")`):
the model's own greedy replies to ShareGPT prompts, in stages of at most about three hours of CPU each.

    make qwen
    python -m s3d_jax.self_data --model qwen2.5-coder-0.5b --out data/qwen_coder_replies_1.jsonl --limit 1600 --batch 64 \
        --max-new-tokens 256 --max-prompt-tokens 192
    python -m s3d_jax.train --config configs/qwen_coder.py --workdir runs/qwen_coder_drafter
    python -m s3d_jax.predict --model qwen2.5-coder-0.5b --drafters runs/qwen_coder_drafter/drafter.safetensors --profile 8 \
        --max-new-tokens 96
    python -c "from s3d_jax import drafter; drafter.ship('runs/qwen_coder_drafter/drafter.safetensors', \
        's3d_jax/drafters/Qwen2.5-Coder-0.5B-Instruct.safetensors')"

or `make qwen-drafter`. Every step resumes where a killed run stopped. The replies file is committed
as it grows (data/), so generating them may span sessions.

SmolLM2's shipped recipe (configs/smollm2.py: the verifier's distribution as the target, LoRA rank 32,
a draft head over the 8192 most frequent reply tokens) on the larger model. The reduced draft head
matters more here: Qwen's untied head is 22% of its weights, and a draft pass over the full head costs
0.66-0.79 plain steps on 2 cores (docs/models.md, "What a model four times larger changes"). The skip
range is the paper's hypothesis, half the layers, centred (6-17 of 24); `python -m s3d_jax.predict`
over short runs of this range, 4-19 and 8-15 (`--config.s3d.skip=4,19`) is what decides it.
On the 2-core AMD EPYC of 2026-12-01 the model writes about 21 reply tokens/s at batch 32 in float32,
so 1,600 prompts (about 300k tokens) take about three hours.
"""

from s3d_jax.train.config import sibling_config


def get_config():
    c = sibling_config(__file__, "smollm2")
    c.model_path = "qwen2.5-coder-0.5b"
    c.data.path = "data/qwen_coder_replies_1.jsonl"
    c.s3d.skip = (6, 17)  # 12 of 24 layers skipped, centred
    # 60 steps of 2,560 tokens, half a pass over the stage's 300k: 80-85 s a step on 2 cores, about 85
    # minutes, so that the run, the drafter's profile and its benchmarks fit one session (a session's
    # workdir does not outlive it). The run of 2026-12-03 was planned for 90 steps and cut to 60 at
    # step 35 (the cosine schedule shortened from there) to leave that session time to measure it.
    # Rows of 8 as 2 x 4: the same step as SmolLM2's 8 rows in less memory (17.7 GB at 8 rows at
    # once; 14.7 GB at 2 x 4, docs/training.md).
    c.train.update(steps=60, warmup_steps=8, batch_size=4, grad_accum=2, eval_every=15, checkpoint_every=5)
    return c
