"""Device mesh and parameter shardings: a `data` axis (batch, and FSDP when on) and a `model` axis.

Shardings come from a table of rules over parameter paths. For training an axis that does not divide
its dimension is replicated, so every rule holds for every model size. For decoding (`place`) the
model axis must divide the heads and the MLP's width: tensor parallelism in Megatron's layout, with
every device holding 1/N of each large weight.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from s3d_jax.config import ConfigError, ModelConfig
from s3d_jax.settings import env_setting

# Preferred axes per parameter, by the tail of its path: "fsdp" shards over the data axis when FSDP is on.
# A quantized weight's values and scales (`quant`) have its rank and split as it does.
_WEIGHT = r"(\['(values|scale|min)'\])?$"
SHARDING_RULES = [
    (r"\['qkv'\]" + _WEIGHT, ("fsdp", "model", None, None)),  # by KV head: each keeps its query heads
    (r"\['qkv_bias'\]$", ("model", None, None)),
    (r"\['o'\]" + _WEIGHT, ("model", None, "fsdp")),
    (r"\['gate_up'\]" + _WEIGHT, ("fsdp", None, "model")),
    (r"\['down'\]" + _WEIGHT, ("model", "fsdp")),
    (r"\['(embed|lm_head)'\]" + _WEIGHT, ("fsdp", "model")),
    # The drafter's LoRA adapters split as their weight does: by the output (b) of a column-split weight,
    # by the input (a) of a row-split one. The other factor is rank-sized and stays whole.
    (r"\['qkv_lora'\]\['b'\]$", (None, None, "model", None)),  # [G + 2, r, K, E]
    (r"\['o_lora'\]\['a'\]$", ("model", None, None)),
    (r"\['gate_up_lora'\]\['b'\]$", (None, None, "model")),  # [2, r, F]
    (r"\['down_lora'\]\['a'\]$", ("model", None)),
]


def make_mesh(m) -> jax.sharding.Mesh:
    """A `(data, model)` mesh over every device from `m.data` and `m.model`; `data <= 0` takes what `model` leaves."""
    devices = jax.devices()
    model = m.model
    data_axis = m.data if m.data > 0 else len(devices) // model
    if data_axis * model != len(devices):
        raise ConfigError(f"mesh data={data_axis} x model={model} does not match the {len(devices)} devices")
    return auto_axes(jax.make_mesh((data_axis, model), ("data", "model")))


def auto_axes(mesh: jax.sharding.Mesh) -> jax.sharding.Mesh:
    """`mesh` over the same devices with every axis Auto. `jax.make_mesh` makes Explicit axes by default,
    under which every operation must state its output's sharding; the model code is unannotated and
    leaves the shardings to propagate from the weights', so a mesh of either kind decodes alike."""
    auto = (jax.sharding.AxisType.Auto,) * len(mesh.axis_names)
    return mesh if tuple(mesh.axis_types) == auto else jax.sharding.Mesh(mesh.devices, mesh.axis_names, axis_types=auto)


def spec_for(path: str, shape, axis_sizes: Mapping[str, int], fsdp: bool) -> P:
    """A PartitionSpec from the rules; an axis that does not divide its dimension is replicated. The
    layer stack's weights (`['layers']`) lead with the layer axis, which every device holds whole."""
    stacked = (None,) if "['layers']" in path else ()
    for pattern, axes in SHARDING_RULES:
        axes = (*stacked, *axes)
        if re.search(pattern, path) and len(axes) == len(shape):
            named = [("data" if fsdp else None) if a == "fsdp" else a for a in axes]
            return P(*[a if a and dim % axis_sizes[a] == 0 else None for a, dim in zip(named, shape, strict=True)])
    return P()


def shardings(tree, mesh: jax.sharding.Mesh, fsdp: bool):
    """A NamedSharding for every leaf of `tree` (parameters, or a state holding them)."""
    mesh = auto_axes(mesh)
    return jax.tree_util.tree_map_with_path(
        lambda path, x: NamedSharding(mesh, spec_for(jax.tree_util.keystr(path), x.shape, mesh.shape, fsdp)), tree
    )


def split_over_data(rows: dict, mesh: jax.sharding.Mesh, accum: int) -> dict:
    """Global `[accum, B, T]` arrays from `[accum * B, T]` rows, split over the data axis (each host
    builds only its own shards)."""
    sharding = NamedSharding(auto_axes(mesh), P(None, "data"))

    def put(x):
        x = x.reshape(accum, -1, *x.shape[1:])
        return jax.make_array_from_callback(x.shape, sharding, lambda index: x[index])

    return {k: put(v) for k, v in rows.items()}


