"""A drafter's acceptance profile, which `decode` chooses its drafting policy from (with this machine's
pass costs, `s3d_jax.calibrate`): at every position of the model's own greedy replies to held-out
ShareGPT prompts, the verifier's certainty of x_n, what a drafted tree of each size would accept,
and what the context branch alone would (`replies.iteration_outcomes`). It is written into the
drafter file, so the file carries what it takes to decide where drafting pays on any machine.

    python -m s3d_jax.predict --drafters s3d_jax/drafters/SmolLM2-135M-Instruct.safetensors --profile 16
"""

from __future__ import annotations

import dataclasses
import sys

import numpy as np

from s3d_jax import api, data, planning, self_data
from s3d_jax import drafter as drafter_lib
from s3d_jax.options import DecodeOptions
from s3d_jax.predict.replies import iteration_outcomes

TREES = (4, 8, 16)  # the tree sizes the policy chooses among
HELD_OUT = 0.05  # the drafter recipe's data.eval_fraction (configs/smollm2.py): prompts it never trained on
MAX_PROMPT_TOKENS = 128


def held_out_replies(model, count: int, max_new_tokens: int) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, plain greedy reply) for the first `count` held-out ShareGPT first turns, decoded as one batch."""
    prompts = [p for p in self_data.prompts_from(None, model.tokenizer, MAX_PROMPT_TOKENS) if data.is_held_out(p.conversation, HELD_OUT)]
    conversations = [list(p.messages) for p in prompts[:count]]
    if not conversations:
        raise ValueError("no held-out ShareGPT prompts to profile the drafter on")
    replies = api.decode(model, conversations, method="ar", chat=True, max_new_tokens=max_new_tokens).tokens
    return [(api.encode(model, c, chat=True)[0][0], r) for c, r in zip(conversations, replies, strict=True) if len(r) > 1]


def measure(model, replies) -> dict:
    """{tree size: per-reply outcomes} for each of `TREES`, with the context branch, at the drafter's γ."""
    profile = {}
    for size in TREES:
        print(f"profiling a tree of {size} on {len(replies)} replies ...", file=sys.stderr)
        plan = planning.plan_for(model.config, DecodeOptions(tree=size, lookup=True, min_certainty=0.0))
        profile[size] = [{"certainty": np.round(o["certainty"].astype(np.float64), 4), "drafted": o["drafted"].astype(int),
                          "branch": o["branch"].astype(int), "branch_k": o["branch_k"].astype(int)}
                         for o in iteration_outcomes(model, replies, plan)]
    return profile


def write(path: str, count: int, max_new_tokens: int, base: str | None = None) -> dict:
    """Measures the profile of the drafter file at `path` (applied to `base`) and writes it into the file."""
    model = api.load(base, drafter=path)
    profile = measure(model, held_out_replies(model, count, max_new_tokens))
    drafter_lib.save(path, dataclasses.replace(drafter_lib.load_file(path), profile=profile))
    positions = sum(len(reply["certainty"]) for reply in profile[TREES[0]])
    print(f"wrote the acceptance profile of trees {list(TREES)} over {positions} positions into {path}", file=sys.stderr)
    return profile
