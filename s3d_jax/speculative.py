"""Drafting and verification: one speculative iteration, as docs/design.md states it.

The cache holds full-model keys and values for positions `[0, n)`; `x_n` is known but not cached.
  draft   propose `d_1 .. d_γ` from the draft layers (all layers outside the skip range)
  verify  run `[x_n, d_1 .. d_γ]` through every layer, writing positions `n .. n+γ`
  accept  keep the longest agreeing prefix `d_1 .. d_k` plus one token from the verifier

Methods, one engine:
  ar        γ = 0: no draft, the verifier alone is plain autoregressive decoding
  s3d       one draft pass over `[x_n, <M> × (γ-1)]` that attends to the cache and does not write it
  selfspec  γ draft passes of one token each (Draft & Verify), looped, not unrolled; they write
            draft-layer entries at positions `n ..`, which are stale and which verification overwrites
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from s3d_jax.cache import KVCache, cached_forward
from s3d_jax.config import ModelConfig
from s3d_jax.model import draft_head_logits, head_logits
from s3d_jax.sampling import Sampling, argmax, choose, log_probs


@dataclasses.dataclass(frozen=True)
class Plan:
    """Static description of how one iteration drafts and samples (hashable: a jit static)."""

    method: str
    gamma: int
    skip: tuple[int, int] | None  # inclusive range of layers the draft skips; None for "ar"
    draft_layers: tuple[int, ...]
    sampling: Sampling
    tree: int = 0  # > 0: verify a token tree of this many nodes instead of the argmax chain
    lookup: bool = False  # with a tree: verify a branch copied from the context alone when it suffices (tree.graft)
    min_certainty: float = 0.0  # with a tree: draft only where the verifier picked x_n with at least this probability
    # > 0 (a calibrated greedy tree): a drafted iteration's cost in plain steps. Each row then learns where
    # drafting pays, apart below and at or above `min_certainty`: it drafts there while its drafted
    # iterations there have emitted about this many tokens each (decoding.wants_draft).
    drafted_cost: float = 0.0

    @classmethod
    def make(cls, config: ModelConfig, method: str, *, gamma: int = 0, skip=None, sampling: Sampling | None = None, tree: int = 0,
             lookup: bool = False, min_certainty: float = 0.0, drafted_cost: float = 0.0) -> Plan:
        """The plan, its draft layers read off the config (`planning.plan_for` resolves a request into one)."""
        draft_layers = config.draft_layers(skip) if skip is not None else ()
        return cls(method, int(gamma), None if skip is None else tuple(skip), draft_layers, sampling or Sampling(), int(tree),
                   bool(lookup), float(min_certainty), float(drafted_cost))

    @property
    def nodes(self) -> int:
        """A tree's slots: its N nodes, and with the context branch γ more, which the branch verified
        alone runs through."""
        return self.tree + self.gamma * self.lookup

    @property
    def reach(self) -> int:
        """The most drafts an iteration can accept: γ, or with the context branch the tree's slots,
        which the branch fills when it is verified alone."""
        return self.nodes if self.tree and self.lookup else self.gamma

    @property
    def block(self) -> int:
        """Cache slots an iteration writes past `n`: the γ drafts, or the tree's slots."""
        return max(self.gamma, self.nodes)


def draft_s3d(params, config: ModelConfig, plan: Plan, cache: KVCache, x_n_B, rng, context_BL=None):
    B = x_n_B.shape[0]
    masks = jnp.full((B, plan.gamma - 1), config.mask_token_id, jnp.int32)
    block = jnp.concatenate([x_n_B[:, None], masks], axis=1)
    hidden, _ = cached_forward(params, config, cache, block, plan.draft_layers, write=False, draft=True)
    logits = draft_head_logits(params, config, hidden, context_BL, cache.lengths + 1)  # the context: x_0 .. x_n
    return choose(rng, logits, plan.sampling), logits, cache


