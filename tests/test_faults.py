"""Faults and hostile input for the trainer and the converter: nothing silent, nothing lost.

A kill or an error while a model directory is written leaves the previous one intact; a corrupt
newest checkpoint is set aside and the run resumes from the one before; a resume under another
objective, data stream or a smaller `train.steps` is refused naming each field; metrics.jsonl
never repeats a step; a jsonl data file cut off mid-line keeps its whole lines; and a table of bad
inputs to both CLIs gets `error: ...` and exit code 2 (or a ValueError naming the problem)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from reference import one_tensor_gguf, tiny_model
from safetensors.numpy import load_file, save_file
from test_train import ROOT, leaves, records, tiny_config

import s3d_jax
from s3d_jax import checkpoint, data
from s3d_jax.checkpoint import CheckpointError
from s3d_jax.config import ConfigError
from s3d_jax.convert import convert, export_hf
from s3d_jax.convert import main as convert_main
from s3d_jax.data import DataError
from s3d_jax.train import train
from s3d_jax.train.__main__ import main as train_main

# Two checkpoints (steps 2 and 4; tiny.py keeps 2), a record every step, an evaluation every other.
RUN = {"train.steps": 4, "train.checkpoint_every": 2, "train.eval_every": 2, "train.log_every": 1, "data.max_conversations": 20}


def listing(where: Path) -> dict[str, int]:
    """Every file under `where` with its size."""
    return {str(p.relative_to(where)): p.stat().st_size for p in sorted(where.rglob("*")) if p.is_file()}


def siblings(where: Path) -> list[str]:
    return sorted(p.name for p in where.parent.iterdir() if p.name.startswith(where.name + "."))


def truncate_largest(step_dir: Path) -> Path:
    """Halves the largest array file of a checkpoint (a disk that filled up, a copy cut short)."""
    victim = max((p for p in (step_dir / "state").rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
    os.truncate(victim, victim.stat().st_size // 2)
    return victim


# ------------------------------------------------------------------ the training run


@pytest.fixture(scope="module")
def base_run(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("base") / "run"
    out = train(tiny_config(**RUN), workdir, progress=False)
    return workdir, leaves(s3d_jax.load(out).params)


@pytest.fixture
def run_copy(base_run, tmp_path):
    return Path(shutil.copytree(base_run[0], tmp_path / "run"))


def corrupt_data(step_dir: Path) -> Path:
    return truncate_largest(step_dir)


def corrupt_metadata(step_dir: Path) -> Path:
    (step_dir / "state" / "_METADATA").unlink()
    return step_dir / "state" / "_METADATA"


# The failed read of a corrupt checkpoint leaves no echo ("Event loop is closed", "Exception ignored ...").
QUIET = pytest.mark.filterwarnings("error::pytest.PytestUnraisableExceptionWarning")


@QUIET
@pytest.mark.parametrize("corrupt", [corrupt_data, corrupt_metadata], ids=["truncated-array-file", "deleted-metadata"])
@pytest.mark.needs("bundled_model", "mt_bench")
def test_corrupt_newest_checkpoint_resumes_from_the_previous_one(run_copy, base_run, capfd, corrupt):
    corrupt(run_copy / "checkpoints" / "4")
    corrupt_files = listing(run_copy / "checkpoints" / "4")
    out = train(tiny_config(**RUN), run_copy, progress=False)
    err = capfd.readouterr().err
    assert "checkpoint step 4 is corrupt" in err and "resuming from step 2" in err, err
    assert "Event loop is closed" not in err and "Traceback" not in err and "Exception ignored" not in err, err[-3000:]
    # Set aside whole, not deleted.
    assert listing(run_copy / "checkpoints_corrupt" / "4") == corrupt_files
    # Steps 3 and 4 ran again from step 2's state and data position: the same params as the unbroken run.
    got, want = leaves(s3d_jax.load(out).params), base_run[1]
    for k in want:
        np.testing.assert_allclose(got[k], want[k], rtol=1e-5, atol=1e-6, err_msg=k)
    assert [r["step"] for r in records(run_copy, "train")] == [1, 2, 3, 4]


@QUIET
@pytest.mark.needs("bundled_model", "mt_bench")
def test_no_readable_checkpoint_stops_and_moves_nothing(run_copy, capfd):
    for step in (2, 4):
        truncate_largest(run_copy / "checkpoints" / str(step))
    before = listing(run_copy)
    with pytest.raises(CheckpointError, match=r"no checkpoint in .* can be read \(step 4: .*; step 2: .*\)"):
        train(tiny_config(**RUN), run_copy, progress=False)
    assert listing(run_copy) == before
    assert "Event loop is closed" not in capfd.readouterr().err


@pytest.mark.parametrize(
    "changes, fragments",
    [
        ({"s3d.skip": (1, 4), "s3d.gamma": 5, "s3d.masking": "iid"},
         ["s3d.gamma: 3 -> 5", "s3d.masking: 'span' -> 'iid'", "s3d.skip: [2, 3] -> [1, 4]"]),
        ({"s3d.train_head": True, "s3d.kl_weight": 0.5}, ["s3d.kl_weight: 0.0 -> 0.5", "s3d.train_head: False -> True"]),
        ({"data.max_len": 48, "train.seed": 7}, ["data.max_len: 64 -> 48", "train.seed: 0 -> 7"]),
        ({"train.batch_size": 2}, ["train.batch_size x train.grad_accum: 4 -> 2"]),
        ({"s3d.lora_rank": 4}, ["another model", "model.draft_lora_rank: 0 -> 4"]),
        ({"train.steps": 3}, ["at step 4, past train.steps=3", "train.steps >= 4"]),
    ],
    ids=["objective", "head-and-kl", "data-stream", "rows-per-step", "lora", "fewer-steps"],
)
@pytest.mark.needs("bundled_model", "mt_bench")
def test_resume_under_other_settings_is_refused_naming_each_field(run_copy, changes, fragments):
    before = listing(run_copy)
    with pytest.raises(CheckpointError) as caught:
        train(tiny_config(**{**RUN, **changes}), run_copy, progress=False)
    message = str(caught.value)
    for fragment in fragments:
        assert fragment in message, message
    assert "mask_prob" not in message and "loss_positions" not in message, "only the fields that differ are named"
    assert listing(run_copy) == before, "a refused resume writes nothing"


@pytest.mark.needs("bundled_model", "mt_bench")
def test_metrics_never_repeat_a_step_after_resume(run_copy, capfd):
    shutil.rmtree(run_copy / "checkpoints" / "4")  # killed after logging step 4 but before its checkpoint landed
    with (run_copy / "metrics.jsonl").open("a") as f:
        f.write('{"split": "train", "step": 5, "draft_lo')  # and in the middle of a write
    out = train(tiny_config(**{**RUN, "train.steps": 6}), run_copy, progress=False)  # a larger train.steps extends the run
    assert "extending the run from train.steps=4 to 6" in capfd.readouterr().err
    lines = (run_copy / "metrics.jsonl").read_text().splitlines()
    keys = [(r["split"], r["step"]) for r in map(json.loads, lines)]
    assert len(keys) == len(set(keys)), keys
    assert [s for split, s in keys if split == "train"] == [1, 2, 3, 4, 5, 6]
    assert [s for split, s in keys if split == "eval"] == [0, 2, 4, 6]
    # What the resumed run replaced is kept aside, the cut-off line included.
    discarded = (run_copy / "metrics.discarded.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in discarded[:-1]] == [3, 4, 4] and discarded[-1].endswith('"draft_lo')
    assert s3d_jax.load(out).config.draft_skip == (2, 3) and (run_copy / "curves.png").exists()


# ------------------------------------------------------------------ model directories are written whole


class FailingTokenizer:
    """Fails when the model directory is nearly written: params done, tokenizer next."""

    def save_pretrained(self, where):
        raise OSError(28, "No space left on device")


KILLED_SAVE = r"""
import os, signal, sys
sys.path.insert(0, sys.argv[1])
from reference import tiny_model
from s3d_jax import checkpoint

