"""The GPU's decode-loop options: set only on a GPU backend when switched on, and taken by this jaxlib's compiler
(which parses a GPU option on any backend, so the CPU checks its name and values)."""

import jax
import pytest

from s3d_jax import decoding, gpu


def test_this_jaxlib_takes_the_loop_options_and_refuses_a_bad_one():
    assert gpu.accepted(tuple(gpu.LOOP_OPTIONS.items()))
    with pytest.warns(RuntimeWarning, match="CUDA graphs for the decode loop are off"):
        assert not gpu.accepted((("xla_gpu_enable_command_buffer", "FUSION,NOT_A_COMMAND"),))


def test_the_options_apply_on_a_gpu_backend_only_and_only_when_switched_on(monkeypatch):
    monkeypatch.setenv(gpu.ENV_SWITCH, "1")
    assert gpu.loop_compiler_options() == {}  # this CPU
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    assert gpu.loop_compiler_options() == gpu.LOOP_OPTIONS
    for off in ("off", "0", ""):  # unset or empty is off: measured slower on an H100 (docs/gpu.md)
        monkeypatch.setenv(gpu.ENV_SWITCH, off)
        assert gpu.loop_compiler_options() == {}
    monkeypatch.setenv(gpu.ENV_SWITCH, "sometimes")
    with pytest.raises(ValueError, match=gpu.ENV_SWITCH):
        gpu.loop_compiler_options()


def test_decode_executables_are_compiled_with_them(monkeypatch):
    seen = []
    monkeypatch.setattr(gpu, "loop_compiler_options", lambda: seen.append(True) or {"xla_gpu_enable_command_buffer": "FUSION,WHILE"})
    fn = jax.jit(lambda x, few_row_kernel: x * 2, static_argnames="few_row_kernel")
    executable, _ = decoding.compile_ahead(fn, jax.numpy.ones(3), few_row_passes=True)
    assert seen and float(executable(jax.numpy.ones(3))[0]) == 2.0
