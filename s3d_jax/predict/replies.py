"""What the predictor measures on the model's own greedy replies to MT-Bench's first turns: decoding
speed, the draft's ranks of the next tokens, and what each kind of tree iteration would do."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from s3d_jax import api, tree
from s3d_jax.bench.methods import decode_prompts
from s3d_jax.bench.suites import load_suite
from s3d_jax.cache import prompt_forward
from s3d_jax.decoding import top_probability
from s3d_jax.model import head_logits
from s3d_jax.options import DecodeOptions, bucket
from s3d_jax.speculative import Plan, draft, draft_s3d


def first_turns(questions: int) -> list[dict]:
    return [{**q, "turns": q["turns"][:1]} for q in load_suite("mt_bench", questions)]


def measure(model, questions: int, options: DecodeOptions):
    """Decodes the first turn of `questions` MT-Bench questions: (tokens/s, pooled accept histogram)."""
    decoded = decode_prompts(model, {"mt_bench": first_turns(questions)}, options)
    return decoded.tokens_per_second, decoded.histogram


def greedy_replies(model, questions: int, max_new_tokens: int) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, the model's plain greedy reply) for the first turn of `questions` MT-Bench questions."""
    replies = []
    for q in first_turns(questions):
        messages = [{"role": "user", "content": q["turns"][0]}]
        reply = api.decode(model, messages, chat=True, method="ar", max_new_tokens=max_new_tokens).tokens
        replies.append((api.encode(model, messages, chat=True)[0][0], reply))
    return replies


def draft_ranks(model, replies, gamma: int) -> list[np.ndarray]:
    """Per reply, `[positions, γ]`: at every position n of the reply, the rank (0: the first choice) of
    the tokens n+1 .. n+γ in the draft distributions of one S3D pass from x_n, the cache holding the
    full model's entries before n, as in decoding. Greedy decoding visits exactly these tokens."""
    config = model.config
    plan = Plan.make(config, "s3d", gamma=gamma, skip=config.draft_skip)

    @jax.jit
    def ranks(params, ids, positions):
        _, cache = prompt_forward(params, config, ids[None], ids.shape[0])

        def at(n):
            seen = jnp.where(jnp.arange(ids.shape[0]) <= n, ids, 0)[None]  # the context so far, as decoding has it
            _, logits, _ = draft_s3d(params, config, plan, cache.replace(lengths=n[None]), ids[n][None], jax.random.key(0), seen)
            own = jnp.take_along_axis(logits[0], jax.lax.dynamic_slice(ids, (n + 1,), (gamma,))[:, None], axis=1)
            return jnp.sum(logits[0] > own, axis=1)

        return jax.lax.map(at, positions)

    out = []
    for prompt, reply in replies:
        positions = np.arange(len(prompt), len(prompt) + len(reply) - gamma)
        if len(positions):
            out.append(np.asarray(ranks(model.params, *bucketed(prompt + reply, positions)))[: len(positions)])
    return out


def bucketed(ids: list[int], positions: np.ndarray, room: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """`ids` zero-padded to a bucket with at least `room` slots past the end, and `positions` repeated
    to a bucket: a jitted pass over them compiles once per pair of buckets."""
    padded_ids = np.zeros(bucket(len(ids) + room), np.int32)
    padded_ids[: len(ids)] = ids
    return padded_ids, np.resize(positions, bucket(len(positions)))


def iteration_outcomes(model, replies, plan: Plan) -> list[dict]:
    """Per reply, arrays over its positions n (x_n a token of the reply, the cache holding the full
    model's entries before n, as in decoding): `certainty` (the verifier's top probability where it
    picked x_n), `drafted` (drafts the plan's tree would accept), `branch` (whether the context
    supplies the branch alone) and `branch_k` (drafts the branch alone would accept)."""
    config, key = model.config, jax.random.key(0)

    @jax.jit
    def outcomes(params, ids, positions):
        hidden, cache = prompt_forward(params, config, ids[None], ids.shape[0])
        certainty = top_probability(head_logits(params, config, hidden)[0])  # at p: where the verifier picked ids[p + 1]

        def at(n):
            seen = jnp.where(jnp.arange(ids.shape[0]) <= n, ids, 0)[None]  # the context so far, as decoding has it
            at_n, x_n = cache.replace(lengths=n[None]), ids[n][None]

            def accepted(nodes):
                logits, _ = tree.verify_block(params, config, at_n, nodes, plan.reach)
                return tree.accept(key, nodes, logits, plan.reach, plan.sampling)[0][0]

            _, draft_logits, _ = draft(params, config, plan, at_n, x_n, key, seen)
            branch, known, matched = tree.context_branch(seen, n[None], plan.reach)
            suffices = tree.branch_suffices(known[:, : plan.gamma], matched, jnp.zeros((1,), bool))
            return {"certainty": certainty[n - 1], "drafted": accepted(tree.build(x_n, draft_logits, plan.tree)),
                    "branch": suffices, "branch_k": accepted(tree.graft(tree.root(x_n), branch, known))}

        return jax.lax.map(at, positions)

    out = []
    for prompt, reply in replies:
        positions = np.arange(len(prompt), len(prompt) + len(reply) - 1)
        padded = outcomes(model.params, *bucketed(prompt + reply, positions, room=plan.reach))  # room for the tree's slots
        out.append({k: np.asarray(v)[: len(positions)] for k, v in padded.items()})
    return out
