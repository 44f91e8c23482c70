"""A lane: the rows of one compiled decode loop, sized to its busy requests, and the moves between sizes.

Each move is a jitted function of the donated loop state (insert a prefilled row, free one, fit the
cache to a size, gather the busy rows into a smaller or larger batch). None changes a row's tokens.
"""

from __future__ import annotations

import collections
import itertools

import jax
import jax.numpy as jnp
import numpy as np

from s3d_jax import decoding, sharding
from s3d_jax.checkpoint import Model
from s3d_jax.options import bucket
from s3d_jax.serve.request import Request
from s3d_jax.speculative import Plan


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
