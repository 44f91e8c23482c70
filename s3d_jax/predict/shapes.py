"""Pass costs of a named model shape on this machine, before its weights or any drafter exist, and
the speedup they predict at the shipped drafter's acceptance (its profile, `profile.py`).

    python -m s3d_jax.predict --shape llama3_1b --dtype bfloat16
"""

from __future__ import annotations

import sys

from s3d_jax import bundled, calibration
from s3d_jax import drafter as drafter_lib
from s3d_jax.checkpoint import Model
from s3d_jax.options import DEFAULT_GAMMA, default_skip
from s3d_jax.shapes import describe, random_params, shape_config

DRAFT_VOCAB = 8192  # the shipped drafter's reduced draft head


def shape_model(name: str, dtype: str, shipped: drafter_lib.Drafter | None = None) -> Model:
    """Random weights of a named shape, with the shipped drafter's recipe at that shape: the middle half
    skipped, its γ, tree, adapters' rank and a reduced draft head (the adapters random too)."""
    shipped = shipped or drafter_lib.load_file(bundled.DRAFTER)
    config = shape_config(name, dtype)
    config = config.replace(draft_skip=default_skip(config.num_layers), draft_gamma=shipped.gamma or DEFAULT_GAMMA,
                            draft_tree=shipped.tree, draft_lora_rank=shipped.lora_rank,
                            draft_vocab_size=min(DRAFT_VOCAB, config.produced_vocab_size - 1))
    print(f"{name}: {describe(config)}; random weights, skip {list(config.draft_skip)}, gamma {config.draft_gamma}, "
          f"adapters of rank {config.draft_lora_rank}, draft head over {config.draft_vocab_size} tokens", file=sys.stderr)
    return Model(random_params(config), config)


def shape_costs(name: str, dtype: str) -> int:
    shipped = drafter_lib.load_file(bundled.DRAFTER)
    model = shape_model(name, dtype, shipped)
    costs = calibration.calibrate(model)  # measured now: printing them is the point
    print(f"{name} ({dtype}) on {costs.machine}")
    print(f"pass costs: {costs.summary()}")
    if shipped.profile is None:
        print("the shipped drafter records no acceptance profile: no speedup to predict")
        return 0
    print(f"at the shipped drafter's acceptance: {costs.policy(shipped.profile).describe()}")
    return 0
