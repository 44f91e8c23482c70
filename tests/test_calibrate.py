"""Calibration (pass costs measured once per machine and model, cached) and the drafting policy that
`decode` takes from it where the caller left the S3D fields open."""

import dataclasses
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

import s3d_jax
from s3d_jax import calibration
from s3d_jax.checkpoint import Model
from s3d_jax.shapes import SHAPES, describe, random_model, shape_config
from s3d_jax.speedup import NEVER, PassCosts
from tests.reference import assert_exact, tiny_model

PROMPT = [5, 17, 3, 17, 5, 17, 3, 9]


def drafted(model: Model, profile=None) -> Model:
    """The tiny model as a drafter would leave it: skip, γ and a default tree, with an acceptance profile."""
    config = model.config.replace(draft_skip=(1, 1), draft_gamma=3, draft_tree=2)
    certainty = np.random.default_rng(0).uniform(0, 1, 40)
    if profile is None:  # trees that accept a draft everywhere, and more where x_n was certain (the larger tree more)
        profile = {n: [{"certainty": certainty, "drafted": 1 + (certainty > 0.5) * (n // 4),
                        "branch": np.zeros(40, int), "branch_k": np.zeros(40, int)}] for n in (4, 8)}
    return Model(model.params, config, model.tokenizer, profile)


def costs(step=10.0, draft=1.0, tree=10.0) -> PassCosts:
    return PassCosts(step=step, verify=tree, draft=draft, trees={4: tree, 8: tree, 16: tree, 24: tree}, gamma=3, seconds=0.0,
                     machine="injected")


@pytest.fixture
def model():
    return drafted(tiny_model(seed=3))


def test_calibration_measures_once_per_machine_and_model(model, monkeypatch, capsys):
    monkeypatch.setattr(calibration, "busy_ticks", lambda cores: 0)  # the other test process is not a busy machine here
    path = calibration.cache_file(model)
    path.unlink(missing_ok=True)  # another test of this run may have calibrated the same model
    first = calibration.calibrate(model, force=False)
    assert first.step > 0 and first.draft > 0 and set(first.trees) == set(calibration.TREE_SIZES)
    assert "calibrated in" in capsys.readouterr().err  # the command lines show that it ran, and how long it took
    assert path.is_file()
    timed = []
    monkeypatch.setattr(calibration, "time_passes", lambda *a: timed.append(a) or rounds(step=(1.0,) * 4)(*a))
    assert calibration.calibrate(model, force=False) == first and not timed  # cached: nothing measured
    again = calibration.calibrate(model)  # forced: measured again
    assert timed and again.step == 1.0 and calibration.calibrate(model, force=False) == again
    # Another dtype or another drafter is another calibration.
    assert calibration.cache_file(Model(model.params, model.config.replace(dtype="bfloat16"))) != path
    assert calibration.cache_file(Model(model.params, model.config.replace(draft_gamma=2))) != path
    with monkeypatch.context() as patch:  # and so are other passes, and another release
        patch.setattr(calibration, "PASSES_VERSION", calibration.PASSES_VERSION + 1)
        assert calibration.cache_file(model) != path
        patch.undo()
        patch.setattr(calibration, "release", lambda: "another release")
        assert calibration.cache_file(model) != path
    path.write_text("{not json")  # a damaged file is measured again, not an error
    assert calibration.calibrate(model, force=False).step == 1.0


def test_calibration_can_be_switched_off(model, monkeypatch):
    monkeypatch.setenv(calibration.ENV_SWITCH, "0")
    assert calibration.costs_for(model) == (None, "S3D_JAX_CALIBRATE=0")
    out = s3d_jax.decode(model, PROMPT, max_new_tokens=6)
    assert out.stats.policy == "the drafter's fixed defaults (S3D_JAX_CALIBRATE=0)" and out.stats.tree == 2
    monkeypatch.setenv(calibration.ENV_SWITCH, "maybe")
    with pytest.raises(ValueError, match="S3D_JAX_CALIBRATE"):
        calibration.costs_for(model)


def test_calibration_needs_a_drafter():
    with pytest.raises(ValueError, match="drafter"):
        calibration.calibrate(tiny_model())
    with pytest.raises(TypeError, match="Model"):
        calibration.calibrate("model")


@pytest.mark.parametrize(("injected", "drafts"), [(costs(tree=10.0, draft=0.1), True), (costs(tree=200.0, draft=50.0), False)])
def test_decode_takes_its_policy_from_the_model_s_costs(model, injected, drafts):
    model = model.replace(costs=injected)
    out, plain = assert_exact(model, PROMPT, max_new_tokens=12)  # every policy is exact
    assert "calibrated policy" in out.stats.policy and "the model's given costs" in out.stats.summary()
    if drafts:  # verifying costs what a step does: draft at every iteration, with the largest profiled tree
        assert out.stats.method == "s3d" and out.stats.tree == 8 and out.stats.min_certainty == 0.0
        assert sum(out.stats.iterations) > 0 and sum(out.stats.plain_steps) == 0
    else:  # no accepted count repays a drafted iteration: plain decoding
        assert out.stats.method == "ar" and "plain steps" in out.stats.policy
    # An explicit argument wins over the policy.
    explicit, _ = assert_exact(model, PROMPT, plain=plain, max_new_tokens=12, tree=2, min_certainty=0.0)
    assert explicit.stats.policy == "" and explicit.stats.tree == 2


def test_never_drafting_policy_keeps_the_branch_and_takes_plain_steps(model):
    profile = {n: [dict(r, branch=(np.arange(40) % 3 == 0).astype(int), branch_k=np.full(40, 3)) for r in rs]
               for n, rs in model.profile.items()}
    injected = dataclasses.replace(costs(tree=10.0, draft=200.0), trees={4: 12.0, 8: 14.0, 16: 16.0, 24: 18.0})
    never = drafted(model, profile).replace(costs=injected)
    out = s3d_jax.decode(never, PROMPT, max_new_tokens=12)
    assert out.stats.min_certainty == NEVER and out.stats.lookup
    assert out.tokens == s3d_jax.decode(never, PROMPT, method="ar", max_new_tokens=12).tokens
    assert sum(out.stats.iterations) == sum(out.stats.branch_only)  # no drafted tree
    assert "drafting never pays" in out.stats.summary() or not sum(out.stats.plain_steps)


def test_named_shapes_have_their_published_sizes():
    sizes = {name: describe(shape_config(name)).split(" ")[0] for name in SHAPES}
    assert sizes["smollm2_135m"] == "135M" and sizes["qwen3_0_6b"] == "596M" and sizes["llama3_1b"] == "1.24B"
    assert sizes["phi3_mini"] == "3.82B" and sizes["llama3_8b"] == "8.03B"
    with pytest.raises(ValueError, match="unknown model shape"):
        shape_config("gpt5")


def test_random_model_of_a_named_shape_decodes(monkeypatch):
    model = random_model("smollm2_135m", dtype="bfloat16")
    assert model.config.dtype == "bfloat16" and model.params["embed"].dtype.name == "bfloat16"
    out = s3d_jax.decode(model, [1, 2, 3], method="s3d", gamma=3, max_new_tokens=6)
    assert out.tokens == s3d_jax.decode(model, [1, 2, 3], method="ar", max_new_tokens=6).tokens
    monkeypatch.setattr("s3d_jax.shapes.available_memory_bytes", lambda: 2**30)
    with pytest.raises(MemoryError, match="GiB"):
        random_model("llama3_1b")


def test_the_drafter_file_carries_its_profile(model, tmp_path):
    from s3d_jax import drafter as drafter_lib

    made = drafter_lib.extract(model.params, model.config, (1, 1), 3, tree=2)
    path = drafter_lib.save(tmp_path / "d.safetensors", dataclasses.replace(made, profile=model.profile))
    loaded = drafter_lib.load_file(path)
    assert sorted(loaded.profile) == [4, 8]
    for size in (4, 8):
        for key in ("certainty", "drafted", "branch", "branch_k"):
            np.testing.assert_allclose(loaded.profile[size][0][key], model.profile[size][0][key])
    applied = drafter_lib.apply(tiny_model(seed=3), path)
    assert applied.profile is not None and applied.config.draft_tree == 2
    assert drafter_lib.load_file(drafter_lib.save(tmp_path / "none.safetensors", made)).profile is None


@pytest.mark.needs("bundled_model")
def test_predict_shape_prints_costs_and_the_policy(monkeypatch, capsys):
    from s3d_jax.predict.__main__ import main

    monkeypatch.setattr(calibration, "calibrate", lambda model, **kw: costs(step=20.0, draft=8.0, tree=22.0))
    assert main(["--shape", "smollm2_135m", "--dtype", "bfloat16"]) == 0
    out = capsys.readouterr().out
    assert "smollm2_135m (bfloat16)" in out and "step 20.0 ms" in out
    assert "at the drafter's acceptance: calibrated policy" in out


def rounds(step=(10.0,) * 4, other=12.0):
    """Injected `time_passes`: each pass's milliseconds in each of four rounds."""
    return lambda model, gamma, rows=1: {"step": list(step), "verify": [other] * 4, "draft": [5.0] * 4,
                                 **{n: [other + n] * 4 for n in calibration.TREE_SIZES}}


def test_each_pass_costs_its_fastest_round(model, monkeypatch):
    monkeypatch.setattr(calibration, "time_passes", rounds(step=(14.0, 10.0, 11.0, 10.5)))
    measured = calibration.calibrate(model, quiet=True)
    assert measured.step == 10.0 and measured.verify == 12.0 and measured.draft == 5.0 and measured.trees[8] == 20.0


def test_a_timed_run_lasts_long_enough_that_one_late_launch_does_not_look_like_load(model, monkeypatch):
    """A tiny model's passes take well under a millisecond, as a small model's do on a GPU: the loop
    runs again until MIN_RUN_MS have passed, and the cost is still per pass."""
    monkeypatch.setattr(calibration, "MIN_RUN_MS", 300)
    timer = calibration.pass_timer(model, calibration.verify_pass(model, 1), context=8, repeats=2)
    start = time.perf_counter()
    ms = timer()
    wall_ms = (time.perf_counter() - start) * 1e3
    assert wall_ms >= calibration.MIN_RUN_MS
    assert 0 < ms <= wall_ms / 2  # per pass, not per run


def test_costs_measured_on_a_busy_machine_are_measured_again_by_the_next_processes(model, monkeypatch, capsys):
    monkeypatch.delenv(calibration.ENV_TRIES, raising=False)  # the default, three tries (the test run keeps its first)
    monkeypatch.setattr(calibration, "time_passes", rounds())
    other = {"ticks": 0}

    def ticks(cores):  # other processes: 150 s of CPU between two readings of a far shorter block
        other["ticks"] += 150 * 100
        return other["ticks"]

    monkeypatch.setattr(calibration, "busy_ticks", ticks)
    path = calibration.cache_file(model)
    first = calibration.calibrate(model)
    assert first.busy and first.tries == 1 and path.is_file()
    assert "the machine looks busy (other processes kept" in capsys.readouterr().err
    assert calibration.calibrate(model, force=False) == first  # the process that measured them keeps them
    for tries in (2, 3):  # each new process measures again, while the machine stays busy
        calibration.measured_here.clear()
        assert calibration.calibrate(model, force=False).tries == tries
    assert "stay until" in capsys.readouterr().err
    calibration.measured_here.clear()
    assert calibration.calibrate(model, force=False).tries == 3  # then they stay
    monkeypatch.setattr(calibration, "busy_ticks", lambda cores: 0)  # a quiet calibration replaces them
    capsys.readouterr()
    quiet = calibration.calibrate(model)
    assert not quiet.busy and quiet.tries == 1 and "busy" not in capsys.readouterr().err
    assert calibration.calibrate(model, force=False) == quiet
    monkeypatch.setenv(calibration.ENV_TRIES, "1")  # a machine always shared: keep the first, busy or not
    monkeypatch.setattr(calibration, "busy_ticks", ticks)
    assert calibration.calibrate(model).busy and "stay until" in capsys.readouterr().err
    calibration.measured_here.clear()
    assert calibration.calibrate(model, force=False).tries == 1
    monkeypatch.setenv(calibration.ENV_TRIES, "0")
    with pytest.raises(ValueError, match="S3D_JAX_CALIBRATE_TRIES"):
        calibration.calibrate(model, force=False)


def test_without_the_kernel_s_counts_a_busy_machine_shows_in_the_step_s_rounds(model, monkeypatch, capsys):
    monkeypatch.setattr(calibration, "busy_ticks", lambda cores: None)
    monkeypatch.setattr(calibration, "time_passes", rounds(step=(10.0, 20.0, 10.0, 10.0)))
    assert calibration.calibrate(model).step == 10.0
    assert "a plain step took 10.0 to 20.0 ms" in capsys.readouterr().err
    monkeypatch.setattr(calibration, "time_passes", rounds(step=(10.0, 11.0, 10.0, 10.0)))
    calibration.calibrate(model)
    assert "busy" not in capsys.readouterr().err


def test_on_an_accelerator_only_the_step_s_rounds_say_busy(model, monkeypatch, capsys):
    # The host's other work (a GPU driver's threads) does not slow passes that run on the device.
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    other = {"ticks": 0}

    def ticks(cores):  # other processes keep the host's cores busy throughout
        other["ticks"] += 150 * 100
        return other["ticks"]

    monkeypatch.setattr(calibration, "busy_ticks", ticks)
    monkeypatch.setattr(calibration, "time_passes", rounds(step=(10.0, 11.0, 10.0, 10.0)))
    assert not calibration.calibrate(model).busy and "busy" not in capsys.readouterr().err
    monkeypatch.setattr(calibration, "time_passes", rounds(step=(10.0, 20.0, 10.0, 10.0)))
    assert calibration.calibrate(model).busy and "a plain step took 10.0 to 20.0 ms" in capsys.readouterr().err


def test_other_load_counts_another_process():
    # A process spinning beside a sleeping one: about a core of other load (the /proc/stat ticks are
    # 10 ms, so the block lasts a second; the other test process may add its own).
    spinner = subprocess.Popen([sys.executable, "-c", "import time\nend = time.time() + 4\nwhile time.time() < end: pass"])
    try:
        time.sleep(0.5)
        with calibration.other_load() as load:
            time.sleep(1.0)
    finally:
        spinner.kill()
        spinner.wait()
    if load.cores is None:
        pytest.skip("this system does not report CPU time per core (/proc/stat)")
    assert load.cores > 0.5


def test_a_shape_takes_its_own_drafters_skip_and_otherwise_the_middle_half():
    """`predict --shape` times a shape with a drafter's recipe: the drafter's skipped layers where it was
    trained for that depth (Qwen's, skip [6, 17] of 24), the middle half for any other depth."""
    from s3d_jax import bundled
    from s3d_jax import drafter as drafter_lib
    from s3d_jax.predict.shapes import drafted_shape

    qwen = drafter_lib.load_file(bundled.named("qwen2.5-coder-0.5b").drafter)
    assert drafted_shape("qwen2_5_coder_0_5b", "int4", qwen).draft_skip == tuple(qwen.skip) == (6, 17)
    other = drafted_shape("llama3_1b", "bfloat16", qwen)
    assert other.draft_skip == (4, 11) and other.draft_tree == qwen.tree and other.draft_lora_rank == qwen.lora_rank
