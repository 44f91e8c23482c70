"""What trains and how: the trainable masks, the optax optimizer, and the step (gradient
accumulation over micro-batches, frozen values kept bit-identical) and held-out evaluation."""

from __future__ import annotations

import dataclasses

import chex
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
from flax import traverse_util

from s3d_jax.config import ModelConfig
from s3d_jax.objective import Batch, Objective, loss_fn
from s3d_jax.quant import cast_params
from s3d_jax.sharding import split_over_data
from s3d_jax.train.config import objective_from

# ------------------------------------------------------------------ what trains


def trainable_mask(params, config: ModelConfig, skip: tuple[int, int], train_head: bool, lora: bool):
    """Per parameter: True (trains), False (frozen), or for the embedding a `[1, V]` mask of
    its token columns.

    The skipped middle layers never train. With draft-only LoRA only the adapters and the mask
    row train, so the verifier stays bit-identical to the original model."""
    draft_layers = np.isin(np.arange(config.num_layers), config.draft_layers(skip))

    def of_draft_layers(x):  # a layer stack `[L, ...]`: its draft layers' entries
        return jnp.asarray(draft_layers).reshape(-1, *[1] * (x.ndim - 1))

    def rule(path, x):
        name = jax.tree_util.keystr(path)
        if name.startswith("['draft_vocab']") or name.startswith("['draft_head']"):
            return False  # the reduced draft head is a copy of the head's columns
        if "_lora" in name:  # stacked over the draft layers only
            return True
        if name.startswith("['embed']"):
            if train_head and config.tie_embeddings and not lora:
                return True
            return jnp.arange(config.vocab_size)[None, :] == config.mask_token_id
        if name.startswith("['lm_head']") or name.startswith("['final_norm']"):
            return train_head and not lora
        return False if lora else of_draft_layers(x)

    return jax.tree_util.tree_map_with_path(rule, params)


def _label(mask) -> str:
    return "frozen" if mask is False else "train"


def make_optimizer(t: ml_collections.ConfigDict, masks):
    """AdamW with warm-up, cosine decay and gradient clipping on what trains; `(optimizer, schedule)`."""
    schedule = optax.warmup_cosine_decay_schedule(
        0.0, t.lr, t.warmup_steps, max(t.steps, t.warmup_steps + 1), end_value=t.lr * t.final_lr_fraction
    )
    adamw = optax.chain(
        optax.clip_by_global_norm(t.grad_clip),
        optax.adamw(schedule, b1=t.b1, b2=t.b2, weight_decay=t.weight_decay),
    )
    labels = jax.tree.map(_label, masks, is_leaf=lambda x: isinstance(x, bool))
    return optax.multi_transform({"train": adamw, "frozen": optax.set_to_zero()}, labels), schedule


def _split(params, masks):
    """(what trains, what is frozen) as flat `{path: leaf}` dicts: gradients are taken of the first only."""
    flat, flat_masks = traverse_util.flatten_dict(params), traverse_util.flatten_dict(masks)
    trains = {k: v for k, v in flat.items() if flat_masks[k] is not False}
    return trains, {k: v for k, v in flat.items() if k not in trains}


def _masked(tree, masks):
    """Zeroes what is frozen (whole leaves or embedding rows)."""
    return jax.tree.map(lambda x, m: jnp.zeros_like(x) if m is False else x * m, tree, masks)


def _apply(params, updates, masks):
    # `where` rather than `p + 0`: frozen values stay bit-identical, signed zeros included.
    return jax.tree.map(lambda p, u, m: p if m is False else jnp.where(m, p + u, p), params, updates, masks)


# ------------------------------------------------------------------ batches


def _check_batch(batch: Batch, rank: int) -> None:
    """Every field of a batch has the same shape: `[accum, B, T]` for a step, `[B, T]` for evaluation."""
    chex.assert_rank(batch.tokens, rank)
    chex.assert_equal_shape(jax.tree.leaves(batch))


def place_batch(rows: dict, mesh: jax.sharding.Mesh, accum: int) -> Batch:
    """A step's `[accum, B, T]` batch from `[accum * B, T]` rows, split over the mesh's data axis."""
    batch = Batch(**split_over_data(rows, mesh, accum))
    _check_batch(batch, rank=3)
    return batch


