"""Continuous batching: one decode loop over the busy requests' rows, shared by many requests.

A lane is one compiled loop (`decoding.advance`) over up to `slots` rows of one sampling setting. An
empty slot is a finished row, which every iteration leaves unchanged. Between chunks of iterations the
engine's thread reads back each row's tokens, hands new text to its request, frees the rows of
finished or abandoned requests, and prefills waiting requests into free rows: a prompt runs alone
through the full model (compiled once per prompt-length bucket) and its row is written into the
lane's state in place. The lane's batch is sized to its busy requests and its cache to their lengths
(`Lane`); every size of loop, insertion, move and resize is compiled at start-up, so nothing compiles
while requests run.

A row's tokens do not depend on its neighbours: every kind of iteration the batch takes is exact, so a
greedy request decodes to what it would alone. Sampling settings are static in the compiled loop, so
requests that sample differently run in different lanes (at most `max_lanes` at a time).
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import itertools
import threading
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from s3d_jax import api, decoding, planning, sharding
from s3d_jax.checkpoint import Model
from s3d_jax.options import DecodeOptions, bucket
from s3d_jax.sampling import Sampling
from s3d_jax.speculative import Plan


class QueueFull(RuntimeError):
    """The engine's waiting list is full: the client should retry later."""


@dataclasses.dataclass
class Delta:
    """What a request gets after each chunk: its new text and tokens, and at the end why it finished."""

    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop" (EOS or a stop string), "length", "error"
    prompt_tokens: int = 0
    completion_tokens: int = 0
    error: str | None = None
    drafted_iterations: int = 0  # at the end: the request's loop iterations that verified drafts, and those that took a plain step
    plain_iterations: int = 0


@dataclasses.dataclass
class Request:
    """One completion. `deliver` is called from the engine's thread with each Delta, the last one finished."""

    prompt_ids: list[int]
    max_new_tokens: int
    deliver: Callable[[Delta], None]
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0
    stop: tuple[str, ...] = ()
    cancelled: threading.Event = dataclasses.field(default_factory=threading.Event)
    # The engine's bookkeeping.
    tokens: list[int] = dataclasses.field(default_factory=list)  # generated so far
    sent_text: str = ""
    # Its loop counts from the batches it left (`Lane.regroup`): iterations by drafts accepted, and plain steps.
    accepted: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(0, np.int64))
    plain_steps: int = 0

    def bank(self, accepted: np.ndarray, plain_steps: int) -> None:
        """Adds loop counts of this request's row to those it holds."""
        self.accepted = add_histograms(self.accepted, accepted)
        self.plain_steps += int(plain_steps)

    @property
    def sampling(self) -> Sampling:
        return Sampling(self.temperature, 0, self.top_p if self.temperature else 1.0)


