"""Trains the S3D drafter: `python -m s3d_jax.train --config configs/smollm2.py [--config.train.lr=1e-4]`.

The middle layers stay frozen. Checkpoints (params, optimizer state, step, data position, RNG, and
the settings a resumed run must share) are saved every `train.checkpoint_every` steps, and a killed
run started again with the same workdir resumes from the newest one that reads; one that does not
is set aside, and a restart under other settings is refused. The end result is a model directory
that `s3d_jax.load` reads and `s3d_jax.decode` uses, with its skip range, gamma and mask id
recorded as defaults.

    config.py       training configs: defaults, the paper's recipe, the model config and objective they give
    trainer.py      what trains (masks), the optimizer, and the step with gradient accumulation
    checkpoints.py  the base model in, the run's checkpoints, the trained model out
    report.py       metrics.jsonl, one-line descriptions, the curves
    dry_run.py      parameter counts and memory per device from shapes alone
    loop.py         the run itself
    __main__.py     the command line

Sharding (the mesh and parameter shardings) lives in `s3d_jax/sharding.py`.
"""

from s3d_jax.sharding import make_mesh, maybe_initialize_distributed, shardings, spec_for
from s3d_jax.train.checkpoints import export, load_base_model
from s3d_jax.train.config import default_config, model_config_from, objective_from, paper_recipe
from s3d_jax.train.dry_run import dry_run
from s3d_jax.train.loop import train
from s3d_jax.train.report import plot_metrics
from s3d_jax.train.trainer import Trainer, TrainState, make_optimizer, place_batch, trainable_mask, trainer_from

__all__ = [
    "Trainer", "TrainState", "default_config", "dry_run", "export", "load_base_model", "make_mesh", "make_optimizer",
    "maybe_initialize_distributed", "model_config_from", "objective_from", "paper_recipe", "place_batch", "plot_metrics",
    "shardings", "spec_for", "train", "trainable_mask", "trainer_from",
]
