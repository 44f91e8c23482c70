"""Products of a few rows against a large weight on a CPU: the decode passes' matmuls.

XLA's CPU dot reads a weight at its streaming bandwidth for one row, but for 2 to 16 rows it packs
the weight first, so verifying 5 tokens cost about 2x a one-token step. `few_rows.cc`, an XLA FFI
handler, reads the weight once for all the rows, which is what speculative decoding needs from a
CPU. It is compiled with the machine's C++ compiler on first use (`-march=native`) into the cache
directory; without a compiler, or with `S3D_JAX_FEW_ROW_KERNEL=0`, every product stays on XLA's dot.

`matmul(x, w)` is the one entry point: the kernel where it applies (a CPU backend with one device,
float32, at most `MAX_ROWS` rows), `jnp.tensordot` everywhere else. It is differentiable.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import math
import os
import platform
import subprocess
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp

SOURCE = Path(__file__).with_name("few_rows.cc")
TARGET = "s3d_few_row_matmul"
MAX_ROWS = 16  # beyond this (prefill, training) XLA's dot is the faster one
ENV_SWITCH = "S3D_JAX_FEW_ROW_KERNEL"
FLAGS = ["-O3", "-march=native", "-ffp-contract=fast", "-std=c++20", "-shared", "-fPIC"]


def _library_path() -> Path:
    """Where this source, built for this machine and this jaxlib, lives in the cache."""
    from s3d_jax import bundled  # imports orbax: only when needed

    cpu = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else platform.processor()
    cpu_flags = next((line for line in cpu.splitlines() if line.startswith("flags")), cpu)
    key = hashlib.sha256(
        "\0".join([SOURCE.read_text(), " ".join(FLAGS), jax.__version__, platform.machine(), cpu_flags]).encode()
    ).hexdigest()[:16]
    return bundled.cache_root() / "kernels" / f"few_rows-{key}.so"


def _build(path: Path) -> None:
    """Compiles the kernel to `path`, atomically, so concurrent first uses are safe."""
    compiler = os.environ.get("CXX", "c++")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
    command = [compiler, *FLAGS, f"-I{jax.ffi.include_dir()}", str(SOURCE), "-o", str(tmp)]
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode:
        raise RuntimeError(f"`{' '.join(command)}` failed:\n{result.stderr[-2000:]}")
    tmp.replace(path)


def available() -> bool:
    """Whether the kernel is on: not switched off, built (once per machine) and registered with XLA."""
    return os.environ.get(ENV_SWITCH, "1") != "0" and _registered()


@functools.cache
def _registered() -> bool:
    try:
        path = _library_path()
        if not path.exists():
            _build(path)
        library = ctypes.cdll.LoadLibrary(str(path))
        jax.ffi.register_ffi_target(TARGET, jax.ffi.pycapsule(library.S3dFewRowMatmul), platform="cpu")
    except (OSError, RuntimeError) as error:
        warnings.warn(f"few-row CPU kernel unavailable, decoding uses XLA's dot: {error}", RuntimeWarning, stacklevel=3)
        return False
    return True


def applies(rows: int, x_dtype, w_dtype) -> bool:
    """Whether `matmul` uses the kernel for this product (decided when tracing)."""
    return (
        0 < rows <= MAX_ROWS
        and x_dtype == jnp.float32
        and w_dtype == jnp.float32
        and jax.default_backend() == "cpu"
        and jax.device_count() == 1  # sharded products stay with XLA's partitioner
        and available()
    )


@jax.custom_jvp
def _kernel(x_MK, w_KN):
    out = jax.ShapeDtypeStruct((x_MK.shape[0], w_KN.shape[1]), jnp.float32)
    return jax.ffi.ffi_call(TARGET, out, vmap_method="sequential")(x_MK, w_KN)


@_kernel.defjvp
def _kernel_jvp(primals, tangents):
    (x, w), (dx, dw) = primals, tangents
    return _kernel(x, w), dx @ w + x @ dw


def matmul(x, w, n_in: int = 1, precision=None, preferred_element_type=None):
    """`x @ w` over x's last `n_in` axes and w's first `n_in`, as `jnp.tensordot` with the same arguments."""
    in_shape, out_shape = w.shape[:n_in], w.shape[n_in:]
    lead = x.shape[: x.ndim - n_in]
    if not applies(math.prod(lead), x.dtype, w.dtype):
        return jnp.tensordot(x, w, axes=n_in, precision=precision, preferred_element_type=preferred_element_type)
    y = _kernel(x.reshape(math.prod(lead), math.prod(in_shape)), w.reshape(math.prod(in_shape), math.prod(out_shape)))
    return y.reshape(*lead, *out_shape)
