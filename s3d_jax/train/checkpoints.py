"""Models in and out of a run: the base model it starts from, its orbax checkpoints (the state, the
data position and the model config, so that a killed run resumes exactly), and the exported model
directory (the format of `s3d_jax/checkpoint.py`)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import orbax.checkpoint as ocp
from flax import traverse_util

from s3d_jax import bundled, checkpoint
from s3d_jax.checkpoint import CheckpointError, Model
from s3d_jax.config import ConfigError, ModelConfig
from s3d_jax.model import init_params
from s3d_jax.objective import Objective
from s3d_jax.train.config import model_config_from
from s3d_jax.train.trainer import Trainer, TrainState


def load_base_model(cfg: ml_collections.ConfigDict) -> Model:
    """The model to train, with its tokenizer: a converted checkpoint, the bundled SmolLM2, or a
    random one (`model_path: ''`). Its params are float32 master weights (plus fresh adapters)."""
    if cfg.model_path == "bundled":
        model = bundled.load()
    elif cfg.model_path:
        model = checkpoint.load(cfg.model_path)
    else:
        config = model_config_from(cfg)
        tokenizer = bundled.tokenizer() if cfg.tokenizer == "bundled" else None
        if cfg.tokenizer and cfg.tokenizer != "bundled":
            tokenizer = checkpoint.load_tokenizer(Path(cfg.tokenizer))
        model = Model(init_params(config, jax.random.key(cfg.train.seed)), config, tokenizer)
    if model.config.mask_token_id is None:
        raise ConfigError("the model has no mask token row: convert it with tools/convert_hf.py, which adds one")
    if model.tokenizer is None:
        raise ConfigError("training needs a tokenizer with a chat template; the model has none")
    if cfg.data.max_len > model.config.max_position_embeddings:
        raise ConfigError(f"data.max_len {cfg.data.max_len} exceeds the model's {model.config.max_position_embeddings} positions")
    # Master weights are float32; `train.compute_dtype` sets the precision of the passes.
    config = model.config.replace(dtype="float32", draft_lora_rank=cfg.s3d.lora_rank)
    params = jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), model.params)
    if cfg.s3d.lora_rank:  # the base weights, plus new adapters
        merged = traverse_util.flatten_dict(init_params(config, jax.random.key(cfg.train.seed + 1)))
        merged.update(traverse_util.flatten_dict(params))
        params = traverse_util.unflatten_dict(merged)
    return Model(params, config, model.tokenizer)


# ------------------------------------------------------------------ the run's checkpoints


def checkpoint_manager(workdir: Path, keep: int) -> ocp.CheckpointManager:
    return ocp.CheckpointManager(
        workdir / "checkpoints", options=ocp.CheckpointManagerOptions(max_to_keep=keep, create=True), item_names=("state", "meta")
    )


def restore(manager: ocp.CheckpointManager, abstract_state: TrainState, config: ModelConfig):
    """`(state, meta)` of the newest checkpoint, or `(None, None)`; refuses another model's."""
    step = manager.latest_step()
    if step is None:
        return None, None
    meta = manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
    if meta.get("model_config") != json.loads(config.to_json()):
        raise CheckpointError(
            f"{manager.directory} holds a checkpoint of another model (its config differs); use a new --workdir"
        )
    state = manager.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract_state)))["state"]
    return state, meta


def start_or_resume(manager: ocp.CheckpointManager, trainer: Trainer, params, seed: int, state_sharding) -> tuple[TrainState, int]:
    """The newest checkpoint's state and data position, or a fresh state at position 0."""
    abstract_state = jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), jax.eval_shape(trainer.init, params, seed), state_sharding
    )
    state, meta = restore(manager, abstract_state, trainer.config)
    if state is None:
        return jax.jit(trainer.init, static_argnums=1, out_shardings=state_sharding)(params, seed), 0
    print(f"resumed from step {int(state.step)} in {manager.directory}", file=sys.stderr)
    return state, meta["data_position"]


def save_checkpoint(manager: ocp.CheckpointManager, step: int, state: TrainState, next_data_position: int, config: ModelConfig) -> None:
    """Saves in the background; `next_data_position` is the batch a resumed run starts from."""
    meta = {"data_position": next_data_position, "model_config": json.loads(config.to_json())}
    manager.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)))


# ------------------------------------------------------------------ the trained model


def export(params, config: ModelConfig, objective: Objective, tokenizer, out: Path, dtype: str) -> Path:
    """Writes a model directory that `s3d_jax.load` reads, with the drafter's defaults recorded."""
    config = config.replace(dtype=dtype, draft_skip=objective.skip, draft_gamma=objective.gamma)
    params = jax.tree.map(lambda x: np.asarray(jax.device_get(x)).astype(config.jnp_dtype), params)
    return checkpoint.save(out, params, config, tokenizer)