class KilledTokenizer:  # the params are written; the process dies before the tokenizer is
    def save_pretrained(self, where):
        os.kill(os.getpid(), signal.SIGKILL)

new = tiny_model(seed=1)
checkpoint.save(sys.argv[2], new.params, new.config, KilledTokenizer(), overwrite=True)
"""


def test_a_save_killed_midway_leaves_the_previous_model(tmp_path):
    old = tiny_model(seed=0)
    out = checkpoint.save(tmp_path / "model", old.params, old.config)
    before = listing(out)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    result = subprocess.run([sys.executable, "-c", KILLED_SAVE, str(ROOT / "tests"), str(out)], env=env, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == -signal.SIGKILL, result.stderr[-2000:]
    assert listing(out) == before
    got = leaves(s3d_jax.load(out).params)
    for k, v in leaves(old.params).items():
        assert got[k].tobytes() == v.tobytes(), k
    assert [name.split("-")[0] for name in siblings(out)] == ["model.tmp"], "the half-written copy is left beside, not in, the model"


@pytest.mark.parametrize("writer", ["checkpoint.save", "export_hf"])
def test_a_failed_write_leaves_the_previous_directory_and_no_temporary(tmp_path, writer):
    old, new = tiny_model(seed=0), tiny_model(seed=1)
    write = {
        "checkpoint.save": lambda model, tok, **kw: checkpoint.save(tmp_path / "out", model.params, model.config, tok, **kw),
        "export_hf": lambda model, tok, **kw: export_hf(s3d_jax.Model(model.params, model.config, tok), tmp_path / "out", **kw),
    }[writer]
    out = write(old, None)
    before = {name: (out / name).read_bytes() for name in listing(out)}
    with pytest.raises(OSError, match="No space left"):
        write(new, FailingTokenizer(), overwrite=True)
    assert {name: (out / name).read_bytes() for name in listing(out)} == before
    assert siblings(out) == []


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """A tiny s3d_jax model directory and the Hugging Face directory exported from it."""
    where = tmp_path_factory.mktemp("models")
    tiny = tiny_model()
    model = checkpoint.save(where / "model", tiny.params, tiny.config)
    hf = export_hf(s3d_jax.load(model), where / "hf")
    return SimpleNamespace(model=model, hf=hf)


def test_convert_into_an_existing_directory_loses_nothing_without_overwrite(models, tmp_path, capsys):
    out = tmp_path / "out"
    (out / "params").mkdir(parents=True)
    (out / "notes.txt").write_text("mine")
    (out / "params" / "keep.bin").write_bytes(b"\x00" * 10)
    (out / "tokenizer.json").write_text("{}")  # a tokenizer from an earlier model
    (out / "s3d_config.json").write_text("{}")  # and its config: a model directory, which --overwrite may replace
    before = listing(out)
    assert convert_main([str(models.hf), str(out), "--quiet"]) == 2
    assert "is not empty; pass --overwrite" in capsys.readouterr().err
    assert listing(out) == before
    assert convert_main([str(models.hf), str(out), "--quiet", "--overwrite"]) == 0
    fresh = convert(models.hf, tmp_path / "fresh", progress=False)
    assert sorted(p.name for p in out.iterdir()) == sorted(p.name for p in fresh.iterdir()) == ["params", "s3d_config.json"]
    assert not (out / "params" / "keep.bin").exists()
    assert s3d_jax.load(out).tokenizer is None, "no stale tokenizer survives"
    assert siblings(out) == []


def test_to_hf_over_an_old_sharded_directory_leaves_no_stale_shard(models, tmp_path, capsys):
    old = tmp_path / "hf_old"
    old.mkdir()
    (old / "config.json").write_text(json.dumps({"model_type": "llama"}))
    shards = {"model-00001-of-00002.safetensors": {"a": np.zeros(3, np.float32)},
              "model-00002-of-00002.safetensors": {"b": np.ones(3, np.float32)}}
    for name, tensors in shards.items():
        save_file(tensors, str(old / name))
    (old / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"a": "model-00001-of-00002.safetensors",
                                                                                 "b": "model-00002-of-00002.safetensors"}}))
    before = listing(old)
    assert convert_main([str(models.model), str(old), "--to-hf"]) == 2
    assert listing(old) == before
    assert convert_main([str(models.model), str(old), "--to-hf", "--overwrite"]) == 0
    assert set(listing(old)) == {"config.json", "generation_config.json", "model.safetensors"}
    fresh = export_hf(s3d_jax.load(models.model), tmp_path / "fresh")
    got, want = load_file(old / "model.safetensors"), load_file(fresh / "model.safetensors")
    assert got.keys() == want.keys() and all(np.array_equal(got[k], want[k]) for k in want), "the new weights, not the old shards"
    assert convert(old, tmp_path / "back", progress=False)  # and they convert back
    capsys.readouterr()


# ------------------------------------------------------------------ data


CONVERSATION = {"conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello! How can I help?"}]}


def test_jsonl_cut_off_mid_line_keeps_its_whole_lines(tmp_path, capfd):
    path = tmp_path / "replies.jsonl"
    whole = [json.dumps({"id": str(i), **CONVERSATION}) for i in range(3)]
    path.write_text("\n".join(whole) + "\n" + whole[0][:25])
    assert [r["id"] for r in data.read_records(path)] == ["0", "1", "2"]
    err = capfd.readouterr().err
    assert f"warning: {path}" in err and "(line 4)" in err and "kept the 3 whole lines" in err
    # A line left behind mid-file by a killed writer that then appended again is reported the same way.
    path.write_text(whole[0] + "\n" + whole[1][:30] + whole[2] + "\n" + whole[2] + "\n")
    assert len(data.read_records(path)) == 2 and "(line 2)" in capfd.readouterr().err


# ------------------------------------------------------------------ a table of bad inputs


BROKEN_CONFIG = "def get_config(:\n"


@pytest.fixture
def places(models, tmp_path):
    """Paths the bad inputs name: {model}, {hf}, {hf_parent}, {full} (a non-empty directory), {code} (someone's
    source code), {file}, {tmp}, {gguf} (cut off)."""
    full = tmp_path / "full"
    full.mkdir()
    (full / "notes.txt").write_text("mine")
    (tmp_path / "code").mkdir()
    (tmp_path / "code" / "main.py").write_text("print('mine')\n")
    (tmp_path / "file.txt").write_text("not a model")
    (tmp_path / "broken.py").write_text(BROKEN_CONFIG)
    (tmp_path / "lines.jsonl").write_text("not json\nnor this\n")
    return SimpleNamespace(model=models.model, hf=models.hf, hf_parent=models.hf.parent, full=full, file=tmp_path / "file.txt",
                           tmp=tmp_path, broken=tmp_path / "broken.py", lines=tmp_path / "lines.jsonl", gguf=truncated_gguf(tmp_path),
                           code=tmp_path / "code")


def truncated_gguf(where: Path) -> Path:
    """A llama GGUF cut off in its tensor data, as an interrupted download or copy leaves it."""
    path = one_tensor_gguf(where / "cut.gguf", "llama", np.ones((64, 32), np.float32))
    os.truncate(path, path.stat().st_size - 4096)
    return path


CLI_CASES = [
    # (command, arguments, exit code, a fragment of the message)
    ("convert", ["{hf}", "{full}"], 2, "is not empty; pass --overwrite"),
    ("convert", ["{hf}", "{file}"], 2, "exists and is not a directory"),
    ("convert", ["{hf}", "{file}", "--overwrite"], 2, "exists and is not a directory"),
    ("convert", ["{hf}", "{code}", "--overwrite"], 2, "it holds no model (s3d_config.json or config.json)"),
    ("convert", ["{model}", "{code}", "--to-hf", "--overwrite"], 2, "it holds no model"),
    ("convert", ["{gguf}", "{tmp}/out"], 2, "is truncated: its header describes"),
    ("convert", ["{hf}", "{hf}", "--overwrite"], 2, "would replace the source"),
    ("convert", ["{hf}/config.json", "{hf}", "--overwrite"], 2, "would replace the source"),
    ("convert", ["{hf}", "{hf_parent}", "--overwrite"], 2, "would replace the source"),
    ("convert", ["{hf}", ".", "--overwrite"], 2, "it is or holds the current directory"),  # run from {full}
    ("convert", ["{hf}", "..", "--overwrite"], 2, "it is or holds the current directory"),
    ("convert", ["{tmp}/nowhere", "{tmp}/out"], 2, "no model at"),
    ("convert", ["{file}", "{tmp}/out"], 2, "neither a GGUF file nor a Hugging Face model directory"),
    ("convert", ["{hf}", "{tmp}/out", "--dtype", "int2"], 2, "invalid choice: 'int2'"),
    ("convert", ["{model}", "{full}", "--to-hf"], 2, "is not empty; pass --overwrite"),
    ("convert", ["{model}", "{model}", "--to-hf", "--overwrite"], 2, "would replace the source"),
    ("convert", ["{hf}", "{tmp}/out", "--to-hf"], 2, "is not an s3d_jax model"),
    ("train", [], 2, "--config is required"),
    ("train", ["--config={tmp}/missing.py"], 2, "missing.py does not exist"),
    ("train", ["--config={broken}"], 2, "cannot load the config file"),
    ("train", ["--config.train.stepz=3"], 2, "the config has no field train.stepz; did you mean train.steps?"),
    ("train", ["--config.trian.steps=3"], 2, "the config has no field trian; did you mean train?"),
    ("train", ["--config.train.steps=abc"], 2, "--config.train.steps=abc: invalid literal"),
    ("train", ["--config.train.checkpoint_every=0"], 2, "config.train.checkpoint_every must be an integer >= 1, got 0"),
    ("train", ["--config.train.batch_size=0"], 2, "config.train.batch_size must be an integer >= 1, got 0"),
    ("train", ["--config.train.lr=nan"], 2, "config.train.lr must be a number in (0, inf), got nan"),
    ("train", ["--config.train.b2=1.0"], 2, "config.train.b2 must be a number in [0, 1), got 1.0"),
    ("train", ["--config.s3d.mask_prob=1.5"], 2, "config.s3d.mask_prob must be a number in (0, 1), got 1.5"),
    ("train", ["--config.s3d.masking=random"], 2, "config.s3d.masking must be one of 'span', 'iid', got 'random'"),
    ("train", ["--config.s3d.gamma=0"], 2, "config.s3d.gamma must be an integer >= 1, got 0"),
    ("train", ["--config.s3d.skip=(3,)"], 2, "config.s3d.skip must be a pair (l, h) of layer indices"),
    ("train", ["--config.data.loss_on=user"], 2, "config.data.loss_on must be one of 'assistant', 'last', 'all'"),
    ("train", ["--config.data.eval_fraction=1.0"], 2, "config.data.eval_fraction must be a number in [0, 1)"),
    ("train", ["--config.train.compute_dtype=int8"], 2, "config.train.compute_dtype must be one of"),
    ("train", ["--config.mesh.model=0"], 2, "config.mesh.model must be an integer >= 1"),
    ("train", ["--config.data.path={tmp}/nothing.jsonl"], 2, "nothing.jsonl does not exist"),
    ("train", ["--config.data.path={tmp}"], 2, "is a directory"),
    ("train", ["--workdir={file}"], 2, "exists and is not a directory"),
    ("train", ["--workdir=/proc/s3d_jax_run"], 2, "--workdir /proc/s3d_jax_run cannot be written"),  # a read-only filesystem
]


@pytest.mark.parametrize("command, arguments, code, fragment", CLI_CASES, ids=[f"{c}:{' '.join(a)}" for c, a, _, _ in CLI_CASES])
def test_bad_cli_input(places, capsys, monkeypatch, command, arguments, code, fragment):
    monkeypatch.chdir(places.full)
    arguments = [a.format(**vars(places)) for a in arguments]
    if command == "convert":
        run, argv = convert_main, [*arguments, "--quiet"]
    else:
        defaults = [] if not arguments else ["--config", str(ROOT / "configs" / "tiny.py")]
        if any(a.startswith("--config=") for a in arguments):
            defaults = []
        run, argv = train_main, ["train", *defaults, *([] if any(a.startswith("--workdir") for a in arguments) else
                                                      ["--workdir", str(places.tmp / "run")]), *arguments]
    try:
        got = run(argv)
    except SystemExit as e:  # argparse's own usage errors
        got = e.code
    err = capsys.readouterr().err
    assert got == code, err
    assert "error: " in err and fragment in err, err
    assert "Traceback" not in err
    assert not (places.tmp / "run").exists() and not (places.tmp / "out").exists(), "refused before any work"
    assert listing(places.full) == {"notes.txt": 4} and listing(places.code) == {"main.py": 14}


API_CASES = [
    # (what, call, exception, a fragment of the message)
    ("save into a non-empty directory", lambda p: checkpoint.save(p.full, tiny_model().params, tiny_model().config), CheckpointError,
     "is not empty"),
    ("export_hf into a non-empty directory", lambda p: export_hf(s3d_jax.load(p.model), p.full), CheckpointError, "is not empty"),
    ("convert onto its own source", lambda p: convert(p.hf, p.hf, overwrite=True), CheckpointError, "would replace the source"),
    ("convert into a file", lambda p: convert(p.hf, p.file, overwrite=True), CheckpointError, "is not a directory"),
    ("convert over a directory that holds no model", lambda p: convert(p.hf, p.code, overwrite=True), CheckpointError,
     "it holds no model"),
    ("convert a truncated GGUF", lambda p: convert(p.gguf, p.tmp / "out"), CheckpointError, "is truncated: its header describes"),
    ("train into a read-only workdir", lambda p: train(tiny_config(), Path("/proc/s3d_jax_run")), ConfigError, "cannot be written"),
    ("train with keep_checkpoints 0", lambda p: train(tiny_config(**{"train.keep_checkpoints": 0}), p.tmp / "run"), ConfigError,
     "config.train.keep_checkpoints must be an integer >= 1"),
    ("train with warmup_steps -1", lambda p: train(tiny_config(**{"train.warmup_steps": -1}), p.tmp / "run"), ConfigError,
     "config.train.warmup_steps"),
    pytest.param("train with a skip range outside the model", lambda p: train(tiny_config(**{"s3d.skip": (2, 9)}), p.tmp / "run"),
                 ConfigError, "skip range [2, 9] is outside the model", marks=pytest.mark.needs("bundled_model", "mt_bench")),
    ("jsonl with no whole line", lambda p: data.read_records(p.lines), DataError, "is not JSON lines"),
    ("a directory as the data file", lambda p: data.read_records(p.tmp), DataError, "is a directory"),
    ("a data file of another kind", lambda p: data.read_records(p.file), DataError, "unsupported data file"),
]


@pytest.mark.parametrize("what, call, exception, fragment", API_CASES, ids=[(getattr(c, "values", None) or c)[0] for c in API_CASES])
def test_bad_api_input(places, what, call, exception, fragment):
    with pytest.raises(exception) as caught:
        call(places)
    assert fragment in str(caught.value)
    assert listing(places.full) == {"notes.txt": 4} and (places.hf / "config.json").exists()