def add_histograms(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Two acceptance histograms (iterations by drafts accepted) of plans of any reach, summed."""
    width = max(len(a), len(b))
    return np.pad(a, (0, width - len(a))).astype(np.int64) + np.pad(b, (0, width - len(b)))


def _resized(state: decoding.DecodeState, max_len: int) -> decoding.DecodeState:
    """`state` with room for `max_len` positions: its tokens and cache cut or padded along the position
    axis. Positions past a row's length are stale and masked, so neither changes what a row decodes."""
    def fit(x, axis):
        if x.shape[axis] >= max_len:
            return jax.lax.slice_in_dim(x, 0, max_len, axis=axis)
        return jnp.pad(x, [(0, max_len - x.shape[axis]) if a == axis else (0, 0) for a in range(x.ndim)])

    cache = state.cache.replace(keys=fit(state.cache.keys, 3), values=fit(state.cache.values, 4))
    return state.replace(tokens=fit(state.tokens, 1), cache=cache)


def _insert(state: decoding.DecodeState, row: decoding.DecodeState, slot, reseed: bool) -> decoding.DecodeState:
    """`state` with slot `slot` replaced by the one-row state `row` (prefilled, then fitted to the
    state's cache with `_resized`); `reseed` takes the row's random key (a lane with no other request),
    so that a seeded request alone is reproducible."""
    def put(full, one, axis=0):
        return jax.lax.dynamic_update_slice_in_dim(full, one.astype(full.dtype), slot, axis=axis)

    rows = {f: jax.tree.map(put, getattr(state, f), getattr(row, f)) for f in decoding.DecodeState.row_fields() if f != "cache"}
    full, one = state.cache, row.cache  # the layer stacks' rows are their second axis
    rows["cache"] = full.replace(keys=put(full.keys, one.keys, 1), values=put(full.values, one.values, 1),
                                 lengths=put(full.lengths, one.lengths))
    return state.replace(rng=jax.lax.cond(reseed, lambda: row.rng, lambda: state.rng), **rows)


def _free(state: decoding.DecodeState, slot) -> decoding.DecodeState:
    return state.replace(done=state.done.at[slot].set(True))


def _regroup(state: decoding.DecodeState, picks, live, reach: int) -> decoding.DecodeState:
    """The rows `picks` of `state`, in that order, as a state of `len(picks)` rows: one gather per field.
    A row where `live` is False is a copy marked finished, an empty slot that no iteration changes. The
    loop counts start again, for a plan that verifies up to `reach` drafts (the caller banked them)."""
    rows = {f: jax.tree.map(lambda x: jnp.take(x, picks, axis=0), getattr(state, f))
            for f in decoding.DecodeState.row_fields() if f not in ("cache", "stats")}
    rows["done"] = rows["done"] | ~live
    rows["stats"] = decoding.LoopStats.zeros(len(picks), reach)
    cache = state.cache  # the layer stacks' rows are their second axis
    rows["cache"] = cache.replace(keys=jnp.take(cache.keys, picks, axis=1), values=jnp.take(cache.values, picks, axis=1),
                                  lengths=jnp.take(cache.lengths, picks))
    return state.replace(**rows)


_insert_jit = jax.jit(_insert, donate_argnames="state")
_free_jit = jax.jit(_free, donate_argnames="state")
_resized_jit = jax.jit(_resized, static_argnames="max_len")  # not donated: the result has another shape
_regroup_jit = jax.jit(_regroup, static_argnames="reach")  # nor this one


def row_buckets(slots: int) -> tuple[int, ...]:
    """The batch sizes a lane's loop runs at: powers of two below `slots`, then `slots`."""
    return (*(1 << n for n in range(max(slots - 1, 0).bit_length()) if 1 << n < slots), slots)

# The smallest cache a lane runs with. Each size is one more compiled loop; below this a step's
# attention costs little next to its weights.
MIN_CAPACITY = 256
# Chunks in a row whose busy requests fit a smaller batch before the lane moves to it: a lane grows at
# once (a request needs the row) and shrinks late, so that occupancy at a threshold switches rarely.
SHRINK_AFTER = 4


class Lane:
    """Up to `slots` rows of one plan in one donated loop state, and the request in each row.

    Idle rows cost nothing: the loop runs at the smallest batch of `row_buckets(slots)` that holds its
    busy requests. A request that finds every row busy grows the batch to the next size, and when
    requests leave, the others move to the first rows of a smaller one (`_regroup`, one gather; no
    row's tokens change). And since the loop's attention reads every position of the cache it runs
    with, a lane runs with the smallest cache (a power of two from MIN_CAPACITY up to `max_len`) that
    holds every request it serves, prompt, reply and draft block: it grows when a longer request comes
    in and shrinks when the longest leaves. Each batch size and cache size compiles its loop once."""

    def __init__(self, model: Model, plans: dict[int, Plan], slots: int, max_len: int, eos_ids: tuple[int, ...], held: dict,
                 policies: dict[int, str] | None = None):
        self.model, self.slots, self.max_len, self.eos_ids = model, slots, max_len, eos_ids
        self.plans = plans  # the plan each batch size of `row_buckets(slots)` runs (a drafting policy per occupancy)
        self.policies = policies or {}  # and what chose it
        self.block = max(plan.block for plan in plans.values())
        self.held = held  # the engine's executables: `warm` compiles every one a request can need, so that none compiles on its way
        self.requests: list[Request | None] = [None]  # one per row of the loop state
        self.capacity = self.capacity_for(0)
        self.run = self._loop_run(1, self.capacity)
        self.state = self.run.start()
        self.iteration = 0
        self.roomy_chunks = 0  # chunks in a row whose busy requests fit a smaller batch

    @property
    def plan(self) -> Plan:
        return self.plans[len(self.requests)]

    def _run(self, plan: Plan, prompts, max_new_tokens: int, seed: int, max_len: int) -> decoding.Run:
        padded = np.zeros((len(prompts), min(bucket(prompts.shape[1] + 1), max_len)), np.int32)  # and the first token
        padded[:, : prompts.shape[1]] = prompts
        return decoding.Run(self.model.params, self.model.config, plan, padded, np.full(len(prompts), prompts.shape[1]),
                            max_new_tokens, self.eos_ids, seed, max_len, held=self.held)

    def _loop_run(self, rows: int, capacity: int) -> decoding.Run:
        """The loop over `rows` rows with a cache of `capacity`; its start is `rows` empty slots: one-token
        prompts with room for none, finished from the start."""
        return self._run(self.plans[rows], np.zeros((rows, 1), np.int64), max_new_tokens=0, seed=0, max_len=capacity)

    def _executable(self, fn, *args, **statics):
        """`fn` compiled for the shapes and placements of `args` (arrays or ShapeDtypeStructs), as decoding compiles."""
        structs = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=decoding.placement(x)), args)
        return decoding.compiled(fn, *structs, held=self.held, **statics)[0]

    def capacity_for(self, positions: int) -> int:
        return min(self.max_len, max(MIN_CAPACITY, bucket(positions)))

    def positions(self, request: Request) -> int:
        """The cache positions a request may reach: its prompt, its reply and one draft block past it."""
        return len(request.prompt_ids) + request.max_new_tokens + self.block

    def rows_for(self, requests: int) -> int:
        return next(rows for rows in row_buckets(self.slots) if rows >= requests)

    def resize(self, capacity: int) -> None:
        if capacity != self.capacity:
            self.state = self._executable(_resized_jit, self.state, max_len=capacity)(self.state)
            self.run = self._loop_run(len(self.requests), capacity)
            self.capacity = capacity

    def regroup(self, rows: int) -> None:
        """Moves the busy requests, in order, to the first rows of a loop state of `rows` rows, which runs
        that batch size's plan; each request banks its loop counts first."""
        if rows == len(self.requests):
            return
        busy = self.active
        counts = self._counts(*sharding.to_host((self.state.stats.accept_histogram, self.state.stats.plain_steps)))
        for i in busy:
            self.requests[i].bank(*counts[i])
        picks = np.asarray([*busy, *[0] * (rows - len(busy))], np.int32)
        live = np.arange(rows) < len(busy)
        reach = self.plans[rows].reach
        self.state = self._executable(_regroup_jit, self.state, picks, live, reach=reach)(self.state, picks, live)
        self.requests = [self.requests[i] for i in busy] + [None] * (rows - len(busy))
        self.run = self._loop_run(rows, self.capacity)

    def warm(self) -> None:
        """Compiles now what a request can need, so that none waits for a compile: the prefill of every
        prompt-length bucket and its row's fitting to every cache size, and at every batch size and cache
        size the loop, the insertion of a row, the freeing of a row, and the moves to every other batch
        size and cache size."""
        rows = collections.defaultdict(list)  # by the reach of a plan, which sizes a row's loop counts
        for plan in {plan.reach: plan for plan in self.plans.values()}.values():
            length = 1
            while length < self.max_len:
                executable, _ = self._prefill_run(np.zeros((1, length), np.int64), 1, 0, plan)._prefill_executable()
                rows[plan.reach].append(executable.out_info)
                length = bucket(length) + 1
        capacities = sorted({self.capacity_for(1 << n) for n in range(self.max_len.bit_length() + 1)})
        states = {}
        for batch, capacity in itertools.product(row_buckets(self.slots), capacities):
            run = self._loop_run(batch, capacity)
            run.compile()
            states[batch, capacity] = run._prefill_executable()[0].out_info
        slot = jax.ShapeDtypeStruct((), jnp.int32)
        for (batch, capacity), state in states.items():
            self._executable(_free_jit, state, slot)
            fitted = [self._executable(_resized_jit, row, max_len=capacity).out_info for row in rows[self.plans[batch].reach]]
            self._executable(_insert_jit, state, fitted[0], slot, jax.ShapeDtypeStruct((), jnp.bool_))  # one shape, fitted
            for other_batch, other_capacity in states:
                if other_batch == batch and other_capacity != capacity:
                    self._executable(_resized_jit, state, max_len=other_capacity)
                elif other_capacity == capacity and other_batch != batch:
                    picks = jax.ShapeDtypeStruct((other_batch,), jnp.int32)
                    self._executable(_regroup_jit, state, picks, jax.ShapeDtypeStruct((other_batch,), jnp.bool_),
                                     reach=self.plans[other_batch].reach)

    def _prefill_run(self, prompts, max_new_tokens: int, seed: int, plan: Plan) -> decoding.Run:
        """A prompt's prefill, with a cache just large enough for the prompt and its first token: as wide
        as the padded prompt, so that each bucket compiles one prefill (`insert` fits it to the lane's)."""
        return self._run(plan, prompts, max_new_tokens, seed, max_len=min(bucket(prompts.shape[1] + 1), self.max_len))

    @property
    def active(self) -> list[int]:
        return [i for i, r in enumerate(self.requests) if r is not None]

    def free_slot(self) -> int | None:
        """A free row, for which the batch grows to its next size when every row is busy; None when all
        `slots` are."""
        if all(self.requests) and len(self.requests) < self.slots:
            self.regroup(self.rows_for(len(self.requests) + 1))
        return next((i for i, r in enumerate(self.requests) if r is None), None)

    def prefill(self, request: Request) -> decoding.DecodeState:
        """The request's prompt through the full model, alone: a one-row state with its first token, for
        the batch as it is now (`free_slot` first)."""
        return self._prefill_run(np.asarray([request.prompt_ids]), request.max_new_tokens, request.seed, self.plan).prefill()

    def insert(self, request: Request, row: decoding.DecodeState, slot: int) -> int:
        """Writes the prefilled `row` into `slot`, with the cache grown if the request needs it; returns
        the request's first token."""
        self.resize(max(self.capacity, self.capacity_for(self.positions(request))))
        slot = np.int32(slot)  # a host value, as `warm` compiled for
        reseed = np.bool_(not self.active)
        row = self._executable(_resized_jit, row, max_len=self.capacity)(row)
        self.state = self._executable(_insert_jit, self.state, row, slot, reseed)(self.state, row, slot, reseed)
        self.requests[slot] = request
        return int(row.tokens[0, len(request.prompt_ids)])

    def free(self, slot: int) -> None:
        self.state = self._executable(_free_jit, self.state, np.int32(slot))(self.state, np.int32(slot))
        self.requests[slot] = None

    def advance(self, iterations: int):
        """Runs up to `iterations` iterations, with the cache shrunk to what the requests left need, and
        the batch too once they have fitted a smaller one for `SHRINK_AFTER` chunks in a row (so that
        occupancy at a threshold does not switch plans back and forth). Returns per row (the rows of
        `requests`, which a smaller batch may have moved) the tokens, generated counts, done flags, and
        the loop counts since the row's last bank (`_counts`)."""
        smaller = self.rows_for(len(self.active))
        self.roomy_chunks = self.roomy_chunks + 1 if smaller < len(self.requests) else 0
        if self.roomy_chunks >= SHRINK_AFTER:
            self.regroup(smaller)
            self.roomy_chunks = 0
        self.resize(self.capacity_for(max((self.positions(self.requests[i]) for i in self.active), default=0)))
        self.state = self.run.advance(self.state, self.iteration + iterations)
        stats = self.state.stats
        tokens, generated, done, accepted, plain_steps, iteration = sharding.to_host(
            (self.state.tokens, self.state.num_generated, self.state.done, stats.accept_histogram, stats.plain_steps, self.state.iteration))
        self.iteration = int(iteration)
        return tokens, generated, done, self._counts(accepted, plain_steps)

    def _counts(self, accepted: np.ndarray, plain_steps: np.ndarray) -> list[tuple[np.ndarray, int]]:
        """Each row's loop counts under the plan in force: iterations by drafts accepted, and plain
        steps (which a plain plan's loop counts as iterations that accepted none)."""
        if self.plan.method == "ar":
            return [(np.zeros(0, np.int64), int(a.sum() + p)) for a, p in zip(accepted, plain_steps)]
        return [(a, int(p)) for a, p in zip(accepted, plain_steps)]


