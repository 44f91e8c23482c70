"""The S3D training objective (docs/design.md, "Training objective"), made exact.

One sequence is processed in parallel:
  1. choose masked positions (span or independent); masked inputs become `<M>`;
  2. a full-model pass over the clean sequence gives every layer's target keys and values;
  3. a draft pass over the masked sequence through the draft layers, where position p sees the
     target keys and values before its anchor a(p) and the draft's own from a(p) to p: one
     attention over `[target K/V ; draft K/V]` with a `T x 2T` mask, exactly what p sees at inference;
  4. a loss of position p on masked positions and anchors: cross-entropy against x_{p+1} (the data),
     or against the verifier's own prediction at p (`Objective.target`); accuracy per depth
     j = p - a(p) counts agreement with the verifier's argmax whenever its logits are computed
     (always in evaluation), which is what greedy verification accepts.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax

from s3d_jax.config import ModelConfig
from s3d_jax.model import full_pass, head_logits, lm_logits, never_produced, reduced_logits, run_layers
from s3d_jax.ops import NEG_INF, Band, Context
from s3d_jax.sampling import kth_largest

MASKINGS = ("span", "iid")
LOSS_POSITIONS = ("anchors", "unmasked")
# What the draft learns at each position: the data's next token, or the verifier's own prediction
# there (its argmax, its distribution by KL, or its distribution by total variation, which is one
# minus the chance that speculative sampling accepts the draft).
TARGETS = ("data", "verifier_argmax", "verifier_kl", "verifier_tv")


@dataclasses.dataclass(frozen=True)
class Objective:
    skip: tuple[int, int]
    gamma: int
    masking: str = "span"  # span: anchors each followed by γ-1 masks; iid: the paper's 15%
    mask_prob: float = 0.15  # iid only
    loss_positions: str = "anchors"  # or every unmasked position
    target_grad: bool = False  # let gradients flow through the target keys and values
    head_grad: bool = False  # let the loss reach the head's weights (only when the head trains)
    lm_loss_weight: float = 0.0  # the full model's own next-token loss, to preserve the verifier
    kl_weight: float = 0.0  # KL(original || current) on full-model outputs, to preserve the verifier
    target: str = "data"  # one of TARGETS
    target_temperature: float = 1.0  # verifier_kl: both distributions at this temperature
    target_top_k: int = 0  # verifier_kl: the verifier's k most likely tokens, renormalised (0: all)
    argmax_weight: float = 0.0  # verifier_kl/tv: plus this weight x cross-entropy against the verifier's argmax
    max_depth: int = 8  # depths reported in the metrics

    def __post_init__(self):
        if self.masking not in MASKINGS:
            raise ValueError(f"masking must be one of {MASKINGS}, got {self.masking!r}")
        if self.loss_positions not in LOSS_POSITIONS:
            raise ValueError(f"loss_positions must be one of {LOSS_POSITIONS}, got {self.loss_positions!r}")
        if self.gamma < 1:
            raise ValueError(f"gamma must be >= 1, got {self.gamma}")
        if not 0.0 < self.mask_prob < 1.0:
            raise ValueError(f"mask_prob must be in (0, 1), got {self.mask_prob}")
        if self.target not in TARGETS:
            raise ValueError(f"target must be one of {TARGETS}, got {self.target!r}")
        if not self.target_temperature > 0:
            raise ValueError(f"target_temperature must be > 0, got {self.target_temperature}")
        if self.target_top_k < 0:
            raise ValueError(f"target_top_k must be >= 0, got {self.target_top_k}")
        if self.argmax_weight < 0 or (self.argmax_weight and self.target not in ("verifier_kl", "verifier_tv")):
            raise ValueError(f"argmax_weight must be >= 0 and is for the verifier_kl and verifier_tv targets, got {self.argmax_weight} "
                             f"with target {self.target!r}")

    @property
    def uses_verifier(self) -> bool:
        return self.target != "data"


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Batch:
    tokens: jax.Array  # [B, T] int32
    positions: jax.Array  # [B, T] int32, restarting at 0 in each packed conversation
    segment_ids: jax.Array  # [B, T] int32, 0 for padding
    loss_mask: jax.Array  # [B, T] bool: the token at this position is a training target


def choose_masks(rng, segment_ids_BT, objective: Objective):
    """Masked positions `[B, T]`. The first token of each conversation is never masked."""
    B, T = segment_ids_BT.shape
    p = jnp.arange(T)[None, :]
    if objective.masking == "span":
        offset = jax.random.randint(rng, (B, 1), 0, objective.gamma)
        masked = (p - offset) % objective.gamma != 0
    else:
        masked = jax.random.bernoulli(rng, objective.mask_prob, (B, T))
    previous = jnp.pad(segment_ids_BT[:, :-1], ((0, 0), (1, 0)), constant_values=-1)
    starts = segment_ids_BT != previous
    return masked & ~starts & (segment_ids_BT > 0)


def anchors_of(masked_BT):
    """a(p): the last unmasked position at or before p."""
    p = jnp.broadcast_to(jnp.arange(masked_BT.shape[1]), masked_BT.shape)
    return jax.lax.cummax(jnp.where(masked_BT, 0, p), axis=1)


def _same_segment(batch: Batch):
    """`[B, T, T]`: the pairs in the same conversation. Sliding windows are left to each layer."""
    return batch.segment_ids[:, :, None] == batch.segment_ids[:, None, :]


def target_pass(params, config: ModelConfig, batch: Batch):
    """Full model over the clean sequence: final hidden states and every layer's keys and values."""
    T = batch.tokens.shape[1]
    causal = (jnp.arange(T)[:, None] >= jnp.arange(T)[None, :]) & _same_segment(batch)
    return full_pass(params, config, batch.tokens, batch.positions, causal)


