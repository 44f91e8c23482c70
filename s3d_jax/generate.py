"""Command line: `python -m s3d_jax.generate --prompt "..." [--chat] [--method s3d|ar|selfspec]`.

Streams the continuation as the jitted loop produces it (in chunks of iterations, not per token),
then prints the decoding statistics. `--compare` then decodes the same prompt plainly and reports
whether the outputs are identical, and the speed ratio of the two: the median tokens/s of `--repeats`
whole (not streamed) decodes of each, taken in turn after a first run of each.
"""

from __future__ import annotations

import argparse
import statistics
import sys

from s3d_jax import calibration, options
from s3d_jax.api import DecodeOutput, decode, load, stream
from s3d_jax.kernel import ffi


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m s3d_jax.generate", description=__doc__.splitlines()[0])
    p.add_argument("--prompt", required=True)
    p.add_argument("--chat", action="store_true", help="apply the model's chat template")
    options.add_model_arguments(p)
    options.add_arguments(p)
    p.add_argument("--chunk", type=positive_int, default=4, help="iterations between streamed updates")
    p.add_argument("--compare", action="store_true", help="also decode plainly (method ar) and report the speed ratio")
    p.add_argument("--repeats", type=positive_int, default=3,
                   help="with --compare: timed decodes of each method, taken in turn; the ratio is of their medians")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        decode_options = options.DecodeOptions.from_args(args)  # checked before the model loads
        ffi.switched_on()  # and so are S3D_JAX_FEW_ROW_KERNEL
        calibration.switched_on()  # and S3D_JAX_CALIBRATE
        model = load(**options.load_arguments(args))
        chunks = stream(model, args.prompt, decode_options, chunk_iterations=args.chunk)
        shown = ""
        for chunk in chunks:
            if isinstance(chunk, DecodeOutput):
                text = chunk.text if chunk.text is not None else " ".join(map(str, chunk.tokens))
            else:
                text = model.tokenizer.decode(chunk[0], skip_special_tokens=True) if model.tokenizer else ""
            if text.startswith(shown):
                sys.stdout.write(text[len(shown) :])
                sys.stdout.flush()
                shown = text
        print()
        print(f"[{chunk.stats.summary()}]", file=sys.stderr)
        if args.compare and decode_options.method != "ar":
            plain = decode(model, args.prompt, decode_options.plain())  # compiles; its first run
            print(f"[{plain.stats.summary()}]", file=sys.stderr)
            # Timed alike: each decoded whole (the stream above went back to the host every chunk) and
            # after its first run, so neither pays for first-run costs or for printing; in turn, and the
            # median of each, so that a moment of a busy machine moves one sample, not the ratio.
            runs = {"plain": decode_options.plain(), decode_options.method: decode_options}
            samples = {name: [] for name in runs}
            for _ in range(args.repeats):
                for name, opts in runs.items():
                    samples[name].append(decode(model, args.prompt, opts).stats.tokens_per_second)
            speeds = {name: statistics.median(values) for name, values in samples.items()}
            ratio = speeds[decode_options.method] / speeds["plain"]
            same = "identical to" if chunk.tokens == plain.tokens else "DIFFERENT from"
            exact = f"; its output is {same} plain greedy's" if decode_options.temperature == 0 else ""
            timed = ", ".join(f"{name} {speed:.1f}" for name, speed in speeds.items())
            timing = f"{timed} tokens/s, medians of {args.repeats} runs each after a first"
            print(f"[{decode_options.method} ran at {ratio:.2f}x plain decoding ({timing}){exact}]", file=sys.stderr)
    except ValueError as e:  # ConfigError and CheckpointError are ValueErrors
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
