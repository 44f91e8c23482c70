"""The shipped SmolLM2 drafter's recipe at the paper's scale, for a GPU: the model's own replies to every
ShareGPT user turn that fits, one epoch of batch 64 at 2,048 tokens as the paper trains: about 15M reply
tokens among some 43M (estimates: the replies' lengths decide), days on 2 CPU cores, hours on one GPU.

    python -m s3d_jax.self_data --out runs/smollm2_replies_paper.jsonl --later-turns --batch 256 \\
        --max-new-tokens 512 --max-prompt-tokens 1536
    python -m s3d_jax.train --config configs/smollm2_paper.py --workdir runs/smollm2_drafter_paper

or `bash tools/gpu_bench.sh paper`, which runs both and benchmarks the drafter. Both resume where a
killed run stopped.

`--later-turns` answers each later user turn after the conversation's history as ShareGPT holds it,
so only the last reply of a line is the model's own, and `data.loss_on = "last"` trains on it alone.
About 52k turns have at most 1,536 tokens of history (of the 61k in the installed ShareGPT file's
17k conversations). Rows are packed (`data.pack`), and 350 steps of 64 rows are about one epoch.
The recipe otherwise is configs/smollm2.py's: KL to the verifier plus its argmax, LoRA rank 32, bfloat16.
"""

from s3d_jax.train.config import sibling_config


def get_config():
    c = sibling_config(__file__, "smollm2")
    c.data.update(path="runs/smollm2_replies_paper.jsonl", loss_on="last", max_len=2048, pack=True, eval_batches=16)
    c.train.update(steps=350, batch_size=8, grad_accum=8, warmup_steps=50, log_every=5, eval_every=50, checkpoint_every=25)
    return c