def draft_pass(params, config: ModelConfig, objective: Objective, batch: Batch, masked_BT, target_kvs):
    """Draft-layer logits for the masked sequence, each position seeing what it sees at inference."""
    T = batch.tokens.shape[1]
    anchor = anchors_of(masked_BT)
    s = jnp.arange(T)[None, None, :]
    visible = _same_segment(batch)
    context_mask = (s < anchor[:, :, None]) & visible
    if objective.masking == "span":  # p sees at most γ block keys, p - γ + 1 .. p: a band (anchors start segments)
        block_mask = Band(jnp.arange(T)[None, :, None] - jnp.arange(objective.gamma) >= anchor[:, :, None])
    else:
        block_mask = (s >= anchor[:, :, None]) & (s <= jnp.arange(T)[None, :, None]) & visible
    layers = config.draft_layers(objective.skip)
    draft_tokens = jnp.where(masked_BT, config.mask_token_id, batch.tokens)
    context = Context(*target_kvs, batch.positions, context_mask, block_mask)
    hidden, _ = run_layers(params, config, draft_tokens, batch.positions, context, layers, draft=True)
    return hidden, anchor


def draft_logits_and_labels(params, config: ModelConfig, hidden_BTD, labels_BT):
    """The draft's logits, the labels in their index space, and whether each label can be drafted at all.

    With a reduced draft vocabulary the logits cover only its N tokens (the head's cost, forward and
    backward, shrinks by V/N) and a label outside it, which the drafter can never propose, is not trained on."""
    if not config.draft_vocab_size:
        return head_logits(params, config, hidden_BTD), labels_BT, jnp.ones(labels_BT.shape, bool)
    vocab = params["draft_vocab"]  # ascending
    index = jnp.clip(jnp.searchsorted(vocab, labels_BT), 0, vocab.shape[0] - 1)
    return reduced_logits(params, config, hidden_BTD), index, vocab[index] == labels_BT


def next_token_targets(batch: Batch):
    """x_{p+1} for every p, and whether it is a target: same conversation and in the loss mask."""
    targets = jnp.pad(batch.tokens[:, 1:], ((0, 0), (0, 1)))
    same_next = jnp.pad(batch.segment_ids[:, 1:], ((0, 0), (0, 1))) == batch.segment_ids
    in_loss = jnp.pad(batch.loss_mask[:, 1:], ((0, 0), (0, 1)))
    return targets, same_next & in_loss & (batch.segment_ids > 0)


def target_loss(draft_logits_BTV, labels_BT, verifier_logits_BTV, objective: Objective):
    """Per-position loss `[B, T]` of the draft against what `objective.target` names: cross-entropy
    against `labels` (the data's next token, or the verifier's argmax), or a distance to the verifier's
    distribution over the same vocabulary as the draft's logits."""
    if objective.target in ("data", "verifier_argmax"):
        return optax.softmax_cross_entropy_with_integer_labels(draft_logits_BTV, labels_BT)
    tau = objective.target_temperature
    verifier = verifier_logits_BTV / tau
    if objective.target_top_k:
        verifier = jnp.where(verifier < kth_largest(verifier, objective.target_top_k), NEG_INF, verifier)
    p, log_q = jax.nn.softmax(verifier, -1), jax.nn.log_softmax(draft_logits_BTV / tau, -1)
    if objective.target == "verifier_kl":  # KL(p || q), scaled by τ² so gradients keep their size
        distance = tau**2 * jnp.sum(p * (jnp.log(jnp.maximum(p, 1e-30)) - log_q), -1)
    else:  # verifier_tv
        distance = 0.5 * jnp.sum(jnp.abs(p - jnp.exp(log_q)), -1)
    if objective.argmax_weight:  # the token greedy verification accepts, on top of the distribution
        distance += objective.argmax_weight * optax.softmax_cross_entropy_with_integer_labels(draft_logits_BTV, labels_BT)
    return distance