def draft_selfspec(params, config: ModelConfig, plan: Plan, cache: KVCache, x_n_B, rng, context_BL=None):
    """γ one-token draft passes in a `fori_loop`: one pass is compiled, not γ unrolled copies."""
    B, n = x_n_B.shape[0], cache.lengths
    rngs = jax.random.split(rng, plan.gamma)

    def step(j, carry):
        token_B, drafts_BG, logits_BGV, cache = carry
        hidden, cache = cached_forward(
            params, config, cache.replace(lengths=n + j), token_B[:, None], plan.draft_layers, write=True, draft=True
        )
        step_logits_BV = draft_head_logits(params, config, hidden, context_BL, n + 1)[:, 0]
        token_B = choose(rngs[j], step_logits_BV, plan.sampling)
        return token_B, drafts_BG.at[:, j].set(token_B), logits_BGV.at[:, j].set(step_logits_BV), cache

    drafts_BG = jnp.zeros((B, plan.gamma), jnp.int32)
    logits_BGV = jnp.zeros((B, plan.gamma, config.vocab_size), jnp.float32)
    _, drafts_BG, logits_BGV, cache = jax.lax.fori_loop(0, plan.gamma, step, (x_n_B, drafts_BG, logits_BGV, cache))
    return drafts_BG, logits_BGV, cache.replace(lengths=n)


def draft(params, config: ModelConfig, plan: Plan, cache: KVCache, x_n_B, rng, context_BL=None):
    """Returns `(drafts [B, γ], draft logits [B, γ, V], cache)`. `context_BL`: each row's tokens so far,
    which a reduced draft head also scores (`draft_head_logits`)."""
    if plan.method == "ar":
        B = x_n_B.shape[0]
        return jnp.zeros((B, 0), jnp.int32), jnp.zeros((B, 0, config.vocab_size), jnp.float32), cache
    fn = {"s3d": draft_s3d, "selfspec": draft_selfspec}[plan.method]
    return fn(params, config, plan, cache, x_n_B, rng, context_BL)


def verify(params, config: ModelConfig, cache: KVCache, x_n_B, drafts_BG):
    """Full-model logits `[B, γ+1, V]` for `[x_n, d_1 .. d_γ]`, writing their cache entries."""
    block = jnp.concatenate([x_n_B[:, None], drafts_BG], axis=1)
    hidden, cache = cached_forward(params, config, cache, block, config.all_layers, write=True)
    return head_logits(params, config, hidden), cache


def accept(rng, drafts_BG, draft_logits_BGV, target_logits_BTV, sampling: Sampling):
    """Returns `(k [B], emitted [B, γ+1])`: `emitted[:, :k]` are the accepted drafts, `emitted[:, k]`
    the verifier's token. Greedy keeps drafts equal to the verifier's argmax; sampling is lossless
    (accept with min(1, p/q), resample the first rejection from norm(max(0, p - q)))."""
    B, G = drafts_BG.shape
    if sampling.greedy:
        target_BT = argmax(target_logits_BTV)
        agree = drafts_BG == target_BT[:, :G]
        k = jnp.sum(jnp.cumprod(agree, axis=1), axis=1)
        return k, target_BT  # target equals the draft wherever the draft was accepted
    accept_rng, resample_rng = jax.random.split(rng)
    p_BTV = jnp.exp(log_probs(target_logits_BTV, sampling))
    q_BGV = jnp.exp(log_probs(draft_logits_BGV, sampling))
    p_drafts = jnp.take_along_axis(p_BTV[:, :G], drafts_BG[..., None], axis=-1)[..., 0]
    q_drafts = jnp.take_along_axis(q_BGV, drafts_BG[..., None], axis=-1)[..., 0]
    u = jax.random.uniform(accept_rng, (B, G))
    k = jnp.sum(jnp.cumprod(u * q_drafts < p_drafts, axis=1), axis=1)
    # After the last draft nothing was proposed, so the residual there is p itself.
    q_padded = jnp.concatenate([q_BGV, jnp.zeros_like(p_BTV[:, :1])], axis=1)
    p_k = jnp.take_along_axis(p_BTV, k[:, None, None], axis=1)[:, 0]
    residual = jnp.maximum(p_k - jnp.take_along_axis(q_padded, k[:, None, None], axis=1)[:, 0], 0.0)
    residual = jnp.where(jnp.sum(residual, -1, keepdims=True) > 0, residual, p_k)  # p == q up to rounding
    final = jax.random.categorical(resample_rng, jnp.log(residual), axis=-1).astype(jnp.int32)
    j = jnp.arange(G + 1)[None, :]
    drafts_padded = jnp.concatenate([drafts_BG, jnp.zeros((B, 1), jnp.int32)], axis=1)
    return k, jnp.where(j < k[:, None], drafts_padded, final[:, None])