# ------------------------------------------------------------------ state and steps


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class TrainState:
    step: jax.Array
    params: dict
    opt_state: optax.OptState
    rng: jax.Array  # raw uint32 key data, so that orbax stores it plainly


@dataclasses.dataclass(frozen=True, eq=False)
class Trainer:
    """Static pieces of a run: model config, objective, optimizer, trainable masks and precision."""

    config: ModelConfig
    objective: Objective
    optimizer: optax.GradientTransformation
    masks: object
    compute_dtype: str = "float32"

    def compute_params(self, params):
        return cast_params(params, jnp.dtype(self.compute_dtype))

    def init(self, params, seed: int) -> TrainState:
        return TrainState(jnp.zeros((), jnp.int32), params, self.optimizer.init(params), jax.random.key_data(jax.random.key(seed)))

    def loss(self, params, batch: Batch, rng, original_params=None):
        compute_config = self.config.replace(dtype=self.compute_dtype)
        original = None if original_params is None else self.compute_params(original_params)
        return loss_fn(self.compute_params(params), batch, rng, config=compute_config, objective=self.objective, original_params=original)

    def step(self, state: TrainState, batches: Batch, original_params=None):
        """One optimizer step over `[accum, B, T]` micro-batches, accumulating gradients."""
        _check_batch(batches, rank=3)
        rng = jax.random.fold_in(jax.random.wrap_key_data(state.rng), state.step)
        # Gradients of what trains only: no weight gradients for frozen layers or int leaves.
        trains, frozen = _split(state.params, self.masks)

        def loss_of(trains, batch, rng):
            return self.loss(traverse_util.unflatten_dict({**frozen, **trains}), batch, rng, original_params)

        grad_fn = jax.grad(loss_of, has_aux=True)

        def micro(carry, xs):
            batch, i = xs
            grads, metrics = grad_fn(trains, batch, jax.random.fold_in(rng, i))
            acc_grads, acc_metrics = carry
            return (jax.tree.map(jnp.add, acc_grads, grads), jax.tree.map(jnp.add, acc_metrics, metrics)), None

        accum = batches.tokens.shape[0]
        first = jax.tree.map(lambda x: x[0], batches)
        metric_shapes = jax.eval_shape(lambda: grad_fn(trains, first, rng)[1])
        zeros = (jax.tree.map(jnp.zeros_like, trains), jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), metric_shapes))
        (grads, metrics), _ = jax.lax.scan(micro, zeros, (batches, jnp.arange(accum)))
        full_grads = {k: grads[k] / accum if k in grads else jnp.zeros_like(v) for k, v in traverse_util.flatten_dict(state.params).items()}
        grads = _masked(traverse_util.unflatten_dict(full_grads), self.masks)
        updates, opt_state = self.optimizer.update(grads, state.opt_state, state.params)
        params = _apply(state.params, _masked(updates, self.masks), self.masks)
        # The new state replaces the donated one: a changed shape or dtype (a compute-dtype leak into
        # the float32 master weights) would silently recompile every step.
        chex.assert_trees_all_equal_shapes_and_dtypes(params, state.params)
        metrics["grad_norm"] = optax.global_norm(grads)
        return TrainState(state.step + 1, params, opt_state, state.rng), metrics

    def evaluate(self, params, batch: Batch, rng):
        """Metric sums of one `[B, T]` batch, with the verifier's own loss."""
        _check_batch(batch, rank=2)
        # Held-out accuracy uses span masking, which is what inference sees at every depth. No KL
        # term: it needs the original params, and the verifier's perplexity already shows the drift.
        span = dataclasses.replace(self.objective, masking="span", kl_weight=0.0)
        compute_config = self.config.replace(dtype=self.compute_dtype)
        return loss_fn(self.compute_params(params), batch, rng, config=compute_config, objective=span, report_verifier=True)[1]


def trainer_from(cfg: ml_collections.ConfigDict, config: ModelConfig, params):
    """The run's Trainer (and learning-rate schedule) for `params`, which may be shapes only."""
    objective = objective_from(cfg, config.num_layers)
    masks = trainable_mask(params, config, objective.skip, cfg.s3d.train_head, bool(cfg.s3d.lora_rank))
    optimizer, schedule = make_optimizer(cfg.train, masks)
    return Trainer(config, objective, optimizer, masks, cfg.train.compute_dtype), schedule
