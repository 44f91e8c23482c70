"""What each kind of pass costs on this machine for a loaded model, measured once and cached.

    s3d_jax.calibrate(model)            # measure now (and replace the cached costs)
    S3D_JAX_CALIBRATE=0                 # never measure: decode keeps its fixed defaults

Costs differ by machine, dtype and model: on a 2-core CPU a verify of 5 tokens costs about 1.5 plain
steps, on a GPU running a large model about one. `decode`'s drafting defaults (tree size, whether and
where to draft) come from these costs and the drafter's measured acceptance (`speedup.choose_policy`;
docs/design.md, "Drafting chosen from measured costs"). A calibration times a plain step, a verify of
γ+1 tokens, one S3D draft pass of γ and the verify of a token tree of each size in `TREE_SIZES`,
each inside one jitted loop (no dispatch in the timing), in interleaved rounds of which each pass
keeps its fastest. Costs measured while other processes kept this process's cores busy are marked so, and
the next process to need them measures again (up to `BUSY_TRIES` in a row, or
`$S3D_JAX_CALIBRATE_TRIES`; 1 keeps the first). The result is written to
`<cache root>/calibration/<key>.json`, keyed on the machine (processor, usable cores, backend and
device, jax and jaxlib, the few-row kernel's switch) and the model's config (shapes, dtype and the
drafter's skip, γ and draft head): a change of any of them measures again.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import functools
import hashlib
import importlib.metadata
import json
import math
import os
import platform
import sys
import time
import types

import jax
import jax.numpy as jnp
import jaxlib
import numpy as np

from s3d_jax import sharding, tree
from s3d_jax.cache import KVCache
from s3d_jax.checkpoint import Model
from s3d_jax.decoding import compile_ahead, few_row_batch
from s3d_jax.kernel import build, ffi
from s3d_jax.options import DEFAULT_GAMMA
from s3d_jax.paths import cache_root
from s3d_jax.settings import env_setting, env_switch, usable_cores
from s3d_jax.speculative import Plan, draft_s3d, verify
from s3d_jax.speedup import PassCosts, Policy

ENV_SWITCH = "S3D_JAX_CALIBRATE"
TREE_SIZES = (4, 8, 16, 24)  # the policy's candidate trees are 4, 8 and 16; 24 bounds their branch-alone passes (N + γ slots)
CONTEXT = 256  # cache positions filled while timing: a typical chat turn
# One context id in this many lies outside a reduced draft head's vocabulary, which the head then
# scores one by one: 12% of MT-Bench's prompt tokens, 9% of HumanEval's and 21% of the news articles'
# lie outside the shipped drafter's 8,192.
OUTSIDE_DRAFT_VOCAB = 8
ROUNDS = 4  # timed runs of each pass, interleaved with the others'; a pass costs its fastest
MIN_RUN_MS = 50  # the shortest timed run: its loop holds the passes that fill it, and runs again until it has lasted this long
BUSY_CORES = 0.25  # other processes' average use of this process's cores while calibrating, above which the costs are marked busy
BUSY_RATIO = 1.3  # where that use cannot be read: the plain step's fastest and slowest rounds differing by more
ENV_TRIES = "S3D_JAX_CALIBRATE_TRIES"
BUSY_TRIES = 3  # calibrations in a row that find the machine busy before their costs stay cached as they are ($S3D_JAX_CALIBRATE_TRIES)


def pass_timer(model, pass_fn, context: int = 256, repeats: int = 1, rows: int = 1):
    """A compiled, warmed-up `pass_fn(params, cache, x_n)` over a cache of `rows` rows filled to
    `context` positions; each call of the returned function times passes inside one jitted loop (no
    dispatch overhead), at least `repeats` of them and as many as the warm-up pass says fill
    MIN_RUN_MS, and returns milliseconds per pass. The input token changes every iteration, so XLA
    cannot hoist the pass out of the loop."""
    cache = KVCache.zeros(model.config, rows, max(512, context + 16)).replace(lengths=jnp.full((rows,), context, jnp.int32))

    def loop(params, cache, passes, few_row_kernel):
        def body(i, total):
            return total + pass_fn(params, cache, (i + jnp.arange(rows, dtype=jnp.int32)) % 1000).sum()

        with ffi.switch(few_row_kernel):
            return jax.lax.fori_loop(0, passes, body, jnp.zeros((), jnp.float32))

    # Compiled as the decode loop is; not kept in its cache, since `loop` closes over `pass_fn`.
    few_rows = few_row_batch(rows)  # as the decode loop decides
    one = jnp.int32(1)
    fn, _ = compile_ahead(jax.jit(loop, static_argnames="few_row_kernel"), model.params, cache, one, few_row_passes=few_rows)
    start = time.perf_counter()
    jax.block_until_ready(fn(model.params, cache, one))  # warm up
    # A pass of a large tree costs several steps (at a test run's optimisation level, half a second):
    # its run holds a few passes, a quick pass's many.
    count = max(repeats, math.ceil(MIN_RUN_MS / max((time.perf_counter() - start) * 1e3, 1e-3)))
    passes = jnp.int32(count)

    def timed() -> float:
        # The loop runs again until MIN_RUN_MS have passed: the warm-up pass may have been slow, and
        # a GPU runs a short loop in a few milliseconds, where one late launch would look like
        # another process's load.
        start, runs = time.perf_counter(), 0
        while (elapsed := time.perf_counter() - start) * 1e3 < MIN_RUN_MS or runs == 0:
            jax.block_until_ready(fn(model.params, cache, passes))
            runs += 1
        return elapsed / (runs * count) * 1e3

    return timed


def pass_ms(model, pass_fn, **timing) -> float:
    """Milliseconds of one `pass_fn` (`pass_timer`), timed once."""
    return pass_timer(model, pass_fn, **timing)()


def verify_pass(model, tokens: int):
    """A full-model pass over `tokens` tokens per row (1 is a plain decoding step)."""
    return lambda p, c, x_n: verify(p, model.config, c, x_n, jnp.zeros((len(x_n), tokens - 1), jnp.int32))[0]


def draft_pass(model, skip, gamma: int):
    """One S3D draft pass of `gamma` tokens through the layers outside `skip`, its head also scoring a
    context as long as the cache, as in decoding."""
    plan = Plan.make(model.config, "s3d", gamma=gamma, skip=skip)
    config = model.config
    outside = np.arange(config.vocab_size)
    if config.draft_vocab_size:
        inside = np.asarray(model.params["draft_vocab"])
        outside = np.setdiff1d(outside, inside)

    def run(p, c, x_n):
        j = x_n[:, None] + jnp.arange(c.max_len)
        context = jnp.asarray(outside)[j % len(outside)]  # distinct ids, as a real context gathers
        if config.draft_vocab_size:  # of which the head scores those outside its vocabulary only
            context = jnp.where(j % OUTSIDE_DRAFT_VOCAB == 0, context, jnp.asarray(inside)[j % len(inside)])
        return draft_s3d(p, config, plan, c, x_n, jax.random.key(0), context)[1]

    return run


def tree_pass(model, size: int, gamma: int):
    """Building a tree of `size` nodes from γ draft distributions, and its full-model verify pass."""
    config = model.config
    logits = jax.random.normal(jax.random.key(0), (1, gamma, config.vocab_size))
    if config.mask_token_id is not None:
        logits = logits.at[..., config.mask_token_id].set(-jnp.inf)

    def run(p, c, x_n):
        # Shifted by x_n (softmax ignores a shift), so XLA cannot fold the tree's top-k into a constant.
        nodes = tree.build(x_n, logits + x_n[:, None, None].astype(jnp.float32), size)  # [1, ...] broadcast over the rows
        return tree.verify(p, config, c, nodes, gamma)[0]

    return run


def verify_ms(model, tokens: int, **timing) -> float:
    return pass_ms(model, verify_pass(model, tokens), **timing)


def draft_ms(model, skip, gamma: int, **timing) -> float:
    return pass_ms(model, draft_pass(model, skip, gamma), **timing)


def tree_verify_ms(model, size: int, gamma: int, **timing) -> float:
    return pass_ms(model, tree_pass(model, size, gamma), **timing)


def time_passes(model, gamma: int, rows: int = 1) -> dict:
    """Milliseconds per round of each pass the policy weighs over `rows` rows: `step`, `verify` (γ+1
    tokens), `draft` (γ) and each tree of `TREE_SIZES`. Everything is compiled first, then the passes are timed in turn,
    `ROUNDS` times over, so that a disturbance of a second or two slows one round of each, not all
    rounds of one."""
    c = model.config
    passes = {"step": verify_pass(model, 1), "verify": verify_pass(model, gamma + 1), "draft": draft_pass(model, c.draft_skip, gamma),
              **{n: tree_pass(model, n, gamma) for n in TREE_SIZES}}
    # Compiling is most of a calibration (on a GPU nearly all of it), and XLA compiles outside the GIL:
    # the passes compile side by side, as many at a time as this process has cores.
    ffi.prepare()  # the kernel's first build, once, before the threads
    with concurrent.futures.ThreadPoolExecutor(min(len(passes), usable_cores())) as pool:
        made = pool.map(lambda fn: pass_timer(model, fn, context=CONTEXT, rows=rows), passes.values())
        timers = dict(zip(passes, made))
    rounds = {name: [] for name in timers}
    for _ in range(ROUNDS):
        for name, timer in timers.items():
            rounds[name].append(timer())
    return rounds


def busy_ticks(cores) -> int | None:
    """Clock ticks that `cores` have spent busy since boot (Linux's /proc/stat), or None where unreadable."""
    try:
        with open("/proc/stat") as f:
            rows = [line.split() for line in f if line.startswith("cpu") and line[3].isdigit()]
        # user nice system idle iowait irq softirq steal: busy is all but idle and iowait
        return sum(sum(map(int, row[1:9])) - int(row[4]) - int(row[5]) for row in rows if int(row[0][3:]) in cores)
    except (OSError, ValueError, IndexError):
        return None


@contextlib.contextmanager
def other_load():
    """Measures how many of this process's cores other processes kept busy, on average, while the block
    ran: `with other_load() as load: ...; load.cores` (None where the kernel does not say)."""
    cores = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else set(range(os.cpu_count() or 1))
    load = types.SimpleNamespace(cores=None)
    ticks, own, start = busy_ticks(cores), os.times(), time.perf_counter()
    yield load
    ticks_after, own_after, wall = busy_ticks(cores), os.times(), time.perf_counter() - start
    if ticks is not None and ticks_after is not None and wall > 0:
        busy = (ticks_after - ticks) / os.sysconf("SC_CLK_TCK")
        mine = own_after.user + own_after.system - own.user - own.system
        load.cores = max(busy - mine, 0.0) / wall


def switched_on() -> bool:
    return env_switch(ENV_SWITCH)


@functools.cache
def _processor() -> str:
    processor = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), processor)
    except OSError:
        return processor


