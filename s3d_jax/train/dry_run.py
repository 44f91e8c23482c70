"""`--dry-run`: parameter counts and memory per device from shapes alone (`jax.eval_shape`), so a
config for a 7B model can be checked on a laptop without its weights."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from s3d_jax import bundled
from s3d_jax.config import COMPUTE_DTYPE, ModelConfig
from s3d_jax.model import abstract_params
from s3d_jax.sharding import spec_for
from s3d_jax.train.config import model_config_from, trained_config, validate
from s3d_jax.train.trainer import trainer_from


def dry_run(cfg: ml_collections.ConfigDict) -> dict:
    """The model, its skip range, parameter counts, and memory per device in GiB by kind."""
    validate(cfg)
    config = trained_config(cfg, base_config(cfg))
    params = abstract_params(config)
    trainer, _ = trainer_from(cfg, config, params)
    opt_state = jax.eval_shape(trainer.optimizer.init, params)
    mesh_shape = {"data": cfg.mesh.data if cfg.mesh.data > 0 else 1, "model": cfg.mesh.model}

    def per_device_bytes(tree):
        total = 0
        for path, x in jax.tree_util.tree_leaves_with_path(tree):
            spec = spec_for(jax.tree_util.keystr(path), x.shape, mesh_shape, cfg.mesh.fsdp)
            shards = int(np.prod([mesh_shape[a] for a in spec if a]))
            total += int(np.prod(x.shape)) * x.dtype.itemsize / shards
        return total

    t = cfg.train
    compute_bytes = jnp.dtype(t.compute_dtype).itemsize
    micro = max(t.batch_size // mesh_shape["data"], 1)
    # Activations (float32 at every dtype) kept for the backward pass of the draft layers, plus the float32 logits.
    draft_layers = len(config.draft_layers(trainer.objective.skip))
    activation_bytes = jnp.dtype(COMPUTE_DTYPE).itemsize
    activations = micro * cfg.data.max_len * (
        draft_layers * config.hidden_size * 34 * activation_bytes / mesh_shape["model"] + config.vocab_size * 4 * 3
    )
    memory = {
        "params (float32 master)": per_device_bytes(params),
        "params (compute copy)": per_device_bytes(params) * compute_bytes / 4,
        "gradients": per_device_bytes(params),
        "optimizer state": per_device_bytes(opt_state),
        "activations (estimate)": activations,
    }
    memory["total"] = sum(memory.values())
    return {"model": config.architecture, "layers": config.num_layers, "skip": list(trainer.objective.skip),
            "parameters": parameter_counts(params, trainer.masks),
            "memory_per_device_gib": {k: v / 2**30 for k, v in memory.items()}, "mesh": mesh_shape}


def base_config(cfg: ml_collections.ConfigDict) -> ModelConfig:
    """The config of the model a run trains: the shape the config gives, or else its checkpoint's (a
    named model's from any conversion the cache holds)."""
    if cfg.model.vocab_size or not cfg.model_path:
        return model_config_from(cfg)
    return bundled.model_shapes(None if cfg.model_path == "bundled" else cfg.model_path)


def parameter_counts(params, masks) -> dict:
    """Total, trainable and frozen parameters; a mask that is an array (the embedding's token columns, a
    layer stack's draft layers) counts the entries it broadcasts over."""
    counts = {"total": 0, "trainable": 0, "frozen": 0}
    for x, m in zip(jax.tree.leaves(params), jax.tree.leaves(masks), strict=True):
        size = int(np.prod(x.shape))
        trainable = size if m is True else 0 if m is False else int(np.sum(m)) * size // int(np.size(m))
        counts["total"] += size
        counts["trainable"] += trainable
        counts["frozen"] += size - trainable
    return counts
