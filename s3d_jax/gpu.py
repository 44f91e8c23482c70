"""What a GPU backend may get from s3d_jax: the decode loop recorded as CUDA graphs, off unless asked for.

A decode iteration of a small model is hundreds of short kernels launched one after another; on an
H100 a plain step of SmolLM2 takes about 5x its bandwidth floor (docs/gpu.md). XLA records runs of
kernels as command buffers (CUDA graphs) and replays each with one launch, but by default not across
a `while` loop or a conditional, which is what the whole decode loop and its choice of iteration kind
are. `LOOP_OPTIONS` adds those two to the command types XLA records, for every decode executable
(`decoding.compile_ahead`), when `S3D_JAX_CUDA_GRAPHS=1`. Measured on an H100 (jaxlib 0.11.2), they
left a plain step as it was (1.5 against 1.6 ms) and made every pass of several tokens about 2.2x
slower (a verify of 5 tokens 2.78 plain steps against 1.28), so XLA's defaults are the default.
"""

from __future__ import annotations

import functools
import warnings

import jax

from s3d_jax.settings import env_switch

ENV_SWITCH = "S3D_JAX_CUDA_GRAPHS"
# A compile option replaces XLA's list of command types (only XLA_FLAGS takes `+WHILE`): its default
# list as of jaxlib 0.10, and the loop and its conditionals.
XLA_DEFAULT_COMMANDS = ("FUSION", "CUBLAS", "CUBLASLT", "CUSTOM_CALL", "CUDNN", "DYNAMIC_SLICE_FUSION")
LOOP_OPTIONS = {"xla_gpu_enable_command_buffer": ",".join((*XLA_DEFAULT_COMMANDS, "WHILE", "CONDITIONAL"))}


def applies() -> bool:
    """Whether the decode loop is compiled with `LOOP_OPTIONS`: a GPU backend, the switch turned on."""
    return jax.default_backend() == "gpu" and env_switch(ENV_SWITCH, default=False)


@functools.cache
def accepted(options: tuple) -> bool:
    """Whether this jaxlib's compiler takes `options` (names and values); a small function compiled with them."""
    try:
        jax.jit(lambda x: x + 1).lower(1).compile(dict(options))
    except Exception as error:  # a jaxlib that renamed the option, or lacks a command type
        warnings.warn(f"CUDA graphs for the decode loop are off: this jaxlib refuses {dict(options)}: {error}", RuntimeWarning,
                      stacklevel=3)
        return False
    return True


def loop_compiler_options() -> dict:
    """`LOOP_OPTIONS` where they apply and this jaxlib takes them; else none."""
    return dict(LOOP_OPTIONS) if applies() and accepted(tuple(LOOP_OPTIONS.items())) else {}
