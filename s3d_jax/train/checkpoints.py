"""Models in and out of a run: the base model it starts from, its orbax checkpoints (the state, the
data position and the model config, so that a killed run resumes exactly), and the exported model
directory (the format of `s3d_jax/checkpoint.py`)."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import inspect
import json
import logging
import sys
import time
import types
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_collections
import orbax.checkpoint as ocp
from flax import traverse_util

from s3d_jax import bundled, checkpoint, quant
from s3d_jax.checkpoint import CheckpointError, Model
from s3d_jax.config import QUANTIZED_DTYPES, ConfigError, ModelConfig
from s3d_jax.model import init_params
from s3d_jax.objective import Objective
from s3d_jax.quant import cast_params
from s3d_jax.train.config import model_config_from, resume_settings, trained_config
from s3d_jax.train.trainer import Trainer, TrainState


def load_base_model(cfg: ml_collections.ConfigDict) -> Model:
    """The model to train, with its tokenizer: a converted checkpoint, the bundled SmolLM2, or a
    random one (`model_path: ''`). Its params are float32 master weights (plus fresh adapters)."""
    held = cfg.base_dtype if cfg.base_dtype in QUANTIZED_DTYPES else None  # QLoRA: the projections stay quantized
    if cfg.model_path == "bundled" or bundled.is_name(cfg.model_path):  # int4: the GGUF's own blocks
        model = bundled.load(dtype=held, model=bundled.named(None if cfg.model_path == "bundled" else cfg.model_path))
    elif cfg.model_path:
        model = checkpoint.load(cfg.model_path, dtype=held)
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
    # Master weights are float32 (or the frozen projections quantized); `train.compute_dtype` sets the
    # precision of the passes.
    config = trained_config(cfg, model.config)
    if held:
        params = quant.quantize_params(model.params, held, model.config.weight_formats)  # a GGUF's kept blocks stay
        # The vocabulary tables in float32: the mask token's row trains, and a quantized table has no row to train.
        params = {**params, **{k: quant.dense(params[k]) for k in quant.VOCABULARY_TABLES if k in params}}
    else:
        params = cast_params(quant.dequantize_params(model.params), jnp.float32)
    if cfg.s3d.lora_rank:  # the base weights, plus new adapters
        merged = traverse_util.flatten_dict(init_params(config, jax.random.key(cfg.train.seed + 1)))
        merged.update(traverse_util.flatten_dict(params, is_leaf=lambda _, node: quant.is_quantized(node)))  # a weight whole
        params = traverse_util.unflatten_dict(merged)
    return Model(params, config, model.tokenizer)


# ------------------------------------------------------------------ the run's checkpoints


def checkpoint_manager(workdir: Path, keep: int) -> ocp.CheckpointManager:
    return ocp.CheckpointManager(
        workdir / "checkpoints", options=ocp.CheckpointManagerOptions(max_to_keep=keep, create=True), item_names=("state", "meta")
    )


@contextlib.contextmanager
def quiet_abandoned_reads():
    """Drops the echoes of a failed orbax restore. It closes its event loop while tensorstore reads are
    still in flight; each read that ends later fails to report to the closed loop, and Python prints
    every one ("Event loop is closed", "Task exception was never retrieved": hundreds for a small
    model). They say nothing that the restore's own error, which `restore` reports, did not."""
    previous = sys.unraisablehook

    def hook(unraisable):
        error, where = unraisable.exc_value, unraisable.object
        if isinstance(error, RuntimeError) and str(error) == "Event loop is closed":
            return
        if inspect.iscoroutine(where) and "orbax" in where.cr_code.co_filename:
            return
        previous(unraisable)

    def orbax_task(record: logging.LogRecord) -> bool:
        text = record.getMessage()
        return not ("exception was never retrieved" in text and ("orbax" in text or "OCDBT" in text))

    sys.unraisablehook = hook
    logging.getLogger("asyncio").addFilter(orbax_task)
    try:
        yield
    finally:
        gc.collect()  # abandoned tasks and coroutines report when collected: now, while the filters are in place
        sys.unraisablehook = previous
        logging.getLogger("asyncio").removeFilter(orbax_task)


