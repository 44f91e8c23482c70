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
import threading
import time

import numpy as np

from s3d_jax import api, planning
from s3d_jax.checkpoint import Model
from s3d_jax.options import DecodeOptions
from s3d_jax.sampling import Sampling
from s3d_jax.serve.lane import Lane, row_buckets
from s3d_jax.serve.request import Delta, Request, add_histograms
from s3d_jax.speculative import Plan


class QueueFull(RuntimeError):
    """The engine's waiting list is full: the client should retry later."""


@dataclasses.dataclass
class Totals:
    """What the engine has done since it started, for /metrics."""

    requests: collections.Counter = dataclasses.field(default_factory=collections.Counter)  # by outcome
    generated_tokens: int = 0
    decode_seconds: float = 0.0
    accept_histogram: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(0, np.int64))  # summed over finished requests' rows


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

    def submit(self, *requests: Request) -> None:
        """Queues the requests together: the engine admits none of them before all are waiting."""
        for request in requests:
            if not request.prompt_ids:
                raise ValueError("empty prompt: give at least one token")
            if request.max_new_tokens < 1 or request.max_new_tokens > self.room(len(request.prompt_ids)):
                raise ValueError(f"prompt of {len(request.prompt_ids)} tokens + max_tokens {request.max_new_tokens} + draft block "
                                 f"{self.block} does not fit the context window of {self.max_len} tokens")
        with self._cond:
            self.check_room(len(requests))
            self.waiting.extend(requests)
            self._cond.notify()

    def check_room(self, count: int = 1) -> None:
        """Raises QueueFull where `count` requests submitted now would be refused."""
        if self._stopping:
            raise QueueFull("the server is shutting down")
        if len(self.waiting) + count > self.max_queue:
            raise QueueFull(f"{len(self.waiting)} requests are waiting, the most this server queues")

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
        self.totals.accept_histogram = add_histograms(self.totals.accept_histogram, histogram)

    def _finish(self, request: Request, delta: Delta, outcome: str) -> None:
        self.totals.requests[outcome] += 1
        request.deliver(delta)