def maybe_initialize_distributed() -> None:
    """Joins a multi-host cluster when the environment describes one: SLURM, Open MPI or Cloud TPU as
    JAX detects them, or `JAX_COORDINATOR_ADDRESS` with `JAX_NUM_PROCESSES` and `JAX_PROCESS_ID` set by
    any other launcher. Once per process; a process already joined stays as it is."""
    cluster = ("JAX_COORDINATOR_ADDRESS", "SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE", "TPU_WORKER_HOSTNAMES")
    if not any(os.environ.get(k) for k in cluster) or int(os.environ.get("SLURM_NTASKS", "2")) <= 1 or jax.distributed.is_initialized():
        return
    given = {name: env_setting(variable, None, minimum)
             for name, variable, minimum in (("num_processes", "JAX_NUM_PROCESSES", 1), ("process_id", "JAX_PROCESS_ID", 0))
             if os.environ.get(variable)}
    jax.distributed.initialize(**given)


# ---------------------------------------------------------------- decoding over a mesh


def decode_mesh(mesh) -> jax.sharding.Mesh | None:
    """A decoding mesh from a Mesh, None, or text such as "model=4" or "model=2,data=2" (the CLIs' --mesh),
    over the first devices; multi-host runs join their cluster first (`maybe_initialize_distributed`)."""
    if mesh is None or isinstance(mesh, jax.sharding.Mesh):
        if mesh is not None and "model" not in mesh.shape:
            raise ConfigError(f"a decoding mesh needs a 'model' axis (and optionally 'data'), got axes {tuple(mesh.shape)}")
        return None if mesh is None else auto_axes(mesh)
    if not isinstance(mesh, str):
        raise TypeError(f"mesh must be a jax.sharding.Mesh, text such as 'model=2', or None; got {type(mesh).__name__}")
    sizes = {"data": 1, "model": 1}
    for part in filter(None, mesh.replace(" ", "").split(",")):
        name, _, value = part.partition("=")
        if name not in sizes or not value.isdigit() or int(value) < 1:
            raise ConfigError(f"mesh {mesh!r}: expected axes model=N and optionally data=M with N, M >= 1, got {part!r}")
        sizes[name] = int(value)
    maybe_initialize_distributed()
    needed, available = sizes["data"] * sizes["model"], jax.device_count()
    if needed > available:
        raise ConfigError(f"mesh {mesh!r} needs {needed} devices and {available} are available")
    devices = np.asarray(jax.devices()[:needed]).reshape(sizes["data"], sizes["model"])
    return jax.sharding.Mesh(devices, ("data", "model"), axis_types=(jax.sharding.AxisType.Auto,) * 2)


def check_divides(config: ModelConfig, mesh: jax.sharding.Mesh) -> None:
    """Refuses a model axis that does not split the heads, the key/value heads or the MLP's width evenly."""
    n = mesh.shape["model"]
    for name in ("num_heads", "num_kv_heads", "intermediate_size"):
        size = getattr(config, name)
        if size % n:
            raise ConfigError(f"the mesh's model axis of {n} devices does not divide the model's {name} of {size}: tensor "
                              f"parallelism splits it evenly over the devices; choose a model axis that divides {size}")


def decode_shardings(params, config: ModelConfig, mesh: jax.sharding.Mesh):
    """Training's rules without FSDP, and the reduced draft head split like the vocabulary table. A table
    whose tokens the model axis does not divide is split along the hidden size instead: no device holds a
    whole copy, and no padding token changes the logits' shape (sampling's random draws depend on it)."""
    n = mesh.shape["model"]

    def spec(path, x):
        name = jax.tree_util.keystr(path)
        if re.search(r"\['(embed|lm_head|draft_head)'\]" + _WEIGHT, name):  # [hidden, tokens] (or hidden / 32 for scales)
            if x.shape[1] % n == 0:
                return NamedSharding(mesh, P(None, "model"))
            if config.hidden_size % n == 0:
                return NamedSharding(mesh, P("model" if x.shape[0] % n == 0 else None, None))
            raise ConfigError(f"the mesh's model axis of {n} devices divides neither the {x.shape[1]} tokens of {name} nor the "
                              f"hidden size of {config.hidden_size}: the table cannot be split evenly")
        return NamedSharding(mesh, spec_for(name, x.shape, mesh.shape, fsdp=False))

    return jax.tree_util.tree_map_with_path(spec, params)


def place(params, config: ModelConfig, mesh: jax.sharding.Mesh):
    """`params` laid out over `mesh` for decoding, tensor-parallel (`decode_shardings`)."""
    check_divides(config, mesh)
    return jax.device_put(params, decode_shardings(params, config, mesh))


def mesh_shape(params) -> dict | None:
    """The mesh `params` are laid out over, as {axis: size}, or None on one device."""
    placed = next((x.sharding for x in jax.tree.leaves(params) if isinstance(getattr(x, "sharding", None), NamedSharding)), None)
    return None if placed is None or placed.mesh.size == 1 else dict(placed.mesh.shape)


def to_host(tree):
    """Arrays as numpy on this host; on several hosts each gets the whole of every array."""
    if jax.process_count() == 1:
        return jax.device_get(tree)
    from jax.experimental import multihost_utils

    return multihost_utils.process_allgather(tree, tiled=True)
