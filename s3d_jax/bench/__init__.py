"""The benchmarks: the comparison table (`python -m s3d_jax.bench`, see __main__.py) and the pieces
that the predictor and `tools/bench_decode.py` share.

Each engine runs in a process of its own, so that its peak memory is its own. A transformers peer's
process must not carry JAX, so only `methods` and `timing` import it:
  suites    MT-Bench, HumanEval and news prompts, and how an engine runs their turns
  quality   HumanEval pass@1 and ROUGE
  harness   an engine in a child process; peak RSS; the export for transformers
  report    a row per engine and suite; table.md, results.csv, raw.json, plots
  peers     transformers' engine: PyTorch `generate`
  methods   s3d_jax's engine: decode prompts with DecodeOptions and pool what they measured (JAX)
  timing    the cost of one pass: a plain step, a verify, an S3D draft (JAX)
  __main__  the command line, the parent of every engine (it reads the model's config, whose module
            imports JAX, but it runs no model)
"""
