"""The drafter shipped for the bundled SmolLM2-135M-Instruct: a million tokens of its own replies, learning
the verifier's whole distribution.

    python -m s3d_jax.self_data --out runs/smollm2_replies_1m.jsonl --limit 5300 --batch 64 --max-new-tokens 256 --max-prompt-tokens 192
    python -m s3d_jax.train --config configs/smollm2.py --workdir runs/smollm2_drafter
    python -m s3d_jax.predict --drafters runs/smollm2_drafter/drafter.safetensors --profile 24 --max-new-tokens 128

or `make drafter`, which runs all three. Every step resumes where a killed run stopped.

The recipe of configs/smollm2_small.py (docs/design.md, "Training objective") with ten times the data
and these changes:
- the loss is the KL divergence to the verifier's distribution over the draft head's tokens plus the
  cross-entropy against its argmax, which is what greedy verification accepts;
- LoRA rank 32: more data carries more adapter (the drafter file is 19.8 MB);
- bfloat16 compute, which on a CPU with bfloat16 dot products (AVX512-BF16) trains about 1.4x faster
  than float32 (docs/training.md, "Training cost").
5,300 prompts give about 1.02M reply tokens (192 a reply). 480 steps of 8 rows x 320 tokens are one
pass over them: about 75 minutes on 2 CPU cores alone, 2 hours beside other work.
"""

from s3d_jax.train.config import sibling_config


def get_config():
    c = sibling_config(__file__, "smollm2_small")
    c.data.path = "runs/smollm2_replies_1m.jsonl"
    c.data.eval_batches = 8
    c.s3d.update(target="verifier_kl", argmax_weight=1.0, lora_rank=32)
    c.train.update(steps=480, warmup_steps=30, compute_dtype="bfloat16", log_every=5, eval_every=40, checkpoint_every=20)
    return c
