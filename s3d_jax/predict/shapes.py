"""Pass costs of a named model shape on this machine, before its weights or any drafter exist, and
the speedup they predict at the shipped drafter's acceptance (its profile, `profile.py`).

    python -m s3d_jax.predict --shape llama3_1b --dtype bfloat16
"""

from __future__ import annotations

import sys

from s3d_jax import bundled, calibration
from s3d_jax import drafter as drafter_lib
from s3d_jax.checkpoint import Model
from s3d_jax.config import ModelConfig
from s3d_jax.options import DEFAULT_GAMMA, default_skip
from s3d_jax.shapes import describe, random_params, shape_config

DRAFT_VOCAB = 8192  # the shipped drafter's reduced draft head


def shape_model(name: str, dtype: str, shipped: drafter_lib.Drafter | None = None) -> Model:
    """Random weights of a named shape with a shipped drafter's recipe (`drafted_shape`), the adapters random too."""
    config = drafted_shape(name, dtype, shipped or drafter_lib.load_file(bundled.DRAFTER))
    print(f"{name}: {describe(config)}; random weights, skip {list(config.draft_skip)}, gamma {config.draft_gamma}, "
          f"adapters of rank {config.draft_lora_rank}, draft head over {config.draft_vocab_size} tokens", file=sys.stderr)
    return Model(random_params(config), config)


def drafted_shape(name: str, dtype: str, shipped: drafter_lib.Drafter) -> ModelConfig:
    """A named shape with a shipped drafter's recipe: its skipped layers where it was trained for this
    shape's depth, else the middle half; its γ, tree, adapters' rank and a reduced draft head."""
    config = shape_config(name, dtype)
    skip = tuple(shipped.skip) if shipped.base.get("num_layers") == config.num_layers else default_skip(config.num_layers)
    return config.replace(draft_skip=skip, draft_gamma=shipped.gamma or DEFAULT_GAMMA, draft_tree=shipped.tree,
                          draft_lora_rank=shipped.lora_rank,
                          draft_vocab_size=min(DRAFT_VOCAB, config.produced_vocab_size - 1))


def shape_costs(name: str, dtype: str, drafter_path=None) -> int:
    shipped = drafter_lib.load_file(drafter_path or bundled.DRAFTER)
    model = shape_model(name, dtype, shipped)
    costs = calibration.calibrate(model)  # measured now: printing them is the point
    print(f"{name} ({dtype}) on {costs.machine}")
    print(f"pass costs: {costs.summary()}")
    if shipped.profile is None:
        print("the drafter records no acceptance profile: no speedup to predict")
        return 0
    print(f"at the drafter's acceptance: {costs.policy(shipped.profile).describe()}")
    return 0
