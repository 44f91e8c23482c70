"""Training on the tiny config (CPU): learning, freezing, resume after a kill, adapters, sharding,
decoding the result, and bad input."""

import importlib.util
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest
from reference import assert_exact, devices_env

import s3d_jax
from s3d_jax import checkpoint, drafter, quant
from s3d_jax.data import DataError
from s3d_jax.train import load_base_model, train
from s3d_jax.train.__main__ import main as train_main

ROOT = Path(__file__).parents[1]


def tiny_config(**overrides):
    spec = importlib.util.spec_from_file_location("tiny", ROOT / "configs" / "tiny.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    cfg = module.get_config()
    for dotted, value in overrides.items():
        node = cfg
        *parents, leaf = dotted.split(".")
        for p in parents:
            node = node[p]
        node[leaf] = value
    return cfg


def leaves(params):
    return {jax.tree_util.keystr(k): np.asarray(v) for k, v in jax.tree_util.tree_leaves_with_path(params)}


def whole_records(path: Path) -> list[dict]:
    """The records of a jsonl file, less a line that a kill cut off."""
    out = []
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            pass
    return out


def records(workdir, split):
    return [r for r in whole_records(Path(workdir) / "metrics.jsonl") if r["split"] == split]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """One short run that overfits a single batch, shared by several tests. The head trains too: a
    random model's frozen head cannot make a peaked distribution whatever the layers do."""
    cfg = tiny_config(**{"data.max_conversations": 4, "train.steps": 12, "train.lr": 1e-2, "train.eval_every": 12,
                         "train.checkpoint_every": 12, "train.log_every": 1, "s3d.train_head": True})
    workdir = tmp_path_factory.mktemp("overfit")
    out = train(cfg, workdir, progress=False)
    return cfg, workdir, out


@pytest.mark.needs("bundled_model", "mt_bench")
def test_loss_falls_when_overfitting_one_batch(trained):
    _, workdir, _ = trained
    losses = [r["draft_loss"] for r in records(workdir, "train")]
    assert losses[-1] < 0.5 * losses[0], losses


@pytest.mark.needs("bundled_model", "mt_bench")
def test_frozen_layers_are_bit_identical(trained):
    cfg, _, out = trained
    before, after = leaves(load_base_model(cfg).params), leaves(s3d_jax.load(out).params)
    stacks = [k for k in before if k.startswith("['layers']")]
    assert len(stacks) == 6  # two norms, qkv, o, gate_up, down
    for k in stacks:
        for i in range(cfg.s3d.skip[0], cfg.s3d.skip[1] + 1):  # the skipped layers' entries
            assert before[k][i].tobytes() == after[k][i].tobytes(), (k, i)
    for k, i in (("['layers']['attn']['qkv']", 0), ("['layers']['mlp']['down']", 5)):
        assert not np.array_equal(before[k][i], after[k][i]), f"{k}[{i}] should have trained"
    assert not np.array_equal(before["['embed']"], after["['embed']"]), "the embedding should have trained"


@pytest.mark.needs("bundled_model", "mt_bench")
def test_trained_model_decodes_with_its_recorded_defaults(trained):
    cfg, _, out = trained
    model = s3d_jax.load(out)
    assert model.config.draft_skip == tuple(cfg.s3d.skip) and model.config.draft_gamma == cfg.s3d.gamma
    spec, _ = assert_exact(model, "Hello there", chat=True, max_new_tokens=12, eos_token_ids=())
    assert spec.stats.method == "s3d" and spec.stats.gamma == cfg.s3d.gamma and spec.stats.skip == tuple(cfg.s3d.skip)


@pytest.mark.needs("bundled_model", "mt_bench")
def test_resume_after_kill_equals_uninterrupted_run(tmp_path):
    overrides = {"train.steps": 12, "train.checkpoint_every": 3, "train.eval_every": 1000, "data.max_conversations": 60}
    reference = train(tiny_config(**overrides), tmp_path / "reference", progress=False)

    workdir = tmp_path / "killed"
    args = [f"--config.{k}={v}" for k, v in overrides.items()]
    command = [sys.executable, "-m", "s3d_jax.train", "--config", str(ROOT / "configs" / "tiny.py"), "--workdir", str(workdir), *args]
    proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 300
    while not (workdir / "checkpoints" / "6").exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not (workdir / "model").exists(), "the run finished before it could be killed"
    logged = [r["step"] for r in records(workdir, "train")]
    killed_at = max(logged)

    resumed = train(tiny_config(**overrides), workdir, progress=False)
    after = records(workdir, "train")
    assert [r["step"] for r in after] == list(range(1, 13)), "each step once: those after the checkpoint are replaced"
    assert [r["data_position"] for r in after] == list(range(12)), "the resumed run continues the data stream exactly"
    # The learning curve's axis: tokens seen, counted again from the data stream on resume.
    seen = [r["tokens_seen"] for r in after]
    assert seen == [r["tokens_seen"] for r in records(tmp_path / "reference", "train")] and seen == sorted(set(seen))
    redone = [r["step"] for r in whole_records(workdir / "metrics.discarded.jsonl") if r["split"] == "train"]
    resumed_from = redone[0] - 1 if redone else killed_at  # the newest checkpoint
    assert resumed_from % 3 == 0 and redone == list(range(resumed_from + 1, killed_at + 1))
    ref, got = leaves(s3d_jax.load(reference).params), leaves(s3d_jax.load(resumed).params)
    for k in ref:
        np.testing.assert_allclose(got[k], ref[k], rtol=1e-5, atol=1e-6, err_msg=k)


@pytest.mark.needs("bundled_model", "mt_bench")
def test_draft_only_lora_leaves_the_verifier_bit_identical(tmp_path):
    cfg = tiny_config(**{"s3d.lora_rank": 4, "train.steps": 4, "train.lr": 1e-2})
    out = train(cfg, tmp_path, progress=False)
    original = load_base_model(tiny_config())
    assert out.name == "drafter.safetensors", "a LoRA run exports a drafter file, not a model copy"
    trained_model = drafter.apply(original, out)
    assert trained_model.config.draft_lora_rank == 4
    ids = np.random.default_rng(0).integers(0, 49152, (2, 20))
    # Every logit but the mask token's (which decoding forces to -inf; the tied head shares its row).
    mask_id = cfg.model.mask_token_id
    got, want = np.asarray(s3d_jax.logits(trained_model, ids)), np.asarray(s3d_jax.logits(original, ids))
    assert np.array_equal(np.delete(got, mask_id, axis=-1), np.delete(want, mask_id, axis=-1))
    lora = [v for k, v in leaves(trained_model.params).items() if "_lora']['b']" in k]
    assert lora and any(np.abs(v).max() > 0 for v in lora), "the adapters trained"
    # Of the shared weights, only the mask token's embedding column moved.
    before, after = leaves(original.params), leaves(trained_model.params)
    assert all(before[k].tobytes() == after[k].tobytes() for k in before if k != "['embed']")
    changed_columns = np.flatnonzero(np.any(before["['embed']"] != after["['embed']"], axis=0))
    assert changed_columns.tolist() == [cfg.model.mask_token_id]
    # Decoding with the adapters stays exact against the original model's greedy output.
    prompt = [1, 2, 3, 4, 5]
    assert_exact(trained_model, prompt, plain_model=original, max_new_tokens=10, eos_token_ids=())


@pytest.mark.needs("bundled_model", "mt_bench")
def test_a_second_stage_starts_where_its_drafter_stopped(tmp_path):
    """s3d.init_drafter: before its first step, a second stage scores the held-out rows as the first stage
    did after its last (the file's adapters, mask row and ranking, exactly), then trains on; a drafter of
    another rank, skip range or gamma is refused by name."""
    stage = {"s3d.lora_rank": 4, "s3d.draft_vocab": 512, "train.steps": 4, "train.lr": 1e-2, "train.eval_every": 4}
    first = train(tiny_config(**stage), tmp_path / "first", progress=False)
    second = train(tiny_config(**stage, **{"s3d.init_drafter": str(first)}), tmp_path / "second", progress=False)
    ended, started = records(tmp_path / "first", "eval")[-1], records(tmp_path / "second", "eval")[0]
    assert (ended["step"], started["step"]) == (4, 0)
    assert {k: v for k, v in ended.items() if k not in ("step", "tokens_seen")} == \
        {k: v for k, v in started.items() if k not in ("step", "tokens_seen")}
    a, b = drafter.load_file(first), drafter.load_file(second)
    assert np.array_equal(a.ranking, b.ranking), "the second stage drafts the first stage's tokens"
    assert any(not np.array_equal(a.lora[k], b.lora[k]) for k in a.lora), "and trains its adapters on"
    for override, name in ({"s3d.lora_rank": 8}, "LoRA rank"), ({"s3d.gamma": 2}, "gamma"), ({"s3d.skip": (1, 3)}, "skip range"):
        with pytest.raises(drafter.DrafterError, match=f"has {name} .* this training run"):
            train(tiny_config(**{**stage, **override, "s3d.init_drafter": str(first)}), tmp_path / "refused", progress=False)
    with pytest.raises(s3d_jax.ConfigError, match="s3d.init_drafter .* s3d.lora_rank"):
        train(tiny_config(**{"s3d.init_drafter": str(first)}), tmp_path / "refused", progress=False)


SHARDED_STEP = r"""
import json, sys
import jax, numpy as np
sys.path.insert(0, sys.argv[1])
from test_train import tiny_config
from s3d_jax import data
from s3d_jax.train import Trainer, load_base_model, make_mesh, make_optimizer, objective_from, place_batch, shardings, trainable_mask

cfg = tiny_config(**{"train.batch_size": 4})
base = load_base_model(cfg)
objective = objective_from(cfg, base.config.num_layers)
masks = trainable_mask(base.params, base.config, objective.skip, False, False)
optimizer, _ = make_optimizer(cfg.train, masks)
trainer = Trainer(base.config, objective, optimizer, masks, "float32")
rows, _ = data.load_dataset(cfg.data.path, base.tokenizer, max_len=64, max_conversations=40, progress=False)
batch_rows = rows.take(np.arange(4))
out = {}
meshes = [("single", (1, 1), False), ("data4_fsdp", (4, 1), True), ("data2_model2", (2, 2), True), ("explicit_axes", (2, 2), True)]
for name, shape, fsdp in meshes:
    cfg.mesh.data, cfg.mesh.model, cfg.mesh.fsdp = shape[0], shape[1], fsdp
    if name == "single":
        mesh = jax.make_mesh((1, 1), ("data", "model"), devices=jax.devices()[:1], axis_types=(jax.sharding.AxisType.Auto,) * 2)
    elif name == "explicit_axes":
        mesh = jax.make_mesh(shape, ("data", "model"))  # Explicit axes, jax.make_mesh's default
        assert jax.sharding.AxisType.Explicit in mesh.axis_types
    else:
        mesh = make_mesh(cfg.mesh)
    abstract = jax.eval_shape(trainer.init, base.params, 0)
    sharding = shardings(abstract, mesh, fsdp)
    state = jax.jit(trainer.init, static_argnums=1, out_shardings=sharding)(base.params, 0)
    step = jax.jit(trainer.step, out_shardings=(sharding, None))
    state, metrics = step(state, place_batch(batch_rows, mesh, 1))
    spec = state.params["layers"]["mlp"]["gate_up"].sharding.spec
    out[name] = {"loss": float(metrics["draft_loss_sum"] / metrics["targets"]), "spec": str(spec),
                 "params": {f"{key}[{i}]": np.asarray(v[i]).tolist() for path, v in jax.tree_util.tree_leaves_with_path(state.params)
                            if (key := jax.tree_util.keystr(path)).startswith("['layers']") for i in (0, 5)}}
print(json.dumps(out))
"""


@pytest.mark.needs("bundled_model", "mt_bench")
def test_sharded_step_equals_unsharded():
    env = devices_env(4, JAX_PLATFORMS="cpu")
    command = [sys.executable, "-c", SHARDED_STEP, str(Path(__file__).parent)]
    result = subprocess.run(command, capture_output=True, text=True, env=env, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    out = json.loads(result.stdout.strip().splitlines()[-1])
    assert "data" in out["data4_fsdp"]["spec"] and "model" in out["data2_model2"]["spec"], "parameters really are sharded"
    for name in ("data4_fsdp", "data2_model2", "explicit_axes"):
        assert out[name]["loss"] == pytest.approx(out["single"]["loss"], rel=1e-5)
        for k, ref in out["single"]["params"].items():
            np.testing.assert_allclose(np.asarray(out[name]["params"][k]), np.asarray(ref), rtol=1e-5, atol=1e-6, err_msg=f"{name} {k}")


# ------------------------------------------------------------------ bad input


@pytest.mark.needs("bundled_model")
def test_data_without_usable_conversations(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps([{"id": "1", "conversations": [{"from": "human", "value": "hi"}]}, {"nothing": 1}]))
    with pytest.raises(DataError, match="no usable conversation"):
        train(tiny_config(**{"data.path": str(bad)}), tmp_path / "run", progress=False)


@pytest.mark.needs("bundled_model", "mt_bench")
def test_checkpoint_of_another_model_is_refused(tmp_path):
    train(tiny_config(**{"train.steps": 2, "train.checkpoint_every": 2, "data.max_conversations": 20}), tmp_path, progress=False)
    with pytest.raises(checkpoint.CheckpointError, match="another model"):
        train(tiny_config(**{"train.steps": 4, "model.num_layers": 5, "data.max_conversations": 20}), tmp_path, progress=False)


def dry_run_report(capsys, name: str) -> dict:
    """`python -m s3d_jax.train --config configs/<name>.py --dry-run`, run in this process."""
    assert train_main(["train", "--config", str(ROOT / "configs" / f"{name}.py"), "--dry-run"]) == 0, capsys.readouterr().err[-2000:]
    return json.loads(capsys.readouterr().out)


def test_dry_run_needs_no_weights(capsys):
    for name in ("phi3", "llama2_7b", "llama3_8b", "qwen3_8b"):
        report = dry_run_report(capsys, name)
        p = report["parameters"]
        assert p["trainable"] + p["frozen"] == p["total"] and 0.3 < p["frozen"] / p["total"] < 0.7
        assert report["memory_per_device_gib"]["total"] > 10
        if name == "phi3":
            assert 3.7e9 < p["total"] < 3.9e9


@pytest.mark.needs("bundled_model")
@pytest.mark.parametrize("name", ["smollm2", "smollm2_small", "smollm2_stage2", "smollm2_stage3", "smollm2_stage4", "smollm2_paper"])
def test_dry_run_of_a_bundled_model_recipe_reads_its_config(capsys, name):
    p = dry_run_report(capsys, name)["parameters"]
    assert 1.3e8 < p["total"] < 1.5e8 and 0 < p["trainable"] < 0.05 * p["total"], p  # SmolLM2-135M with draft-only LoRA


@pytest.mark.needs("bundled_model", "mt_bench")
def test_qlora_trains_adapters_on_an_int4_base(tmp_path):
    """base_dtype int4: the frozen projections stay int4 through the run (QLoRA), the adapters and the
    mask row train in float32, and the drafter decodes exactly on that int4 base."""
    quantizable = {"model.head_dim": 32, "model.num_heads": 2, "model.num_kv_heads": 1}
    cfg = tiny_config(**quantizable, **{"base_dtype": "int4", "s3d.lora_rank": 4, "train.steps": 4, "train.lr": 1e-2})
    base = load_base_model(cfg)
    assert quant.bits_of(base.params["layers"]["mlp"]["down"]) == 4 and not quant.is_quantized(base.params["embed"])
    out = train(cfg, tmp_path, progress=False)
    assert out.name == "drafter.safetensors"
    bare = load_base_model(tiny_config(**quantizable, base_dtype="int4"))  # the same weights, without adapters
    base = s3d_jax.Model(quant.quantize_params(bare.params, "int4"), bare.config.replace(dtype="int4"), bare.tokenizer)
    trained_model = drafter.apply(base, out)  # on the int4 model that s3d_jax.load(dtype="int4") gives
    lora = [v for k, v in leaves(trained_model.params).items() if "_lora']['b']" in k]
    assert lora and any(np.abs(v).max() > 0 for v in lora), "the adapters trained"
    prompt = [1, 2, 3, 4, 5]
    assert_exact(trained_model, prompt, plain_model=base, max_new_tokens=10, eos_token_ids=(), min_certainty=0.0)
    with pytest.raises(s3d_jax.ConfigError, match="base_dtype int4 .* s3d.lora_rank"):
        train(tiny_config(**quantizable, base_dtype="int4"), tmp_path / "full", progress=False)