def restore(manager: ocp.CheckpointManager, abstract_state: TrainState, config: ModelConfig, settings: dict, steps: int):
    """`(state, meta)` of the newest checkpoint that reads, or `(None, None)` when there is none.

    A checkpoint that does not read (a truncated file, missing metadata) is reported by step and, once
    an older one has restored, moved aside to `checkpoints_corrupt/`; if none reads, nothing is moved
    and the run stops. A checkpoint of another model or objective, or past `steps`, is refused."""
    unreadable = []
    try:
        for step in sorted(manager.all_steps(), reverse=True):
            try:
                meta = manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
                if not isinstance(meta, dict) or not isinstance(meta.get("data_position"), int):
                    raise CheckpointError(f"its meta item is not a checkpoint record: {meta!r:.100}")
            except Exception as e:  # noqa: BLE001 - orbax and tensorstore raise many types for unreadable files
                unreadable.append((step, e))
                continue
            check_same_run(meta, config, settings, steps, step, manager.directory)
            try:
                state = manager.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract_state)))["state"]
            except Exception as e:  # noqa: BLE001
                unreadable.append((step, e))
                continue
            for bad, error in unreadable:
                aside = set_aside(Path(manager.directory), bad)
                print(f"checkpoint step {bad} is corrupt ({_first_line(error)}); moved to {aside}; resuming from step {step}",
                      file=sys.stderr)
            if unreadable:
                manager.reload()
            return state, meta
        if unreadable:
            found = "; ".join(f"step {step}: {_first_line(e)}" for step, e in unreadable)
            raise CheckpointError(f"no checkpoint in {manager.directory} can be read ({found}); "
                                  "move the directory aside to start afresh, or use a new --workdir")
        return None, None
    finally:
        if unreadable:
            _end_abandoned_reads()


def _end_abandoned_reads() -> None:
    """Ends what a failed restore left behind, while `quiet_abandoned_reads` drops the echoes: the reads
    in flight finish, the readers that wait for them are closed, and the errors held by futures of the
    closed loop are marked seen. Left alone, they would be collected at exit, outside the filters:
    orbax's array reader catches BaseException, so closing it then raises, and asyncio logs every
    future that failed unseen."""
    time.sleep(0.5)
    # `type(o)`, not isinstance: that would read `__class__`, which some modules' objects make noisy.
    for o in gc.get_objects():
        if type(o) is types.CoroutineType and o.cr_frame is not None and o.cr_code.co_name == "_read_array_index_and_device_put":
            with contextlib.suppress(BaseException):
                o.close()
    for o in gc.get_objects():
        if issubclass(type(o), asyncio.Future) and o.get_loop().is_closed() and o.done() and not o.cancelled():
            o.exception()  # marks it retrieved: no one can await a future of a closed loop
    gc.collect()


def check_same_run(meta: dict, config: ModelConfig, settings: dict, steps: int, step: int, directory) -> None:
    """Refuses to resume a checkpoint under another model, another objective or data stream, or a
    smaller `train.steps`, naming every field that differs (old -> new)."""
    old_model, new_model = meta.get("model_config") or {}, json.loads(config.to_json())
    if old_model != new_model:
        changes = _changes({f"model.{k}": v for k, v in old_model.items()}, {f"model.{k}": v for k, v in new_model.items()})
        raise CheckpointError(f"{directory} holds a checkpoint of another model (its config differs: {changes}); use a new --workdir")
    recorded = meta.get("settings")
    if recorded is not None and recorded != settings:
        raise CheckpointError(
            f"{directory} holds a checkpoint trained with other settings ({_changes(recorded, settings)}); resuming would mix "
            "two objectives or data streams: restore the old values or use a new --workdir"
        )
    if steps < step:
        raise CheckpointError(
            f"{directory} holds a checkpoint at step {step}, past train.steps={steps}; set train.steps >= {step} "
            "(a larger value extends the run) or use a new --workdir"
        )