@dataclasses.dataclass
class Totals:
    """What the engine has done since it started, for /metrics."""

    requests: collections.Counter = dataclasses.field(default_factory=collections.Counter)  # by outcome
    generated_tokens: int = 0
    decode_seconds: float = 0.0
    accept_histogram: np.ndarray | None = None  # summed over finished requests' rows


class Engine:
    """Requests in, Deltas out, on one background thread.

    `options` are the server's decode defaults (method, γ, tree, ...); a request sets only what the
    protocol lets it (length, temperature, top_p, seed, stop strings)."""

    def __init__(self, model: Model, options: DecodeOptions | None = None, *, slots: int = 4, max_len: int = 2048,
                 max_queue: int = 16, chunk_iterations: int = 4, max_lanes: int = 2):
        if model.tokenizer is None:
            raise ValueError("serving needs the model's tokenizer: its text in, text out")
        self.model, self.options = model, options or DecodeOptions()
        limit = model.config.max_position_embeddings
        if max_len > limit:
            raise ValueError(f"max_len {max_len} exceeds the model's context of {limit} positions")
        self.slots, self.max_len, self.max_queue = slots, max_len, max_queue
        self.chunk_iterations, self.max_lanes = chunk_iterations, max_lanes
        self.eos_ids = api.eos_ids_for(model, self.options)
        self.lanes: dict[Sampling, Lane] = {}
        self.executables: dict = {}  # every lane's, for as long as the engine lives (`decoding.compiled`)
        self.waiting: collections.deque[Request] = collections.deque()
        self.totals = Totals()
        self._cond = threading.Condition()
        self._stopping = False
        self._thread = threading.Thread(target=self._loop, name="s3d_jax-engine", daemon=True)

    # ------------------------------------------------------------ the client side

    @functools.cached_property
    def block(self) -> int:
        """Cache positions a request needs past its prompt and reply: the largest draft block of any lane."""
        return max(self._plan(sampling, rows)[0].block for sampling in (Sampling(), Sampling(1.0)) for rows in row_buckets(self.slots))

    def room(self, prompt_tokens: int) -> int:
        """The most new tokens a prompt of this length leaves room for; < 1: it does not fit."""
        return self.max_len - prompt_tokens - self.block

    def submit(self, request: Request) -> None:
        if not request.prompt_ids:
            raise ValueError("empty prompt: give at least one token")
        if request.max_new_tokens < 1 or request.max_new_tokens > self.room(len(request.prompt_ids)):
            raise ValueError(f"prompt of {len(request.prompt_ids)} tokens + max_tokens {request.max_new_tokens} + draft block "
                             f"{self.block} does not fit the context window of {self.max_len} tokens")
        with self._cond:
            if self._stopping:
                raise QueueFull("the server is shutting down")
            if len(self.waiting) >= self.max_queue:
                raise QueueFull(f"{len(self.waiting)} requests are waiting, the most this server queues")
            self.waiting.append(request)
            self._cond.notify()

    def start(self, warm: bool = True) -> Engine:
        """Compiles the greedy lane (with `warm`, its prefill for every prompt bucket and its loop at every
        cache size too), then starts the thread."""
        lane = self.lane(Sampling())
        if warm:
            lane.warm()
        self._thread.start()
        return self

    def stop(self, drain: bool = True, timeout: float | None = None) -> None:
        """Stops taking requests; with `drain`, finishes those waiting and in flight first."""
        with self._cond:
            self._stopping = True
            if not drain:
                for request in [*self.waiting, *(r for lane in self.lanes.values() for r in lane.requests if r is not None)]:
                    request.cancelled.set()
            self._cond.notify()
        self._thread.join(timeout)

    def occupancy(self) -> tuple[int, int]:
        """(busy slots, all slots) over the lanes."""
        lanes = list(self.lanes.values())
        return sum(len(lane.active) for lane in lanes), self.slots * max(1, len(lanes))

    # ------------------------------------------------------------ the engine's thread

    def _plan(self, sampling: Sampling, rows: int) -> tuple[Plan, str]:
        """The plan a batch of `rows` runs for `sampling`, and what chose it: the calibrated policy of
        that batch size (its pass costs over that many rows) where the server's options leave it open."""
        options = self.options.replace(temperature=sampling.temperature, top_p=sampling.top_p)
        policy, why = planning.drafting_policy(self.model, options, rows)
        return planning.plan_for(self.model.config, options, policy), why

    def lane(self, sampling: Sampling) -> Lane | None:
        """The lane of `sampling`, made if there is room (an idle lane of another setting is dropped); else None."""
        if sampling in self.lanes:
            return self.lanes[sampling]
        if len(self.lanes) >= self.max_lanes:
            idle = next((s for s, lane in self.lanes.items() if not lane.active), None)  # rebuilt from cached executables
            if idle is None:
                return None
            del self.lanes[idle]
        chosen = {rows: self._plan(sampling, rows) for rows in row_buckets(self.slots)}
        self.lanes[sampling] = Lane(self.model, {rows: plan for rows, (plan, _) in chosen.items()}, self.slots, self.max_len,
                                    self.eos_ids, self.executables, policies={rows: why for rows, (_, why) in chosen.items()})
        return self.lanes[sampling]

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._stopping and not self.waiting and not self._busy():
                    self._cond.wait()
                if self._stopping and not self.waiting and not self._busy():
                    return
                waiting = list(self.waiting)
            self._admit(waiting)
            for sampling, lane in list(self.lanes.items()):
                if lane.active:
                    self._step(sampling, lane)

    def _busy(self) -> bool:
        return any(lane.active for lane in self.lanes.values())

    def _admit(self, waiting: list[Request]) -> None:
        """Prefills waiting requests into free slots, oldest first; a request whose lane is full waits."""
        for request in waiting:
            if request.cancelled.is_set():
                self._dequeue(request)
                self._finish(request, Delta("", [], "cancelled"), outcome="cancelled")
                continue
            try:
                lane = self.lane(request.sampling)
                slot = None if lane is None else lane.free_slot()
                if slot is None:
                    continue
                self._dequeue(request)
                row = lane.prefill(request)
            except Exception as e:  # noqa: BLE001 - a failed prefill fails its request, not the server
                if request in self.waiting:
                    self._dequeue(request)
                self._finish(request, Delta("", [], "error", error=f"prefill failed: {type(e).__name__}: {e}"), outcome="error")
                continue
            try:
                first = lane.insert(request, row, slot)
                self._emit(lane, slot, [first], done=first in self.eos_ids or request.max_new_tokens <= 1)
            except Exception as e:  # noqa: BLE001 - the lane's donated state is gone: its requests fail
                self._fail_lane(request.sampling, f"decoding failed: {type(e).__name__}: {e}", also=request)

    def _dequeue(self, request: Request) -> None:
        with self._cond:
            self.waiting.remove(request)

    def _step(self, sampling: Sampling, lane: Lane) -> None:
        start = time.perf_counter()
        try:
            tokens, generated, done, counts = lane.advance(self.chunk_iterations)
            self.totals.decode_seconds += time.perf_counter() - start
            for slot in lane.active:
                request = lane.requests[slot]
                start_at = len(request.prompt_ids)
                new = tokens[slot, start_at + len(request.tokens) : start_at + generated[slot]].tolist()
                if self._emit(lane, slot, new, done=bool(done[slot]), counts=counts[slot]) \
                        and not request.cancelled.is_set():
                    self._count_acceptance(request.accepted)
        except Exception as e:  # noqa: BLE001 - the lane's requests fail; the server goes on, with a fresh lane when one is needed
            self._fail_lane(sampling, f"decoding failed: {type(e).__name__}: {e}")

    def _fail_lane(self, sampling: Sampling, message: str, also: Request | None = None) -> None:
        lane = self.lanes.pop(sampling)
        for request in {id(r): r for r in [*lane.requests, also] if r is not None}.values():
            self._finish(request, Delta("", [], "error", error=message), outcome="error")

    def _emit(self, lane: Lane, slot: int, new_tokens: list[int], done: bool, counts=None) -> bool:
        """Hands a request its new text; frees its slot when it is finished, stopped or abandoned. `counts`
        are its row's loop counts since its last bank (`Lane.advance`)."""
        request = lane.requests[slot]
        if request.cancelled.is_set():
            lane.free(slot)
            self._finish(request, Delta("", [], "cancelled"), outcome="cancelled")
            return True
        request.tokens.extend(new_tokens)
        all_tokens = request.tokens
        text = self.model.tokenizer.decode(all_tokens, skip_special_tokens=True)
        finish = None
        cut = min((i for i in (text.find(s) for s in request.stop) if i >= 0), default=-1)
        if cut >= 0:
            text, finish = text[:cut], "stop"
        elif done:
            finish = "stop" if all_tokens and all_tokens[-1] in self.eos_ids else "length"
        elif text.endswith("\ufffd"):  # a character cut between tokens: wait for the rest
            text = request.sent_text
        else:  # hold back what could be the start of a stop string
            hold = max((len(s) - 1 for s in request.stop), default=0)
            text = text[: max(len(request.sent_text), len(text) - hold)]
        delta = Delta(text[len(request.sent_text):], new_tokens, finish, len(request.prompt_ids), len(all_tokens))
        request.sent_text = text
        self.totals.generated_tokens += len(new_tokens)
        if finish is None:
            request.deliver(delta)
            return False
        if counts is not None:
            request.bank(*counts)
        delta.drafted_iterations, delta.plain_iterations = int(request.accepted.sum()), request.plain_steps
        lane.free(slot)
        self._finish(request, delta, outcome="ok")
        return True

    def _count_acceptance(self, histogram: np.ndarray) -> None:
        totals = self.totals
        totals.accept_histogram = add_histograms(np.zeros(0, np.int64) if totals.accept_histogram is None else totals.accept_histogram,
                                                 histogram)

    def _finish(self, request: Request, delta: Delta, outcome: str) -> None:
        self.totals.requests[outcome] += 1
        request.deliver(delta)
