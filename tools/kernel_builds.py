"""Whether the few-row kernel gives the same bits when built for other instruction sets than this CPU's.

    python tools/kernel_builds.py                              # native against AVX2 (x86-64-v3)
    python tools/kernel_builds.py --march x86-64-v3,x86-64     # and against plain x86-64 (no FMA)

The kernel is built with `-march=native` (s3d_jax/kernel/build.py), so a machine with AVX512-VNNI
runs other code than an AVX2 one. Each build, in a process of its own, computes the same products:
every quantized format with int8 and float activations, and a float32 weight, at 1, 5, 13 and 16 rows,
over two shapes (one with columns past the last vector of 16), and compares each build's results
with the native build's bit for bit; it exits with 1 where any differ. A build without FMA (plain
x86-64) rounds the float paths' multiply-adds twice, so only its int8-activation products can match.
Each build takes about 20 s the first time (cached beside the native one).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from s3d_jax.bench import harness

FORMATS = ("int4", "int4-f32", "int4-g16", "int8", "int8-g16-min")
SHAPES = ((896, 4869), (128, 40))
ROWS = (1, 5, 13, 16)


def engine(request: dict) -> dict:
    """The products of one build (`-march=request["march"]`), saved to `request["out"]`."""
    from s3d_jax.kernel import build

    build.FLAGS = [f"-march={request['march']}" if flag.startswith("-march=") else flag for flag in build.FLAGS]
    import jax
    import jax.numpy as jnp
    import numpy as np

    from s3d_jax import quant
    from s3d_jax.kernel import dispatch, ffi

    if not ffi.available():
        raise SystemExit(f"the kernel did not build for -march={request['march']}")
    rng = np.random.default_rng(0)
    products = {}
    for fmt in (*FORMATS, "float32"):
        for K, N in SHAPES:
            w = jnp.asarray(rng.standard_normal((K, N), np.float32) * 0.05)
            w = w if fmt == "float32" else jax.tree.map(jnp.asarray, quant.quantize(w, 1, quant.Format.parse(fmt)))
            for activations in ("int8", "float32") if fmt != "float32" else ("float32",):
                product = jax.jit(lambda x, w, a=activations: dispatch.matmul(x, w, activations=a))
                for rows in ROWS:
                    x = jnp.asarray(rng.standard_normal((rows, K), np.float32))
                    products[f"{fmt} {K}x{N} @{activations} {rows} rows"] = np.asarray(product(x, w))
    np.savez(request["out"], **products)
    return {"products": len(products)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--march", default="x86-64-v3", help="builds to compare with the native one, comma-separated")
    p.add_argument("--engine", nargs=2, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.engine:
        harness.serve(engine, *args.engine)
        return 0
    import numpy as np

    with tempfile.TemporaryDirectory() as scratch:
        results = {}
        for march in ("native", *args.march.split(",")):
            out = str(Path(scratch) / f"{march}.npz")
            print(f"building and running -march={march} ...", file=sys.stderr, flush=True)
            harness.run_engine([__file__, "--engine"], {"march": march, "out": out})
            results[march] = dict(np.load(out))
        native, differ = results.pop("native"), 0
        for march, products in results.items():
            unequal = [name for name, y in products.items() if not np.array_equal(y.view(np.uint32), native[name].view(np.uint32))]
            differ += len(unequal)
            print(f"-march={march}: {len(products) - len(unequal)} of {len(products)} products equal the native build's bits")
            for name in unequal:
                print(f"  differs: {name}")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