def loss_fn(params, batch: Batch, rng, *, config: ModelConfig, objective: Objective, original_params=None, report_verifier=False):
    """Returns `(loss, metrics)`; metrics carry per-depth sums so they can be pooled over batches.

    `report_verifier` adds the full model's own next-token loss to the metrics (its perplexity
    shows how much training the shared draft layers changed the verifier)."""
    full_hidden, target_kvs = target_pass(params, config, batch)
    if not objective.target_grad:
        target_kvs = jax.lax.stop_gradient(target_kvs)
    masked = choose_masks(rng, batch.segment_ids, objective)
    draft_hidden, anchor = draft_pass(params, config, objective, batch, masked, target_kvs)

    targets, valid = next_token_targets(batch)
    # The full model's logits, computed once for the verifier's labels and the verifier-preserving terms.
    full_logits = None
    if objective.uses_verifier or report_verifier or objective.lm_loss_weight or objective.kl_weight:
        full_logits = lm_logits(params, config, full_hidden)
    verifier_logits = None  # the verifier's prediction at p: what greedy verification checks a draft against
    if objective.uses_verifier or report_verifier:
        verifier_logits = jax.lax.stop_gradient(never_produced(full_logits, config))
    labels = targets if verifier_logits is None else jnp.argmax(verifier_logits, -1)
    head_params = params if objective.head_grad else {**params, **jax.lax.stop_gradient(_head_tables(params))}
    logits, label_index, draftable = draft_logits_and_labels(head_params, config, draft_hidden,
                                                             targets if objective.target == "data" else labels)
    if config.draft_vocab_size and verifier_logits is not None:  # the verifier's distribution over the same tokens
        verifier_logits = jnp.take(verifier_logits, params["draft_vocab"], axis=-1)
    next_masked = jnp.pad(masked[:, 1:], ((0, 0), (0, 1)))
    every_unmasked = objective.masking == "span" or objective.loss_positions == "unmasked"
    is_anchor = ~masked & (next_masked | every_unmasked)
    selected = (masked | is_anchor) & valid
    trained = selected & draftable
    ce = target_loss(logits, label_index, verifier_logits, objective)
    draft_loss = jnp.sum(jnp.where(trained, ce, 0.0)) / jnp.maximum(trained.sum(), 1)
    loss = draft_loss

    predicted = jnp.argmax(logits, -1)
    if config.draft_vocab_size:
        predicted = params["draft_vocab"][predicted]
    correct = (predicted == labels) & selected
    depth = jnp.arange(batch.tokens.shape[1])[None, :] - anchor
    depth_onehot = (depth[..., None] == jnp.arange(objective.max_depth)) & selected[..., None]
    # Accepted drafts per anchor: positions whose whole run from the anchor was right.
    wrong = jnp.cumsum(selected & ~correct, axis=1)
    wrong_before_anchor = jnp.take_along_axis(jnp.pad(wrong, ((0, 0), (1, 0)))[:, :-1], anchor, axis=1)
    run_ok = selected & (wrong == wrong_before_anchor) & (depth < objective.gamma)
    metrics = {
        "draft_loss_sum": jnp.sum(jnp.where(trained, ce, 0.0)),
        "targets": trained.sum(),
        "selected": selected.sum(),
        "depth_correct": jnp.sum(depth_onehot & correct[..., None], axis=(0, 1)),
        "depth_count": jnp.sum(depth_onehot, axis=(0, 1)),
        "accepted": run_ok.sum(),
        "anchors": (is_anchor & selected).sum(),
    }
    if objective.lm_loss_weight or objective.kl_weight or report_verifier:
        n_valid = jnp.maximum(valid.sum(), 1)
        metrics["lm_targets"] = valid.sum()
        if objective.lm_loss_weight or report_verifier:
            lm_sum = jnp.sum(optax.softmax_cross_entropy_with_integer_labels(full_logits, targets) * valid)
            loss = loss + objective.lm_loss_weight * lm_sum / n_valid
            metrics["lm_loss_sum"] = lm_sum
        if objective.kl_weight:
            original_hidden, _ = target_pass(original_params, config, batch)
            original = jax.lax.stop_gradient(lm_logits(original_params, config, original_hidden))
            kl_sum = jnp.sum(optax.kl_divergence(jax.nn.log_softmax(full_logits), jax.nn.softmax(original)) * valid)
            loss = loss + objective.kl_weight * kl_sum / n_valid
            metrics["kl_sum"] = kl_sum
    return loss, metrics


def _head_tables(params) -> dict:
    """The params the heads read (the vocabulary table, and the reduced draft head's copy of it)."""
    return {name: params[name] for name in ("embed", "lm_head", "draft_head") if name in params}


def summarize_metrics(metrics) -> dict:
    """Pooled `loss_fn` metric sums to readable values: loss, per-depth accuracy, and the implied E."""
    m = jax.device_get(metrics)
    count = m["depth_count"]
    out = {
        "draft_loss": float(m["draft_loss_sum"] / max(m["targets"], 1)),
        "draftable": float(m["targets"] / max(m["selected"], 1)),  # of the trained positions: below 1 with a reduced vocabulary
        "accuracy_per_depth": [float(c / n) if n else float("nan") for c, n in zip(m["depth_correct"], count, strict=True)],
        "expected_tokens_per_iteration": float(1 + m["accepted"] / max(m["anchors"], 1)),
    }
    for name in ("lm_loss", "kl"):
        if f"{name}_sum" in m:
            out[name] = float(m[f"{name}_sum"] / max(m["lm_targets"], 1))
    if "lm_loss" in out:
        out["verifier_perplexity"] = float(np.exp(out["lm_loss"]))
    return out
