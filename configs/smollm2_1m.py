"""SmolLM2-135M's drafter from a million tokens of its own replies, learning the verifier's whole distribution.

    python -m s3d_jax.self_data --out runs/smollm2_replies_1m.jsonl --batch 64 --max-new-tokens 256 --max-prompt-tokens 192
    python -m s3d_jax.train --config configs/smollm2_1m.py --workdir runs/smollm2_drafter_1m

The shipped recipe (configs/smollm2.py) with ten times the data and these changes:
- the loss is the KL divergence to the verifier's distribution over the draft head's tokens plus the
  cross-entropy against its argmax, which is what greedy verification accepts;
- LoRA rank 32: more data carries more adapter (the drafter file stays under 25 MB);
- bfloat16 compute, which on a CPU with bfloat16 dot products (AVX512-BF16) trains about 1.45x faster
  than float32 (docs/training.md, "Training cost").
About 600 steps of 8 rows x 320 tokens: some 1.3 passes over the replies, two hours on 2 CPU cores,
in pieces if need be (a run started again with the same --workdir resumes).
"""

import importlib.util
from pathlib import Path


def get_config():
    spec = importlib.util.spec_from_file_location("smollm2", Path(__file__).with_name("smollm2.py"))
    shipped = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(shipped)
    c = shipped.get_config()
    c.data.path = "runs/smollm2_replies_1m.jsonl"
    c.data.eval_batches = 8
    c.s3d.update(target="verifier_kl", argmax_weight=1.0, lora_rank=32)
    c.train.update(steps=600, warmup_steps=30, compute_dtype="bfloat16", log_every=5, eval_every=50, checkpoint_every=20)
    return c
