"""Plain decoding, S3D at the loaded model's defaults, and S3D that never drafts, interleaved in one
process on one chat prompt: tokens/s as medians over repeats, each as a ratio to plain, the CPU cores
the process kept busy while decoding, and whether each output equals plain greedy's.

    python tools/decode_ab.py                                  # the bundled model, `make demo`'s prompt
    S3D_JAX_FEW_ROW_SPIN_US=200 python tools/decode_ab.py      # the kernel's helpers spinning longer
    PYTHONPATH=/path/to/other/checkout python tools/decode_ab.py --tag before
    python tools/decode_ab.py --per-iteration 100            # ms per loop iteration, EOS ignored: the loop's own cost
    python tools/decode_ab.py --per-iteration 40 --shape smollm2_135m   # the same on random weights of a named shape
    python tools/decode_ab.py --per-iteration 40 --max-len 2048          # the same with a cache of 2048 positions
    python tools/decode_ab.py --per-iteration 40 --profile /tmp/loop     # and where each kind's iteration goes, by operation

Never run it beside another heavy process: the ratios are only as steady as the machine.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import gzip
import json
import os
import re
import statistics
import sys
import time
from pathlib import Path

import jax

import s3d_jax
from s3d_jax import api
from s3d_jax import options as options_lib
from s3d_jax.predict.shapes import shape_model
from s3d_jax.shapes import SHAPES

DEMO_PROMPT = "Write a Python function that returns the n-th Fibonacci number, and explain how it works."
KINDS = {"plain": dict(method="ar"), "s3d": {}, "s3d, never drafting": dict(min_certainty=1.0, lookup=False)}
# Per iteration, a drafted iteration's cost too. Random weights repeat themselves, so S3D at its defaults
# would copy them from the context many tokens an iteration and finish early: they run the other three.
ITERATION_KINDS = {**KINDS, "s3d, always drafting": dict(min_certainty=0.0, lookup=False)}
SHAPE_KINDS = {kind: kw for kind, kw in ITERATION_KINDS.items() if kind != "s3d"}
SHAPE_PROMPT_TOKENS = 64  # random weights have no tokenizer: the prompt is this many token ids


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prompt", default=DEMO_PROMPT)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=4)
    p.add_argument("--tag", default="", help="a label printed at the start of each line")
    p.add_argument("--per-iteration", type=int, default=0, metavar="N",
                   help="instead: time N loop iterations of each kind from the same start, EOS ignored, and report ms per iteration")
    p.add_argument("--max-len", type=int, default=None, metavar="N",
                   help="with --per-iteration: a cache of N positions (default: the smallest bucket that fits)")
    p.add_argument("--profile", metavar="DIR",
                   help="with --per-iteration: also trace each kind's N iterations under jax.profiler into DIR and print "
                        "milliseconds per iteration by operation (the model code that made it, or the kernel called)")
    p.add_argument("--tree", type=int, default=None, metavar="N",
                   help="S3D's token tree of N nodes (default: the drafter's; the never- and always-drafting kinds need one)")
    p.add_argument("--shape", choices=sorted(SHAPES),
                   help="with --per-iteration: random weights of this named shape and the shipped drafter's recipe, "
                        "instead of a model (no model file needed; --dtype applies)")
    options_lib.add_model_arguments(p)
    args = p.parse_args(argv)
    if (args.max_len is not None or args.profile) and not args.per_iteration:
        p.error("--max-len and --profile apply to --per-iteration's loops: add --per-iteration N")
    if args.shape:
        if not args.per_iteration:
            p.error("--shape times loop iterations only (random weights write no text worth a tokens/s): add --per-iteration N")
        given = [f"--{name.replace('_', '-')}" for name in ("model", "drafter", "draft_vocab", "mesh")
                 if getattr(args, name) not in (None, p.get_default(name))]
        if given:
            p.error(f"--shape builds its own model (random weights, the shipped drafter's recipe): {', '.join(given)} would be ignored")
        prompt = [(7 * i + 1) % 1000 for i in range(SHAPE_PROMPT_TOKENS)]
        return per_iteration(shape_model(args.shape, args.dtype or "float32"), prompt, False, args, SHAPE_KINDS)
    model = s3d_jax.load(**options_lib.load_arguments(args))
    if args.per_iteration:
        return per_iteration(model, args.prompt, True, args, ITERATION_KINDS)
    decode = {kind: (lambda kw=kw: s3d_jax.decode(model, args.prompt, chat=True, max_new_tokens=args.max_new_tokens, **kw))
              for kind, kw in with_tree(KINDS, args.tree).items()}
    for run in decode.values():  # compile and warm up
        run()
    speeds, cores, tokens = {kind: [] for kind in KINDS}, {kind: [] for kind in KINDS}, {}
    for _ in range(args.repeats):
        for kind, run in decode.items():
            before = os.times()
            out = run()
            after = os.times()
            speeds[kind].append(out.stats.tokens_per_second)
            cores[kind].append((after.user + after.system - before.user - before.system) / out.stats.decode_seconds)
            tokens[kind] = out.tokens
    plain = statistics.median(speeds["plain"])
    for kind in KINDS:
        speed = statistics.median(speeds[kind])
        print(f"{args.tag} {kind:20s} {speed:6.1f} tokens/s  {speed / plain:.3f}x plain  "
              f"{statistics.median(cores[kind]):.2f} cores busy  identical to plain: {tokens[kind] == tokens['plain']}".strip())
    return 0


def with_tree(kinds: dict, tree: int | None) -> dict:
    """Each S3D kind's keywords with `tree` where one was asked for."""
    return {kind: kw if tree is None or kind == "plain" else {**kw, "tree": tree} for kind, kw in kinds.items()}


