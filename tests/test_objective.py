"""The training objective: what the draft pass sees in training is what it sees at inference."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from reference import tiny_model

from s3d_jax.cache import KVCache, cached_forward
from s3d_jax.objective import Batch, Objective, anchors_of, choose_masks, draft_pass, loss_fn, target_pass
from s3d_jax.speculative import Plan, draft_s3d


def single_batch(tokens, loss_mask=None):
    T = len(tokens)
    return Batch(
        tokens=jnp.asarray([tokens], jnp.int32),
        positions=jnp.arange(T)[None],
        segment_ids=jnp.ones((1, T), jnp.int32),
        loss_mask=jnp.ones((1, T), bool) if loss_mask is None else jnp.asarray([loss_mask]),
    )


@pytest.mark.parametrize("gamma,skip,lora", [(3, (2, 3), 0), (4, (1, 4), 0), (2, (3, 3), 4)])
def test_training_draft_pass_matches_inference(gamma, skip, lora):
    """For each anchor n, the training draft logits at depths 0..γ-1 equal `draft_s3d` run on the
    prefix `x_0 .. x_{n-1}` in the cache and the block `[x_n, <M> ...]`."""
    model = tiny_model(seed=3, draft_lora_rank=lora)
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
    train_logits, anchor = draft_pass(model.params, config, objective, batch, masked, target_kvs)
    anchors = sorted(set(np.asarray(anchor)[0].tolist()))
    assert len(anchors) >= T // gamma
    plan = Plan.make(config, "s3d", gamma, skip)
    for n in anchors:
        if n == 0 or n + gamma > T:
            continue
        cache = KVCache.zeros(config, 1, 32)
        _, cache = cached_forward(model.params, config, cache, jnp.asarray([tokens[:n]]), config.all_layers, True)
        cache = cache.replace(lengths=jnp.asarray([n]))
        _, inference_logits, _ = draft_s3d(model.params, config, plan, cache, jnp.asarray([tokens[n]]), jax.random.key(0))
        np.testing.assert_allclose(np.asarray(train_logits)[0, n : n + gamma], np.asarray(inference_logits)[0], atol=2e-5, rtol=1e-5)


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