def _changes(old: dict, new: dict) -> str:
    def shown(d, k):
        return repr(d[k]) if k in d else "(none)"

    differing = sorted(k for k in old.keys() | new.keys() if k not in old or k not in new or old[k] != new[k])
    return ", ".join(f"{k}: {shown(old, k)} -> {shown(new, k)}" for k in differing)


def _first_line(error: BaseException) -> str:
    """The first line of the innermost error (orbax wraps tensorstore's, which says what is wrong)."""
    for _ in range(20):  # a chain is short; the bound only guards against a cycle
        if (inner := error.__cause__ or error.__context__) is None:
            break
        error = inner
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0][:200] if text else ''}"


def set_aside(checkpoints: Path, step: int) -> Path:
    """Moves `checkpoints/<step>` to `checkpoints_corrupt/<step>` (a new name if taken); kept, not deleted."""
    corrupt = checkpoints.with_name(checkpoints.name + "_corrupt")
    corrupt.mkdir(exist_ok=True)
    aside, n = corrupt / str(step), 1
    while aside.exists():
        aside, n = corrupt / f"{step}.{n}", n + 1
    (checkpoints / str(step)).rename(aside)
    return aside


def start_or_resume(manager: ocp.CheckpointManager, trainer: Trainer, params, cfg: ml_collections.ConfigDict,
                    state_sharding) -> tuple[TrainState, int]:
    """The newest checkpoint's state and data position, or a fresh state at position 0."""
    seed = cfg.train.seed
    abstract_state = jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), jax.eval_shape(trainer.init, params, seed), state_sharding
    )
    state, meta = restore(manager, abstract_state, trainer.config, resume_settings(cfg), cfg.train.steps)
    if state is None:
        return jax.jit(trainer.init, static_argnums=1, out_shardings=state_sharding)(params, seed), 0
    print(f"resumed from step {int(state.step)} in {manager.directory}", file=sys.stderr)
    if "settings" not in meta:
        print("note: this checkpoint predates recorded settings; only its model config was checked", file=sys.stderr)
    if meta.get("steps", cfg.train.steps) < cfg.train.steps:
        print(f"extending the run from train.steps={meta['steps']} to {cfg.train.steps}: the learning-rate schedule now spans "
              f"{cfg.train.steps} steps", file=sys.stderr)
    return state, meta["data_position"]


def save_checkpoint(manager: ocp.CheckpointManager, step: int, state: TrainState, next_data_position: int, config: ModelConfig,
                    cfg: ml_collections.ConfigDict) -> None:
    """Saves in the background; `next_data_position` is the batch a resumed run starts from. The meta
    item records what a resumed run must share (`check_same_run`)."""
    meta = {"data_position": next_data_position, "model_config": json.loads(config.to_json()), "settings": resume_settings(cfg),
            "steps": cfg.train.steps}
    manager.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)))


# ------------------------------------------------------------------ the trained model


def export(params, config: ModelConfig, objective: Objective, tokenizer, out: Path, dtype: str) -> Path:
    """Writes a model directory that `s3d_jax.load` reads, with the drafter's defaults recorded."""
    config = config.replace(dtype=dtype, draft_skip=objective.skip, draft_gamma=objective.gamma)
    params = jax.device_get(params)  # a QLoRA run's base is quantized: exported in model_dtype all the same
    if config.quantized:
        params = quant.quantize_params(params, config.dtype)
    else:
        params = cast_params(quant.dequantize_params(params), config.jnp_dtype)
    return checkpoint.save(out, params, config, tokenizer, overwrite=True)  # the run's own output, replaced whole