def per_iteration(model, prompt, chat: bool, args, kinds: dict) -> int:
    """Milliseconds per iteration of each kind's compiled loop over the same N iterations after a warm-up
    of 5, rounds alternating: what an iteration costs, apart from how many tokens it emits."""
    runs = {}
    for kind, kw in with_tree(kinds, args.tree).items():
        _, runs[kind], _ = api.prepare(model, prompt, chat=chat, max_new_tokens=args.per_iteration * 8, eos_token_ids=(),
                                       max_len=args.max_len, **kw)
        runs[kind].compile()
    times = {kind: [] for kind in kinds}
    for _ in range(args.repeats):
        for kind, run in runs.items():
            times[kind].append(iteration_ms(run, args.per_iteration))
    plain = statistics.median(times["plain"])
    for kind in kinds:
        ms = statistics.median(times[kind])
        print(f"{args.tag} {kind:20s} {ms:6.2f} ms per iteration  {ms / plain:.3f}x plain's".strip())
    for kind, run in runs.items() if args.profile else ():
        print_profile(kind, run, args.per_iteration, os.path.join(args.profile, kind.replace(" ", "_").replace(",", "")))
    return 0


def iteration_ms(run, iterations: int, around=contextlib.nullcontext) -> float:
    """Milliseconds per iteration of `run`'s loop over `iterations` iterations after a warm-up of 5,
    the timed part inside the context `around()` (a profiler's trace)."""
    state = run.advance(run.start(), 5)
    jax.block_until_ready(state.tokens)
    with around():
        start = time.perf_counter()
        jax.block_until_ready(run.advance(state, 5 + iterations).tokens)
        return (time.perf_counter() - start) / iterations * 1e3


def print_profile(kind: str, run, iterations: int, out_dir: str, top: int = 12) -> None:
    """Traces `iterations` of `run`'s loop and prints ms per iteration by operation: the model code
    each one came from (its `op_name`, layers merged), or for a custom call the kernel it called.
    Times are inclusive of waits; the profiler itself slows the loop by a few percent."""
    wall = iteration_ms(run, iterations, lambda: jax.profiler.trace(out_dir, create_perfetto_trace=True))
    origin = {}
    for line in run.loop_hlo().splitlines():
        match = re.match(r"\s*(?:ROOT )?%?([\w.\-]+) = ", line)
        if not match or re.search(r" (?:conditional|while)\(", line):
            continue  # not an operation, or a loop or a branch: its time is its operations'
        target, op = re.search(r'custom_call_target="([^"]+)"', line), re.search(r'op_name="([^"]*)"', line)
        if target:
            origin[match.group(1)] = f"kernel {target.group(1)}"
        elif op:
            name = re.sub(r"jit\(advance\)/while/body/|/jit\(\w+\)|cond/branch_\d+_fun/", "", op.group(1))
            origin[match.group(1)] = "/".join(re.sub(r"layer_\d+", "layer_N", name).split("/")[:4])
    trace = max(Path(out_dir).rglob("*.trace.json.gz"), key=os.path.getmtime)
    events = json.load(gzip.open(trace))
    totals = collections.Counter()
    for event in events["traceEvents"] if isinstance(events, dict) else events:
        if event.get("ph") == "X" and event.get("name") in origin:
            totals[origin[event["name"]]] += event.get("dur", 0) / 1e3 / iterations
    print(f"{kind}: {wall:.2f} ms per iteration under the profiler, by operation (ms per iteration):")
    for name, ms in totals.most_common(top):
        print(f"  {ms:7.3f}  {name}")
    print(f"  {sum(totals.values()) - sum(ms for _, ms in totals.most_common(top)):7.3f}  everything else")


if __name__ == "__main__":
    sys.exit(main())
