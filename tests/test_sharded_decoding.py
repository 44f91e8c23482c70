"""Decoding over a device mesh, tensor-parallel, on simulated CPU devices: every method's output equals
one device's, each device holds its share of the weights, and a mesh the model cannot split is refused.

The cases run `sharded_child.py` in processes started with the device counts they need: the tiny
families share one, whose one-device tokens the two-process case compares against too."""

import json
import re
import socket
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from reference import devices_env
from sharded_child import reference_of

from s3d_jax import bundled, sharding
from s3d_jax.config import ConfigError
from s3d_jax.model import abstract_params
from s3d_jax.options import default_skip
from s3d_jax.shapes import shape_config

HERE = Path(__file__).parent


def child_env(devices: int, as_users: bool = False, **extra) -> dict:
    # S3D's fixed defaults: a calibration would time the sharded passes, a minute that checks nothing here.
    return devices_env(devices, as_users, S3D_JAX_CALIBRATE="0", **extra)


def start_child(spec: dict, env: dict) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, str(HERE / "sharded_child.py"), json.dumps(spec)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env, cwd=HERE)


def with_int_keys(report: dict) -> dict:
    """JSON's keys are strings: the mesh sizes back to ints."""
    return {int(k) if k.isdigit() else k: v for k, v in report.items()}


def child_report(child: subprocess.Popen):
    try:
        stdout, stderr = child.communicate(timeout=1800)
    finally:
        child.kill()
    assert child.returncode == 0, stderr[-3000:]
    return json.loads(stdout.strip().splitlines()[-1])


def run_child(cases: list[dict], devices: int, as_users: bool = False) -> list[dict]:
    return [with_int_keys(report) for report in child_report(start_child({"cases": cases}, child_env(devices, as_users)))]


# Every method on one family; on the others, whose layers split differently, S3D's tree (a draft pass
# and a verify pass) and the plain stream. The qwen3 case builds its meshes with `jax.make_mesh`
# (Explicit axes), the others with Auto axes.
FAMILY_CASES = {
    "llama": (["ar", "s3d_tree", "s3d_chain", "selfspec", "sampled"], (4,), {3: "num_heads of 8"}),
    "qwen3": (["s3d_tree"], (3,), {4: "num_kv_heads of 6"}),
    "gemma2": (["s3d_tree"], (3,), {2: "num_kv_heads of 3", 4: "num_heads of 6"}),
    "llama_int8": (["s3d_tree"], (2,), {3: "num_heads of 4"}),  # int8 values and scales split with their weights
}


@pytest.fixture(scope="module")
def family_reports(tmp_path_factory):
    """Each tiny family decoded on one device and over each of its meshes, all in one process of 4
    devices; returns ({family: report}, the directory of their checkpoints)."""
    root = tmp_path_factory.mktemp("families")
    cases = [{"family": family, "tmp": str(root / family), "meshes": sorted([*divides, *refused]), "new_tokens": 12, "methods": methods,
              "explicit": family == "qwen3"} for family, (methods, divides, refused) in FAMILY_CASES.items()]
    return dict(zip(FAMILY_CASES, run_child(cases, devices=4))), root


@pytest.mark.parametrize("family", FAMILY_CASES)
def test_every_method_decodes_over_a_mesh_as_on_one_device(family_reports, family):
    """Plain, S3D's chain and tree, self-speculative and seeded sampling: the same tokens as on one device
    (the greedy speculative methods: as one device's plain greedy)."""
    report = family_reports[0][family]
    _, divides, refused = FAMILY_CASES[family]
    for n in divides:
        assert report[n]["differ"] == [], (n, report[n])
        assert report[n]["logits_max_diff"] < 1e-4
        held = [b for b in report[n]["bytes"] if b]
        assert len(held) == n and max(held) <= report[n]["total"] / n * 1.05 + 4096  # 1/N each, plus the small replicated norms
    for n, words in refused.items():
        assert words in report[n]["refused"] and f"model axis of {n} devices" in report[n]["refused"]