def machine() -> str:
    """What pass costs depend on besides the model: processor, usable cores, backend and device, versions."""
    device, processor = jax.devices()[0], _processor()
    return (f"{processor}, {usable_cores()} cores; {device.platform} {device.device_kind} x{jax.device_count()}; "
            f"jax {jax.__version__}, jaxlib {jaxlib.__version__}; few-row kernel {'on' if ffi.switched_on() else 'off'}")


# What the measured passes are, as a number: raise it with a change that alters what a pass costs
# (the loop, a pass's program), so that calibrations made before it are measured again. The key
# names what costs depend on: the machine, the model's shapes and dtype, the kernel build, and this.
PASSES_VERSION = 2


@functools.cache
def release() -> str:
    """The installed s3d-jax's version: a release may measure passes that cost otherwise."""
    try:
        return importlib.metadata.version("s3d-jax")
    except importlib.metadata.PackageNotFoundError:  # a source tree on sys.path, not installed
        return "source"


def cache_file(model: Model, rows: int = 1):
    c = model.config
    drafter = {"skip": c.draft_skip, "gamma": c.draft_gamma, "lora_rank": c.draft_lora_rank, "draft_vocab": c.draft_vocab_size}
    fields = {"machine": machine(), "model": c.replace(draft_skip=None, draft_gamma=None, draft_lora_rank=0, draft_vocab_size=0,
                                                      draft_tree=0).to_json(),
              "drafter": drafter, "sizes": TREE_SIZES, "context": CONTEXT,
              "kernel": build.build_id() if ffi.switched_on() else None, "passes": PASSES_VERSION, "release": release()}
    mesh = sharding.mesh_shape(model.params)
    if mesh:  # a model split over devices has costs of its own
        fields["mesh"] = mesh
    if rows != 1:  # and so does a batch (a server's occupancy)
        fields["rows"] = rows
    key = json.dumps(fields, sort_keys=True, default=str)
    return cache_root() / "calibration" / f"{hashlib.sha256(key.encode()).hexdigest()[:20]}.json"


