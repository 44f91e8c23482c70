"""Command line: `python -m s3d_jax.serve [--model DIR] [--port 8000] [--max-batch 4]`: an OpenAI-compatible server.

POST /v1/chat/completions and /v1/completions (streamed or not), GET /v1/models, /health and /metrics.
Requests share one compiled S3D loop by continuous batching (docs/serving.md). SIGTERM or Ctrl-C
stops taking requests, finishes those in flight, then exits.
"""

from __future__ import annotations

import argparse
import signal
import sys
from pathlib import Path

from s3d_jax import bundled, calibration, options
from s3d_jax.api import load
from s3d_jax.generate import positive_int
from s3d_jax.kernel import ffi

DEFAULT_MAX_LEN = 2048  # each step reads the whole window (docs/serving.md), so not the model's whole context by default


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m s3d_jax.serve", description=__doc__.splitlines()[0])
    options.add_model_arguments(p)
    options.add_arguments(p)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--max-batch", type=positive_int, default=4, help="requests decoded together (slots of the compiled loop)")
    p.add_argument("--max-queue", type=int, default=16, help="requests that may wait for a slot; more are refused with 429")
    p.add_argument("--max-len", type=positive_int, default=None,
                   help="the context window: prompt + reply + draft block (default: 2048, or the model's context if smaller)")
    p.add_argument("--chunk", type=positive_int, default=4, help="iterations between the engine's looks at its requests")
    p.add_argument("--max-lanes", type=positive_int, default=2, help="sampling settings decoded at once (one loop each)")
    p.add_argument("--max-request-bytes", type=positive_int, default=None,
                   help="larger request bodies are refused with 413 unread (default: what a full context window can need, "
                        "about 3 MB for the bundled model at 2048 positions)")
    p.add_argument("--served-model-name", default=None, help="the name clients ask for (default: the model directory's name)")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        import uvicorn

        from s3d_jax.sampling import Sampling
        from s3d_jax.serve.app import Defaults, create_app
        from s3d_jax.serve.engine import Engine
        from s3d_jax.serve.lane import row_buckets

        decode_options = options.DecodeOptions.from_args(args)  # checked before the model loads
        if args.max_queue < 0:
            raise ValueError(f"--max-queue must be >= 0, got {args.max_queue}")
        ffi.switched_on()
        calibration.switched_on()
        model = load(**options.load_arguments(args))
        name = args.served_model_name or (Path(args.model).name if args.model else bundled.model_dir().name.split(".format")[0])
        max_len = args.max_len or min(DEFAULT_MAX_LEN, model.config.max_position_embeddings)  # a larger one is refused
        engine = Engine(model, decode_options, slots=args.max_batch, max_len=max_len, max_queue=args.max_queue,
                        chunk_iterations=args.chunk, max_lanes=args.max_lanes)
        batches = ", ".join(map(str, row_buckets(args.max_batch)))
        print(f"s3d_jax.serve: compiling the decode loop for batches of {batches} rows and caches up to {max_len} positions ...",
              file=sys.stderr)
        engine.start()
        for rows, why in sorted(engine.lane(Sampling()).policies.items()):
            if why:
                print(f"s3d_jax.serve: {rows} busy: {why}", file=sys.stderr)
        defaults = Defaults(max_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p, seed=args.seed)
        # uvicorn finishes the requests in flight on SIGTERM, then raises the signal again: end with 0, not killed.
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
        app = create_app(engine, name, defaults, max_request_bytes=args.max_request_bytes)
        uvicorn.run(app, host=args.host, port=args.port, log_level="info", access_log=False)
    except ValueError as e:  # ConfigError and CheckpointError are ValueErrors
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
