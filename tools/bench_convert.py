"""A conversion's peak memory against the size of the model it writes, at each precision.

    python tools/bench_convert.py                                    # Qwen2.5-Coder-0.5B's GGUF (make qwen)
    python tools/bench_convert.py --src PATH                         # any GGUF file or HF directory
    python tools/bench_convert.py --random qwen2.5-1.5b              # a random model of Qwen2.5-1.5B's shape

Each conversion (`s3d_jax.convert.convert`) runs in a process of its own (`s3d_jax.bench.harness`),
which reports its own peak resident memory (VmHWM); "output" is the size of the params the converted
model holds at that precision. `--random` writes, once, a Hugging Face directory of float16
safetensors with that model's shape and random weights (no tokenizer), into the cache. Writes
convert.md and convert.json to --out.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import time
from pathlib import Path

from s3d_jax.bench import harness
from s3d_jax.bench.random_model import SHAPES, random_qwen2
from s3d_jax.config import DTYPES
from s3d_jax.paths import cache_root


def engine(request: dict) -> dict:
    """The child: one conversion, its peak memory and the size of its params."""
    import jax

    from s3d_jax import checkpoint
    from s3d_jax.convert import convert
    from s3d_jax.model import abstract_params

    start = time.perf_counter()
    out = convert(request["src"], request["out"], request["dtype"], progress=False, overwrite=True)
    seconds = time.perf_counter() - start
    config = checkpoint.load_config(out)
    output = sum(math.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves(abstract_params(config))) / 2**20
    return {"dtype": request["dtype"], "peak_mib": harness.peak_rss_mib(), "output_mib": output, "seconds": seconds}


def render(source: str, rows: list[dict]) -> str:
    lines = [f"Conversion of {source}", "", "| dtype | output MiB | peak MiB | peak - output MiB | peak / output | seconds |",
             "| --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        lines.append(f"| {r['dtype']} | {r['output_mib']:.0f} | {r['peak_mib']:.0f} | {r['peak_mib'] - r['output_mib']:.0f} | "
                     f"{r['peak_mib'] / r['output_mib']:.2f} | {r['seconds']:.0f} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="tools/bench_convert.py", description=__doc__.splitlines()[0])
    where = p.add_mutually_exclusive_group()
    where.add_argument("--src", help="a GGUF file or HF directory (default: Qwen2.5-Coder-0.5B's GGUF)")
    where.add_argument("--random", choices=sorted(SHAPES), help="a random model of this shape")
    p.add_argument("--dtypes", default="float32,bfloat16,int8,int4", help=f"among {', '.join(DTYPES)}")
    p.add_argument("--out", default="results/convert", help="where convert.md and convert.json go")
    args = p.parse_args(argv)
    dtypes = args.dtypes.split(",")
    if unknown := [d for d in dtypes if d not in DTYPES]:
        p.error(f"unknown dtypes {unknown}; choose among {', '.join(DTYPES)}")
    if args.random:
        src = random_qwen2(cache_root() / "random" / args.random, SHAPES[args.random])
    elif args.src:
        src = Path(args.src)
    else:
        from s3d_jax import bundled  # imports JAX, which the parent needs only here

        src = bundled.gguf_path("qwen2.5-coder-0.5b")
    rows = []
    with tempfile.TemporaryDirectory(dir=cache_root()) as scratch:
        for dtype in dtypes:
            print(f"converting {src} to {dtype} ...", file=sys.stderr, flush=True)
            request = {"src": str(src), "out": str(Path(scratch) / dtype), "dtype": dtype}
            rows.append(harness.run_engine([__file__, "--engine"], request))
            print(render(str(src), rows[-1:]).splitlines()[-1], file=sys.stderr, flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    table = render(args.random or str(src), rows)
    (out / "convert.md").write_text(table)
    (out / "convert.json").write_text(json.dumps({"source": args.random or str(src), "rows": rows}, indent=2))
    print(table)
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["--engine"]:
        sys.exit(harness.serve(engine, *sys.argv[2:]))
    sys.exit(main())
