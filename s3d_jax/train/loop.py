"""The training run: load the base model, start or resume, step, log, evaluate, checkpoint, export."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import signal
import sys
import tempfile
import threading
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from tqdm import tqdm

from s3d_jax import data
from s3d_jax.config import ConfigError
from s3d_jax.drafter import continue_from, count_ranking, extract, with_draft_vocab
from s3d_jax.drafter import save as save_drafter
from s3d_jax.sharding import make_mesh, shardings
from s3d_jax.train import checkpoints, report
from s3d_jax.train.config import check_settings, validate
from s3d_jax.train.trainer import place_batch, trainer_from

EVAL_SEED = 1234  # the same masks at every evaluation, so that evaluations compare
VOCAB_CONVERSATIONS = 4000  # of s3d.draft_vocab_data, for the draft vocabulary's ranking
DRAFTER_FILE = "drafter.safetensors"  # what a draft-only LoRA run exports: `s3d_jax.load(base, drafter=...)`


def check_writable(workdir: Path) -> None:
    """Refuses a workdir that cannot be written (a read-only filesystem, no permission), by writing a
    scratch file in it or in its nearest existing parent, before the model or the data are read."""
    existing = next(p for p in (workdir, *workdir.parents) if p.exists())
    try:
        with tempfile.TemporaryFile(dir=existing):
            pass
    except OSError as e:
        raise ConfigError(f"--workdir {workdir} cannot be written: {existing}: {e.strerror or e}") from None


def train(cfg: ml_collections.ConfigDict, workdir: str | Path, progress: bool = True) -> Path:
    """Runs (or resumes) training; returns the exported model directory, or for a draft-only LoRA run the
    drafter file. What can be checked without loading anything (the config, the workdir, the data file,
    the mesh) is checked first."""
    validate(cfg)
    workdir = Path(workdir).absolute()
    if workdir.exists() and not workdir.is_dir():
        raise ConfigError(f"--workdir {workdir} exists and is not a directory")
    check_writable(workdir)
    data.check_file(cfg.data.path or data.default_sharegpt_path())
    mesh = make_mesh(cfg.mesh)
    check_settings(cfg, mesh.shape["data"])
    with checkpoints.quiet_abandoned_reads(), contextlib.ExitStack() as cleanup:
        return _run(cfg, workdir, mesh, cleanup, progress)


def _run(cfg: ml_collections.ConfigDict, workdir: Path, mesh, cleanup: contextlib.ExitStack, progress: bool) -> Path:
    t = cfg.train
    base = checkpoints.load_base_model(cfg)
    train_rows, eval_rows = load_rows(cfg.data, base.tokenizer, progress)
    if cfg.s3d.init_drafter:  # a second stage: the drafter's weights, and its ranking so that the head drafts the same tokens
        params, ranking = continue_from(base, cfg.s3d.init_drafter, cfg.s3d.gamma)
        base = dataclasses.replace(base, params=params)
    else:
        # The tokens the draft head may propose, most frequent first (a reduced head drafts the first
        # s3d.draft_vocab of them); recounted identically on resume, and stored with the drafter.
        counted = [train_rows]
        if cfg.s3d.draft_vocab_data:
            counted.append(data.load_dataset(cfg.s3d.draft_vocab_data, base.tokenizer, max_len=cfg.data.max_len, eval_fraction=0.0,
                                             max_conversations=VOCAB_CONVERSATIONS, progress=progress)[0])
        ranking = count_ranking(np.concatenate([r.tokens for r in counted]), np.concatenate([r.loss_mask for r in counted]), base.config)
    params, config = with_draft_vocab(base.params, base.config, ranking, cfg.s3d.draft_vocab)
    base = dataclasses.replace(base, params=params, config=config)
    trainer, schedule = trainer_from(cfg, base.config, base.params)
    state_sharding = shardings(jax.eval_shape(trainer.init, base.params, t.seed), mesh, cfg.mesh.fsdp)
    workdir.mkdir(parents=True, exist_ok=True)
    manager = checkpoints.checkpoint_manager(workdir, t.keep_checkpoints)
    cleanup.callback(manager.close)  # on errors too: it ends the manager's background threads
    state, data_position = checkpoints.start_or_resume(manager, trainer, base.params, cfg, state_sharding)
    original = jax.device_put(base.params, shardings(base.params, mesh, cfg.mesh.fsdp)) if trainer.objective.kl_weight else None
    tokenizer = base.tokenizer
    del base  # the state holds the params now

    step_fn = jax.jit(trainer.step, donate_argnums=0, out_shardings=(state_sharding, None))
    held_out = functools.partial(evaluate_held_out, jax.jit(trainer.evaluate), rows=eval_rows, mesh=mesh, batch_size=t.batch_size,
                                 max_batches=cfg.data.eval_batches)
    metrics_file = workdir / "metrics.jsonl"
    start_step = int(state.step)
    kept = report.drop_after(metrics_file, start_step)  # a resumed run logs the steps after its checkpoint again
    if start_step == 0 and not kept:
        before = report.log_eval(metrics_file, 0, held_out(state.params), tokens_seen=0)
        print(f"held-out before training: {report.describe(before)}", file=sys.stderr)

    stream = data.batches(train_rows, t.batch_size * t.grad_accum, t.seed, start=data_position)
    seen = data.tokens_before(train_rows, t.batch_size * t.grad_accum, t.seed, data_position)
    bar = cleanup.enter_context(tqdm(total=t.steps, initial=start_step, desc="training", disable=not progress, dynamic_ncols=True))
    throughput = report.Throughput()
    ctrl_c = cleanup.enter_context(StopRequest())
    for step in range(start_step + 1, t.steps + 1):
        data_position, rows = next(stream)
        state, metrics = step_fn(state, place_batch(rows, mesh, t.grad_accum), original)
        seen += throughput.add(rows)
        if _due(step, t.log_every, t.steps):
            record = report.log_step(metrics_file, step, metrics, lr=float(schedule(step)), tokens_per_s=throughput.read(),
                                     data_position=data_position, tokens_seen=seen)
            bar.set_postfix_str(report.describe(record) + f" {record['tokens_per_s']:.0f} tok/s")
        if _due(step, t.eval_every, t.steps):
            record = report.log_eval(metrics_file, step, held_out(state.params), tokens_seen=seen)
            bar.write(f"step {step} held-out: {report.describe(record)}")
        if _due(step, t.checkpoint_every, t.steps) or ctrl_c.requested:
            checkpoints.save_checkpoint(manager, step, state, data_position + 1, trainer.config, cfg)
        bar.update(1)
        if ctrl_c.requested:
            manager.wait_until_finished()
            bar.write(f"step {step} saved")
            raise KeyboardInterrupt
    bar.close()
    manager.wait_until_finished()
    report.plot_metrics(metrics_file, workdir / "curves.png")
    if cfg.s3d.lora_rank:  # the verifier is the base model, unchanged: the drafter is all there is to keep
        drafter = extract(state.params, trainer.config, trainer.objective.skip, trainer.objective.gamma, ranking,
                          cfg.s3d.draft_vocab, tokenizer, cfg.s3d.tree)
        return save_drafter(workdir / DRAFTER_FILE, drafter)
    config = trainer.config.replace(draft_tree=cfg.s3d.tree)
    return checkpoints.export(state.params, config, trainer.objective, tokenizer, workdir / "model", cfg.model_dtype)


class StopRequest:
    """Ctrl-C during the steps asks the loop to stop after the current one, once it is saved: a signal
    that lands inside an orbax save leaves its background threads waiting on each other, and the process
    never ends. A second Ctrl-C stops at once. Only the main thread can take signals; elsewhere this
    does nothing."""

    requested = False

    def __enter__(self):
        self._previous = None
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGINT, self._request)
        return self

    def _request(self, signum, frame):
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True

    def __exit__(self, *exc):
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)


def _due(step: int, every: int, last: int) -> bool:
    return step % every == 0 or step == last


def load_rows(d: ml_collections.ConfigDict, tokenizer, progress: bool) -> tuple[data.Rows, data.Rows]:
    """(train rows, held-out rows) as the `data` section says."""
    return data.load_dataset(d.path, tokenizer, max_len=d.max_len, loss_on=d.loss_on, pack=d.pack,
                             eval_fraction=d.eval_fraction, max_conversations=d.max_conversations, progress=progress)


def evaluate_held_out(eval_fn, params, rows: data.Rows, mesh: jax.sharding.Mesh, batch_size: int, max_batches: int):
    """`eval_fn`'s metric sums pooled over up to `max_batches` held-out batches (at least one,
    repeating rows when there are fewer than a batch)."""
    rng = jax.random.key(EVAL_SEED)
    pooled = None
    for i in range(min(len(rows) // batch_size, max_batches) or 1):
        batch_rows = rows.take(np.arange(i * batch_size, (i + 1) * batch_size) % len(rows))
        batch = jax.tree.map(lambda x: x[0], place_batch(batch_rows, mesh, 1))
        metrics = eval_fn(params, batch, rng)
        pooled = metrics if pooled is None else jax.tree.map(jnp.add, pooled, metrics)
    return pooled