def calibrate(model: Model, force: bool = True, quiet: bool = False, rows: int = 1) -> PassCosts:
    """The model's pass costs on this machine, each pass over a batch of `rows` rows: measured now
    (`force`, the default), or read from the cache when an earlier calibration of the same machine,
    model and batch left them there."""
    if not isinstance(model, Model):
        raise TypeError(f"calibrate needs a Model from s3d_jax.load, got {type(model).__name__}")
    path = cache_file(model, rows)
    known = None if force else _read(path)
    return known if _still_good(known, path) else _measure(model, path, known, quiet, rows)


def _still_good(known: PassCosts | None, path) -> bool:
    """Whether cached costs stand: costs measured on a busy machine are measured again by the next
    `S3D_JAX_CALIBRATE_TRIES` processes that need them."""
    tries = env_setting(ENV_TRIES, BUSY_TRIES, 1)
    return known is not None and not (known.busy and known.tries < tries and path not in measured_here)


def _measure(model: Model, path, known: PassCosts | None, quiet: bool, rows: int) -> PassCosts:
    """Times the passes, writes them to `path` and returns them; `known` is what the file held."""
    c = model.config
    if c.draft_skip is None or c.mask_token_id is None:
        raise ValueError("calibration times S3D's draft pass: the model needs a mask row and a drafter (s3d_jax.load(..., drafter=...))")
    tries = env_setting(ENV_TRIES, BUSY_TRIES, 1)
    if not quiet:
        batch = f", batches of {rows}" if rows != 1 else ""
        print(f"s3d_jax: calibrating pass costs for this machine and model{batch} (once; S3D_JAX_CALIBRATE=0 skips) ...", file=sys.stderr)
    start = time.perf_counter()
    gamma = c.draft_gamma or DEFAULT_GAMMA
    with other_load() as load:
        rounds = time_passes(model, gamma, rows)
    fastest = {name: min(ms) for name, ms in rounds.items()}
    steps = rounds["step"]
    # On an accelerator the passes run on the device, and the host's other work (its driver's
    # threads included) does not slow them: only the spread of the steps says it was shared.
    on_host = load.cores is not None and jax.default_backend() == "cpu"
    busy = load.cores > BUSY_CORES if on_host else max(steps) > BUSY_RATIO * min(steps)
    costs = PassCosts(step=fastest["step"], verify=fastest["verify"], draft=fastest["draft"],
                      trees={n: fastest[n] for n in TREE_SIZES}, gamma=gamma, seconds=time.perf_counter() - start, machine=machine(),
                      busy=busy, tries=known.tries + 1 if known is not None and known.busy and busy else 1)
    if busy and not quiet:
        what = f"other processes kept {load.cores:.1f} of its cores busy" if on_host else \
            f"a plain step took {min(steps):.1f} to {max(steps):.1f} ms"
        if costs.tries < tries:
            then = f"the next {tries - costs.tries} processes to need them measure again (or run s3d_jax.calibrate(model) when it is quiet)"
        else:
            then = f"{costs.tries} calibrations in a row found it so, and these costs stay until s3d_jax.calibrate(model) runs"
        print(f"s3d_jax: warning: the machine looks busy ({what}), so these costs may be off; {then}", file=sys.stderr)
    measured_here.add(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_text(json.dumps(dataclasses.asdict(costs), indent=1))
    os.replace(tmp, path)
    _costs_read.pop(path, None)
    if not quiet:
        print(f"s3d_jax: calibrated in {costs.seconds:.0f} s: {costs.summary()}", file=sys.stderr)
    return costs


measured_here: set = set()  # cost files this process measured: a busy one is measured again by the next process, not by this one
_costs_read: dict = {}  # cost file -> ((mtime, size), costs): decode parses the file again only when it changed


def _read(path) -> PassCosts | None:
    """The costs a cost file holds; None where it is missing or damaged (then they are measured again)."""
    try:
        stat = path.stat()
        version = (stat.st_mtime_ns, stat.st_size)
        if path in _costs_read and _costs_read[path][0] == version:
            return _costs_read[path][1]
        fields = json.loads(path.read_text())
        costs = PassCosts(**{**fields, "trees": {int(n): ms for n, ms in fields["trees"].items()}})
    except (OSError, ValueError, TypeError, KeyError):
        return None
    _costs_read[path] = (version, costs)
    return costs


def costs_for(model: Model, rows: int = 1) -> tuple[PassCosts | None, str]:
    """The costs the drafting policy of a batch of `rows` uses, and where they came from: the model's
    own (`model.costs`, at every batch), else this machine's cached ones, else measured now; none with
    `S3D_JAX_CALIBRATE=0`."""
    if model.costs is not None:
        return model.costs, "the model's given costs"
    if not switched_on():
        return None, f"{ENV_SWITCH}=0"
    path = cache_file(model, rows)
    known = _read(path)
    if _still_good(known, path):
        return known, "costs cached for this machine"
    return _measure(model, path, known, False, rows), "costs measured now"


_policies: dict = {}  # id(profile) -> (profile, the costs, the policy they chose): replaying a profile takes tens of ms


def drafting_policy(model: Model, rows: int = 1) -> tuple[Policy | None, str]:
    """The policy that the model's pass costs over `rows` rows (`costs_for`) and its drafter's
    acceptance profile choose, once per process for the same costs and profile, and where the costs
    came from; None, and why, without a profile or costs."""
    if model.profile is None:
        return None, "the drafter has no acceptance profile"
    costs, source = costs_for(model, rows)
    if costs is None:
        return None, source
    known = _policies.get(id(model.profile))
    if known is None or known[0] is not model.profile or known[1] != costs:
        known = _policies[id(model.profile)] = (model.profile, costs, costs.policy(model.profile))
    return known[2], source
