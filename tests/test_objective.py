"""The training objective: what the draft pass sees in training is what it sees at inference."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from reference import draft_logits_after, tiny_model

from s3d_jax.checkpoint import Model
from s3d_jax.drafter import with_draft_vocab
from s3d_jax.model import NEG_INF
from s3d_jax.objective import (
    Batch,
    Objective,
    anchors_of,
    choose_masks,
    draft_logits_and_labels,
    draft_pass,
    loss_fn,
    target_pass,
)
from s3d_jax.speculative import Plan


def single_batch(tokens, loss_mask=None):
    T = len(tokens)
    return Batch(
        tokens=jnp.asarray([tokens], jnp.int32),
        positions=jnp.arange(T)[None],
        segment_ids=jnp.ones((1, T), jnp.int32),
        loss_mask=jnp.ones((1, T), bool) if loss_mask is None else jnp.asarray([loss_mask]),
    )


@pytest.mark.parametrize("gamma,skip,lora,vocab", [(3, (2, 3), 0, 0), (4, (1, 4), 0, 0), (2, (3, 3), 4, 0), (3, (1, 2), 4, 40)])
def test_training_draft_pass_matches_inference(gamma, skip, lora, vocab):
    """For each anchor n, the training draft logits at depths 0..γ-1 equal `draft_s3d` run on the
    prefix `x_0 .. x_{n-1}` in the cache and the block `[x_n, <M> ...]` (with a reduced draft head:
    over its tokens, the only ones the inference draft scores)."""
    model = tiny_model(seed=3, draft_lora_rank=lora, draft_skip=skip if lora else None)
    if vocab:
        ranking = np.random.default_rng(1).permutation(model.config.mask_token_id).astype(np.int32)
        params, config = with_draft_vocab(model.params, model.config, ranking, vocab)
        model = Model(params, config, model.tokenizer)
    if lora:  # non-zero adapters, so that the test would see them being ignored
        model.params = jax.tree_util.tree_map_with_path(
            lambda p, x: x + 0.05 if "_lora" in jax.tree_util.keystr(p) else x, model.params
        )
    config, T = model.config, 17
    tokens = np.random.default_rng(gamma).integers(0, config.mask_token_id, T).tolist()
    batch = single_batch(tokens)
    objective = Objective(skip=skip, gamma=gamma, masking="span")
    masked = choose_masks(jax.random.key(gamma), batch.segment_ids, objective)
    _, target_kvs = target_pass(model.params, config, batch)
    hidden, anchor = draft_pass(model.params, config, objective, batch, masked, target_kvs)
    train_logits = draft_logits_and_labels(model.params, config, hidden, jnp.zeros(hidden.shape[:2], jnp.int32))[0]
    anchors = sorted(set(np.asarray(anchor)[0].tolist()))
    assert len(anchors) >= T // gamma
    plan = Plan.make(config, "s3d", gamma=gamma, skip=skip)
    for n in anchors:
        if n == 0 or n + gamma > T:
            continue
        inference_logits = np.asarray(draft_logits_after(model.params, config, plan, jnp.asarray([tokens]), jnp.int32(n)))
        if vocab:
            scored = np.asarray(model.params["draft_vocab"])
            assert np.all(np.delete(inference_logits, scored, axis=-1) == NEG_INF), "only the draft vocabulary is scored"
            inference_logits = inference_logits[:, scored]
        np.testing.assert_allclose(np.asarray(train_logits)[0, n : n + gamma], inference_logits, atol=2e-5, rtol=1e-5)


def test_span_masks_follow_anchors():
    segment_ids = jnp.asarray([[1] * 6 + [2] * 5 + [0] * 3])
    masked = np.asarray(choose_masks(jax.random.key(0), segment_ids, Objective(skip=(1, 2), gamma=3)))[0]
    assert not masked[0] and not masked[6], "each conversation starts unmasked"
    assert not masked[11:].any(), "padding is never masked"
    anchor = np.asarray(anchors_of(jnp.asarray([masked])))[0]
    assert np.all(np.arange(14) - anchor < 3), "spans are at most gamma long"
    assert np.all(anchor[6:11] >= 6), "spans never cross conversations"


def test_iid_masking_rate():
    segment_ids = jnp.ones((64, 128), jnp.int32)
    masked = choose_masks(jax.random.key(1), segment_ids, Objective(skip=(1, 2), gamma=3, masking="iid"))
    assert abs(float(masked[:, 1:].mean()) - 0.15) < 0.01


def test_loss_counts_only_targets_in_the_loss_mask():
    model = tiny_model(seed=2)
    tokens = list(range(1, 13))
    batch = single_batch(tokens, loss_mask=[False] * 6 + [True] * 6)
    _, metrics = loss_fn(model.params, batch, jax.random.key(0), config=model.config, objective=Objective(skip=(2, 3), gamma=3))
    # Positions 5..10 predict tokens 6..11, which are in the mask; position 11 has no next token.
    assert int(metrics["targets"]) == 6


# ------------------------------------------------------------------ distillation targets


def _verifier_logits(seed=0, shape=(2, 5, 11)):
    return jax.random.normal(jax.random.key(seed), shape) * 3.0


def test_verifier_argmax_loss_vanishes_exactly_when_the_draft_argmax_agrees():
    from s3d_jax.objective import target_loss

    verifier = _verifier_logits()
    objective = Objective(skip=(1, 2), gamma=2, target="verifier_argmax")
    agree = 200.0 * jax.nn.one_hot(jnp.argmax(verifier, -1), verifier.shape[-1])
    disagree = 200.0 * jax.nn.one_hot((jnp.argmax(verifier, -1) + 1) % verifier.shape[-1], verifier.shape[-1])
    labels = jnp.argmax(verifier, -1)  # what loss_fn passes for this target
    assert float(jnp.max(target_loss(agree, labels, verifier, objective))) < 1e-6
    assert float(jnp.min(target_loss(disagree, labels, verifier, objective))) > 100.0


@pytest.mark.parametrize("top_k", [0, 3])
def test_kl_and_tv_targets_vanish_for_equal_distributions(top_k):
    from s3d_jax.model import NEG_INF
    from s3d_jax.objective import target_loss

    verifier = _verifier_logits(seed=1)
    data = jnp.zeros(verifier.shape[:2], jnp.int32)
    draft = verifier
    if top_k:  # the draft equals the verifier's renormalised top-k
        kth = jax.lax.top_k(verifier, top_k)[0][..., -1:]
        draft = jnp.where(verifier < kth, NEG_INF, verifier)
    for target, tau in (("verifier_kl", 1.0), ("verifier_kl", 2.0), ("verifier_tv", 1.0)):
        objective = Objective(skip=(1, 2), gamma=2, target=target, target_temperature=tau, target_top_k=top_k)
        assert float(jnp.max(jnp.abs(target_loss(draft, data, verifier, objective)))) < 1e-5
        other = target_loss(_verifier_logits(seed=2), data, verifier, objective)
        assert float(jnp.min(other)) > 1e-3
        if target == "verifier_tv":
            assert float(jnp.max(other)) <= 1.0


def test_argmax_weight_adds_the_cross_entropy_against_the_verifiers_argmax():
    import optax

    from s3d_jax.objective import target_loss

    verifier, draft = _verifier_logits(seed=1), _verifier_logits(seed=2)
    labels = jnp.argmax(verifier, -1)
    for target in ("verifier_kl", "verifier_tv"):
        alone = target_loss(draft, labels, verifier, Objective(skip=(1, 2), gamma=2, target=target))
        mixed = target_loss(draft, labels, verifier, Objective(skip=(1, 2), gamma=2, target=target, argmax_weight=0.5))
        ce = optax.softmax_cross_entropy_with_integer_labels(draft, labels)
        np.testing.assert_allclose(mixed, alone + 0.5 * ce, rtol=1e-5)
    for target in ("data", "verifier_argmax"):  # their loss is the cross-entropy already
        with pytest.raises(ValueError, match="argmax_weight"):
            Objective(skip=(1, 2), gamma=2, target=target, argmax_weight=1.0)


@pytest.mark.parametrize("target", ["data", "verifier_argmax", "verifier_kl", "verifier_tv"])
def test_every_target_trains_with_finite_gradients(target):
    model = tiny_model(seed=3)
    config = model.config
    tokens = np.random.default_rng(0).integers(0, config.mask_token_id, 24).tolist()
    objective = Objective(skip=(2, 3), gamma=3, target=target, target_top_k=8 if target == "verifier_kl" else 0)
    grads, metrics = jax.grad(loss_fn, has_aux=True)(
        model.params, single_batch(tokens), jax.random.key(0), config=config, objective=objective
    )
    assert all(bool(jnp.all(jnp.isfinite(g))) for g in jax.tree.leaves(grads))
    assert float(metrics["targets"]) > 0