@pytest.mark.slow
def test_bundled_model_with_its_drafter_decodes_over_three_devices(smollm2_dir):
    case = {"model_dir": str(smollm2_dir), "drafter": str(bundled.DRAFTER),
            "chats": ["What is the capital of France?", "Write a Python function that reverses a string."], "meshes": [3],
            "new_tokens": 32}
    # Compiled as users do (reference.users_env): at the test run's LLVM level 0 this case took 105 s, against 42 s.
    report = run_child([case], devices=3, as_users=True)[0][3]
    assert report["differ"] == [], report  # plain greedy and S3D at its calibrated policy, token for token
    # 1/3 of the weights and of each adapter's large factor; the norms and the adapters' rank-sized factors are whole.
    assert max(report["bytes"]) <= report["total"] / 3 * 1.06


def test_two_processes_decode_over_one_mesh_as_one_device(family_reports):
    """Two processes of two devices each join through `jax.distributed` (`JAX_COORDINATOR_ADDRESS`,
    `JAX_NUM_PROCESSES`, `JAX_PROCESS_ID`), as two hosts would, and decode over a mesh of all four
    the llama checkpoint that the family case saved: each gets S3D's and sampling's tokens, whole and
    streamed, equal to one device's."""
    reports, root = family_reports
    methods = ["s3d_tree", "sampled"]
    one_device = reports["llama"]["reference"]
    reference = {k: one_device[reference_of(k)] for k in [*methods, "streamed"]}
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cluster = {"JAX_COORDINATOR_ADDRESS": f"127.0.0.1:{port}", "JAX_NUM_PROCESSES": "2"}
    spec = {"tmp": str(root / "llama"), "meshes": [4], "new_tokens": 12, "methods": methods, "processes": 2}
    children = [start_child(spec, child_env(2, **cluster, JAX_PROCESS_ID=str(i))) for i in range(2)]
    try:
        reports = [with_int_keys(child_report(child)) for child in children]
    finally:  # one that failed leaves the other waiting for its peer
        for child in children:
            child.kill()
    assert [report[4] for report in reports] == [reference, reference]


def test_an_8b_model_is_split_into_equal_shares():
    """Llama-3-8B's shapes, never allocated: the layout alone gives each of 4 devices its share."""
    config = shape_config("llama3_8b")
    params = abstract_params(config)
    mesh = jax.sharding.AbstractMesh((1, 4), ("data", "model"))  # no devices needed for a layout
    layout = sharding.decode_shardings(params, config, mesh)
    total = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(params))
    per_device = sum(np.prod(s.shard_shape(x.shape)) * x.dtype.itemsize for x, s in zip(jax.tree.leaves(params), jax.tree.leaves(layout)))
    assert per_device <= total / 4 * 1.05


@pytest.mark.parametrize(("shape", "n", "bound"), [("smollm2_135m", 3, 1.06), ("llama3_8b", 4, 1.015)])
def test_a_drafter_s_adapters_are_split_with_their_weights(shape, n, bound):
    """Rank-32 adapters: the factor on a weight's split axis splits with it (replicating the adapters
    would put SmolLM2 at 1.14x its share on 3 devices, Llama-3-8B at 1.03x on 4)."""
    config = shape_config(shape)
    config = config.replace(draft_lora_rank=32, draft_skip=default_skip(config.num_layers))
    params = abstract_params(config)
    layout = sharding.decode_shardings(params, config, jax.sharding.AbstractMesh((1, n), ("data", "model")))
    specs = {jax.tree_util.keystr(path): s.spec for path, s in jax.tree_util.tree_leaves_with_path(layout)}
    split = {name: spec for name, spec in specs.items() if re.search(r"(qkv|gate_up)_lora'\]\['b'\]|(o|down)_lora'\]\['a'\]", name)}
    assert split and all("model" in spec for spec in split.values()), split
    total = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(params))
    per_device = sum(np.prod(s.shard_shape(x.shape)) * x.dtype.itemsize for x, s in zip(jax.tree.leaves(params), jax.tree.leaves(layout)))
    assert per_device <= total / n * bound


def test_bad_meshes_are_refused_with_the_reason():
    with pytest.raises(ConfigError, match="model=N"):
        sharding.decode_mesh("tensor=2")
    with pytest.raises(ConfigError, match="needs 64 devices"):
        sharding.decode_mesh("model=64")
    with pytest.raises(TypeError, match="Mesh"):
        sharding.decode_mesh(4)
