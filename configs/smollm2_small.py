"""A drafter for the bundled SmolLM2-135M-Instruct in about an hour on 2 CPU cores: the recipe of the
drafter shipped before the million-token one (configs/smollm2.py), and the base that recipe extends.

    python -m s3d_jax.self_data --out runs/smollm2_replies.jsonl --limit 640 --batch 16 --max-new-tokens 192 --max-prompt-tokens 128
    python -m s3d_jax.train --config configs/smollm2_small.py --workdir runs/smollm2_drafter_small

The recipe (docs/design.md, "Training objective"): the model's own greedy replies to ShareGPT prompts,
the verifier's argmax as the label, draft-only LoRA plus the mask row (the verifier stays the
original model, bit for bit), and a draft head over the 8192 most frequent reply tokens (counted over the replies and
ShareGPT's assistant turns). The drafter asks for a token tree of 4 nodes (with the context branch, on with
every tree): on this CPU a verify pass grows with its rows, and with the branch verified alone whenever
the context supplies it, 4 nodes were faster than 16, 8 and 2 on MT-Bench, HumanEval and news (docs/experiments.md,
"The branch alone"); measured again once a drafted tree no longer carried the branch, 2 and 4 were
within noise and 8 slower (docs/experiments.md, "A drafted tree verified alone"). On a memory-bound device, where
rows are nearly free, `tree=16` accepts more.
"""

from s3d_jax.data import default_sharegpt_path
from s3d_jax.train.config import default_config


def get_config():
    c = default_config()
    c.model_path = "bundled"
    c.data.path = "runs/smollm2_replies.jsonl"
    c.s3d.skip = (7, 21)  # 15 of 30 layers, centred: the paper's best region
    c.s3d.gamma = 4
    c.s3d.update(target="verifier_argmax", lora_rank=16, draft_vocab=8192, draft_vocab_data=str(default_sharegpt_path()),
                 tree=4)
    c.data.max_len = 320  # prompts of at most 128 tokens and replies of at most 192
    c.data.eval_fraction = 0.05
    c.data.eval_batches = 4
    # Batch 8 sequences x 320 tokens, about 20 s a step on 2 CPU cores (50 minutes); adapters start at zero, so a LoRA-sized lr.
    c.train.update(steps=150, batch_size=8, grad_accum=1, lr=1e-3, warmup_steps=15, compute_dtype="float32",
                   log_every=5, eval_every=30, checkpoint_every=10)
    return c
