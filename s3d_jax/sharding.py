"""Device mesh and parameter shardings: a `data` axis (batch, and FSDP when on) and a `model` axis.

Shardings come from a table of rules over parameter paths; an axis that does not divide its
dimension is replicated, so every rule holds for every model size.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping

import jax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from s3d_jax.config import ConfigError

# Preferred axes per parameter, by the tail of its path: "fsdp" shards over the data axis when FSDP is on.
SHARDING_RULES = [
    (r"\['(q|k|v)'\]$", ("fsdp", "model", None)),
    (r"\['o'\]$", ("model", None, "fsdp")),
    (r"\['(gate|up)'\]$", ("fsdp", "model")),
    (r"\['down'\]$", ("model", "fsdp")),
    (r"\['embed'\]$", ("fsdp", "model")),
    (r"\['lm_head'\]$", ("fsdp", "model")),
]


def make_mesh(m) -> jax.sharding.Mesh:
    """A `(data, model)` mesh over every device from `m.data` and `m.model`; `data <= 0` takes what `model` leaves."""
    devices = jax.devices()
    model = m.model
    data_axis = m.data if m.data > 0 else len(devices) // model
    if data_axis * model != len(devices):
        raise ConfigError(f"mesh data={data_axis} x model={model} does not match the {len(devices)} devices")
    auto = (jax.sharding.AxisType.Auto,) * 2  # shardings propagate; the model code stays unannotated
    return jax.make_mesh((data_axis, model), ("data", "model"), axis_types=auto)


def spec_for(path: str, shape, axis_sizes: Mapping[str, int], fsdp: bool) -> P:
    """A PartitionSpec from the rules; an axis that does not divide its dimension is replicated."""
    for pattern, axes in SHARDING_RULES:
        if re.search(pattern, path) and len(axes) == len(shape):
            named = [("data" if fsdp else None) if a == "fsdp" else a for a in axes]
            return P(*[a if a and dim % axis_sizes[a] == 0 else None for a, dim in zip(named, shape, strict=True)])
    return P()


def shardings(tree, mesh: jax.sharding.Mesh, fsdp: bool):
    """A NamedSharding for every leaf of `tree` (parameters, or a state holding them)."""
    return jax.tree_util.tree_map_with_path(
        lambda path, x: NamedSharding(mesh, spec_for(jax.tree_util.keystr(path), x.shape, mesh.shape, fsdp)), tree
    )


def split_over_data(rows: dict, mesh: jax.sharding.Mesh, accum: int) -> dict:
    """Global `[accum, B, T]` arrays from `[accum * B, T]` rows, split over the data axis (each host
    builds only its own shards)."""
    sharding = NamedSharding(mesh, P(None, "data"))

    def put(x):
        x = x.reshape(accum, -1, *x.shape[1:])
        return jax.make_array_from_callback(x.shape, sharding, lambda index: x[index])

    return {k: put(v) for k, v in rows.items()}


def maybe_initialize_distributed() -> None:
    """Joins a multi-host cluster when the environment describes one."""
    cluster = ("JAX_COORDINATOR_ADDRESS", "SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE", "TPU_WORKER_HOSTNAMES")
    if any(os.environ.get(k) for k in cluster) and int(os.environ.get("SLURM_NTASKS", "2")) > 1:
        jax.distributed.initialize()
