"""The decode loop: a jitted prefill, then one jitted `jax.lax.while_loop` of speculative iterations.

Both functions are compiled ahead of time per shape bucket, so their compile time is measured apart
from decoding, and a second prompt in the same bucket reuses the executables. The loop state,
cache included, is donated: the cache is updated in place.
"""

from __future__ import annotations

import collections
import dataclasses
import inspect
import time

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from s3d_jax import cpu, gpu, tree
from s3d_jax.cache import KVCache, prompt_forward
from s3d_jax.config import ModelConfig
from s3d_jax.kernel import dispatch, ffi
from s3d_jax.model import head_logits
from s3d_jax.sampling import Sampling, choose
from s3d_jax.speculative import Plan, accept, draft, verify

# The kinds of iteration: a tree's three, in `jax.lax.switch` order (`tree_iteration`); a chain's are all DRAFTED.
DRAFTED, BRANCH_ALONE, PLAIN_STEP = 0, 1, 2


@flax.struct.dataclass
class LoopStats:
    """What the loop counts per row for `DecodeStats`: nothing in an iteration reads it."""

    accept_histogram: jax.Array  # [B, reach+1]: iterations of each row that accepted k = 0..reach drafts
    branch_only: jax.Array  # [B]: iterations of each row that verified the context branch alone, with no draft pass
    plain_steps: jax.Array  # [B]: iterations of each row that were one plain step (no active row wanted a draft)

    @classmethod
    def zeros(cls, batch: int, reach: int) -> LoopStats:
        return cls(jnp.zeros((batch, reach + 1), jnp.int32), jnp.zeros((batch,), jnp.int32), jnp.zeros((batch,), jnp.int32))

    def count(self, active, k, kind) -> LoopStats:
        """After an iteration of `kind` that accepted `k` drafts in each `active` row. A plain step
        verified no draft: it counts apart, not as an iteration that accepted none."""
        plain_step = kind == PLAIN_STEP
        return LoopStats(self.accept_histogram.at[jnp.arange(len(k)), k].add((active & ~plain_step).astype(jnp.int32)),
                         self.branch_only + (active & (kind == BRANCH_ALONE)).astype(jnp.int32),
                         self.plain_steps + (active & plain_step).astype(jnp.int32))


@flax.struct.dataclass
class DraftGate:
    """What a tree's drafting gate reads and learns per row (`wants_draft`)."""

    certainty: jax.Array  # [B] float32: the verifier's top probability where it picked x_n (kept up to date by trees alone)
    # [B, 2]: per row, below and at or above `plan.min_certainty`, the tokens its drafted iterations there
    # emitted beyond their cost in plain steps (`plan.drafted_cost`)
    draft_surplus: jax.Array

    @classmethod
    def start(cls, certainty_B) -> DraftGate:
        return cls(certainty_B, jnp.zeros((len(certainty_B), 2), jnp.float32))

    def certain(self, plan: Plan):
        """[B] int32: 1 where the verifier picked x_n with at least `plan.min_certainty`, else 0."""
        return (self.certainty >= plan.min_certainty).astype(jnp.int32)

    def learn(self, plan: Plan, active, kind, k, certainty) -> DraftGate:
        """After an iteration: each active row's new certainty and, with `plan.drafted_cost`, what a
        drafted iteration emitted beyond its cost, on the side of the gate it drafted from."""
        surplus = self.draft_surplus
        if plan.drafted_cost:
            gain = jnp.where(active & (kind == DRAFTED), (k + 1).astype(jnp.float32) - plan.drafted_cost, 0.0)
            surplus = surplus.at[jnp.arange(len(k)), self.certain(plan)].add(gain)
        return DraftGate(jnp.where(active, certainty, self.certainty), surplus)


@flax.struct.dataclass
class DecodeState:
    """The loop's state: what decoding needs, the drafting gate's learning and the statistics apart."""

    tokens: jax.Array  # [B, L] the prompt, then generated tokens; x_n = tokens[b, cache.lengths[b]]
    cache: KVCache  # full-model keys/values of positions [0, n)
    prompt_lengths: jax.Array  # [B]
    num_generated: jax.Array  # [B]
    done: jax.Array  # [B] bool
    max_new_tokens: jax.Array  # [B]
    eos_ids: jax.Array  # [EOS_SLOTS x n]: the EOS ids, then -1 (`eos_array`)
    rng: jax.Array
    iteration: jax.Array  # [] iterations run so far
    stats: LoopStats
    gate: DraftGate

    SHARED = ("eos_ids", "rng", "iteration")  # the rows share these; every other field is one entry per row

    @classmethod
    def row_fields(cls) -> tuple[str, ...]:
        """The fields that hold one entry per row (the cache's along its second axis): a serving slot's."""
        return tuple(f.name for f in dataclasses.fields(cls) if f.name not in cls.SHARED)


EOS_SLOTS = 4  # the EOS ids' array is padded to a multiple of this with -1 (no token), so EOS sets share a compile


def eos_array(eos_ids: tuple[int, ...]) -> jax.Array:
    width = -(-max(len(eos_ids), 1) // EOS_SLOTS) * EOS_SLOTS
    return jnp.asarray([*eos_ids, *[-1] * (width - len(eos_ids))], jnp.int32)


def _is_eos(tokens, eos_ids):
    return jnp.any(tokens[..., None] == eos_ids, axis=-1)


def top_probability(logits_BV):
    """The verifier's probability of its most likely token (at temperature 1): how predictable the text is there."""
    logits_BV = logits_BV.astype(jnp.float32)
    return jnp.exp(jnp.max(logits_BV, axis=-1) - jax.nn.logsumexp(logits_BV, axis=-1))


def prefill(params, prompts_BP, prompt_lengths_B, max_new_tokens_B, eos_ids, rng, *, config: ModelConfig, sampling: Sampling,
            reach: int, max_len: int, few_row_kernel: bool = True):
    """Runs the padded prompts through the full model and picks each row's first new token. Only the
    sampling and the plan's reach (the acceptance histogram's width) shape it, so one prefill serves
    every γ, tree size and method of equal reach."""
    B, P = prompts_BP.shape
    with ffi.switch(few_row_kernel):
        hidden, cache = prompt_forward(params, config, prompts_BP, max_len)
        last_hidden = jnp.take_along_axis(hidden, (prompt_lengths_B - 1)[:, None, None], axis=1)
        first_logits = head_logits(params, config, last_hidden)[:, 0]
    rng, first_rng = jax.random.split(rng)
    first = choose(first_rng, first_logits, sampling)
    tokens = jnp.zeros((B, max_len), jnp.int32).at[:, :P].set(prompts_BP)
    tokens = tokens.at[jnp.arange(B), prompt_lengths_B].set(first)
    return DecodeState(
        tokens=tokens,
        cache=cache.replace(lengths=prompt_lengths_B),
        prompt_lengths=prompt_lengths_B,
        num_generated=jnp.ones((B,), jnp.int32),
        done=_is_eos(first, eos_ids) | (max_new_tokens_B <= 1),
        max_new_tokens=max_new_tokens_B,
        gate=DraftGate.start(top_probability(first_logits)),
        stats=LoopStats.zeros(B, reach),
        eos_ids=eos_ids,
        rng=rng,
        iteration=jnp.zeros((), jnp.int32),
    )


def wants_draft(plan: Plan, state: DecodeState):
    """[B] bool: whether each row's next iteration should be drafted. With a fixed gate, where x_n was
    certain enough. With `plan.drafted_cost`, where the row's drafts at this side of the gate have not
    fallen short, in all, by more than one drafted iteration's cost: its drafted iterations there
    emitted about as many tokens as plain steps would have in their time. How far drafting pays
    differs more between texts (code against news) than any one gate's replay can see; the slack of
    one iteration keeps a side drafting past a first unlucky draft, which on cheap drafts would cost
    more than it saves (docs/experiments.md, "Drafting learned per decode")."""
    side = state.gate.certain(plan)
    if not plan.drafted_cost:
        return side == 1
    return jnp.take_along_axis(state.gate.draft_surplus, side[:, None], axis=1)[:, 0] + plan.drafted_cost >= 0


def tree_iteration(params, config: ModelConfig, plan: Plan, state: DecodeState, x_n_B, draft_rng, accept_rng):
    """One iteration over a token tree: `(k, emitted, certainty, cache, kind)`, of one of three kinds.
      BRANCH_ALONE  with the context branch (`plan.lookup`), when every active row's context supplies
                    all γ of its tokens after a match of two tokens or more (`tree.branch_suffices`), the
                    branch is verified alone, with no draft pass. It runs on through the tree's N+γ
                    slots (`plan.reach`), so that a long copy can accept more than γ tokens in one pass.
      PLAIN_STEP    otherwise, when no active row wants a draft (`wants_draft`: its verifier picked x_n
                    with a probability below `plan.min_certainty`, or its drafts there have not paid),
                    x_n alone is verified: one plain step, no draft pass. Where the text is that
                    unpredictable a drafted tree accepts too little to pay for its passes
                    (docs/experiments.md, "Drafting only where the text is predictable").
      DRAFTED       otherwise the S3D draft pass builds a tree, which is verified without the branch: on
                    a CPU every row of a verify pass costs time (docs/experiments.md, "A drafted tree verified alone").

    Every kind only reads the cache and returns its keys and values already in the accepted path's
    order (`tree.along_path`), one shape for every kind: the `lax.switch` between them never holds a
    cache it must copy, and one write after it leaves the cache contiguous."""
    G, reach = plan.gamma, plan.reach

    def verify_tree(nodes):
        logits, block_kvs = tree.verify_block(params, config, state.cache, nodes, reach)
        k, emitted, path = tree.accept(accept_rng, nodes, logits, reach, plan.sampling)
        deepest = jnp.where(k > 0, jnp.take_along_axis(path, jnp.maximum(k - 1, 0)[:, None], axis=1)[:, 0], 0)
        certainty = top_probability(jnp.take_along_axis(logits, deepest[:, None, None], axis=1)[:, 0])  # where it picked the new x_n
        return k, emitted, certainty, tree.along_path(block_kvs, path)

    def drafted():
        _, draft_logits, _ = draft(params, config, plan, state.cache, x_n_B, draft_rng, state.tokens)
        return verify_tree(tree.build(x_n_B, draft_logits, plan.tree))

    passes = {DRAFTED: drafted}
    kind = jnp.asarray(DRAFTED)
    if plan.lookup:
        branch, known, matched = tree.context_branch(state.tokens, state.cache.lengths, reach)
        passes[BRANCH_ALONE] = lambda: verify_tree(tree.graft(tree.root(x_n_B), branch, known))
        kind = jnp.where(tree.branch_suffices(known[:, :G], matched, state.done), BRANCH_ALONE, kind)
    if plan.min_certainty > 0 or plan.drafted_cost:
        passes[PLAIN_STEP] = lambda: verify_tree(tree.root(x_n_B))
        unpredictable = jnp.all(~wants_draft(plan, state) | state.done)  # no active row worth a draft
        kind = jnp.where((kind == DRAFTED) & unpredictable, PLAIN_STEP, kind)
    kinds = sorted(passes)
    k, emitted, certainty, path_kv = jax.lax.switch(jnp.searchsorted(jnp.asarray(kinds), kind), [passes[c] for c in kinds])
    return k, emitted, certainty, state.cache.write(config.all_layers, path_kv), kind


def iterate(params, config: ModelConfig, plan: Plan, state: DecodeState) -> DecodeState:
    """One draft-verify-accept iteration for every row; finished rows are left unchanged."""
    reach = plan.reach
    n = state.cache.lengths
    x_n = jnp.take_along_axis(state.tokens, n[:, None], axis=1)[:, 0]
    rng, draft_rng, accept_rng = jax.random.split(state.rng, 3)
    if plan.tree:
        k, emitted, certainty, cache, kind = tree_iteration(params, config, plan, state, x_n, draft_rng, accept_rng)
    else:
        drafts, draft_logits, cache = draft(params, config, plan, state.cache, x_n, draft_rng, state.tokens)
        target_logits, cache = verify(params, config, cache, x_n, drafts)
        k, emitted = accept(accept_rng, drafts, draft_logits, target_logits, plan.sampling)
        certainty = state.gate.certainty  # only a tree's `min_certainty` reads it: plain decoding spends nothing on it
        kind = jnp.asarray(DRAFTED)

    # Keep the emitted tokens up to and including the first EOS, within max_new_tokens.
    j = jnp.arange(reach + 1)[None, :]
    eos_at = jnp.where(_is_eos(emitted, state.eos_ids) & (j <= k[:, None]), j, reach + 1)
    first_eos = jnp.min(eos_at, axis=1)
    room = state.max_new_tokens - state.num_generated
    count = jnp.where(state.done, 0, jnp.minimum(jnp.minimum(k + 1, first_eos + 1), room))

    write_at = n + 1
    old = jax.vmap(lambda row, at: jax.lax.dynamic_slice_in_dim(row, at, reach + 1))(state.tokens, write_at)
    new = jnp.where(j < count[:, None], emitted, old)
    tokens = jax.vmap(lambda row, block, at: jax.lax.dynamic_update_slice_in_dim(row, block, at, 0))(
        state.tokens, new, write_at
    )
    num_generated = state.num_generated + count
    active = ~state.done
    return state.replace(
        tokens=tokens,
        cache=cache.replace(lengths=n + count),
        num_generated=num_generated,
        done=state.done | (first_eos < count) | (num_generated >= state.max_new_tokens),
        rng=rng,
        iteration=state.iteration + 1,
        gate=state.gate.learn(plan, active, kind, k, certainty),
        stats=state.stats.count(active, k, kind),
    )


def advance(params, state: DecodeState, stop_iteration, *, config: ModelConfig, plan: Plan, few_row_kernel: bool = True) -> DecodeState:
    """Iterates until every row is done or `stop_iteration` iterations have run in total."""
    with ffi.switch(few_row_kernel):
        return jax.lax.while_loop(
            lambda s: ~jnp.all(s.done) & (s.iteration < stop_iteration),
            lambda s: iterate(params, config, plan, s),
            state,
        )


# `few_row_kernel` is static so that jit's own caches, like `compiled`'s, key on the kernel's switch.
prefill_jit = jax.jit(prefill, static_argnames=("config", "sampling", "reach", "max_len", "few_row_kernel"))
advance_jit = jax.jit(advance, static_argnames=("config", "plan", "few_row_kernel"), donate_argnames="state")


# Executables compiled ahead of time, most recently used last. Bounded: a long-lived process that
# decodes many shapes keeps the newest few; a `Run` holds its own two for as long as it lives.
# JAX keeps its own reference to each one (its lowering and compilation caches), so an eviction also
# clears those: on the CPU a decode loop's code lies in about a thousand memory mappings, and Linux
# stops a process at 65,530 (vm.max_map_count), which XLA's compiler meets as a crash after some 60
# loops (docs/cpu.md, "Memory mappings").
MAX_EXECUTABLES = 32
_cached: collections.OrderedDict = collections.OrderedDict()
_compiles = 0


def placement(x):
    """Where an array lies (its sharding), or None for a value not yet on a device."""
    return getattr(x, "sharding", None)


def sharded(args) -> bool:
    """Whether any array of `args` is split or copied over several devices (a model loaded with a mesh)."""
    return any(p is not None and len(p.device_set) > 1 for p in map(placement, jax.tree.leaves(args)))


def kernel_applies(args) -> bool:
    """The few-row kernel is one device's custom call, which XLA's partitioner cannot split: a sharded
    model's passes use XLA's dot."""
    return ffi.switched_on() and not sharded(args)


def few_row_batch(rows: int) -> bool:
    """Whether a decode loop over `rows` sequences compiles with the few-row CPU options (`Run.few_row_passes`)."""
    return rows * 2 <= dispatch.MAX_ROWS


def compile_ahead(fn, *args, few_row_passes: bool = False, **statics):
    """`fn` (jitted; a model's passes take a static `few_row_kernel`) lowered and compiled for the shapes
    and placements of `args` (arrays or ShapeDtypeStructs); returns (executable, seconds). Every
    executable of decoding, calibration and serving is compiled here, so the few-row kernel's switch,
    the CPU options of passes of a few rows per sequence (`few_row_passes`: the loop and the pass
    timings), a GPU's CUDA graphs (`gpu`) and the heap trim apply alike to each."""
    global _compiles
    ffi.prepare()
    start = time.perf_counter()
    options = dict(cpu.few_row_compiler_options() or {}) if few_row_passes else {}
    options |= gpu.loop_compiler_options()
    if "few_row_kernel" in inspect.signature(fn).parameters:
        statics = {**statics, "few_row_kernel": kernel_applies(args)}
    executable = fn.lower(*args, **statics).compile(options or None)
    seconds = time.perf_counter() - start
    _compiles += 1
    cpu.release_freed_memory()
    return executable, seconds


def compiled(fn, *args, few_row_passes: bool = False, held: dict | None = None, **statics):
    """`compile_ahead`, cached on the shapes and placements of `args`, the statics and the kernel's
    switch. `held`, a caller's own dict, also keeps each executable for as long as the caller lives,
    past this cache's bound: a server compiles everything it can need at start-up (`serve.engine`)."""
    leaves, treedef = jax.tree.flatten(args)
    shapes = tuple((tuple(x.shape), x.dtype, placement(x)) for x in leaves)
    key = (fn, tuple(sorted(statics.items())), treedef, shapes, few_row_passes, ffi.switched_on(), gpu.applies())
    if held is not None and key in held:
        return held[key], 0.0
    if key in _cached:
        _cached.move_to_end(key)
        seconds = 0.0
    else:
        _cached[key], seconds = compile_ahead(fn, *args, few_row_passes=few_row_passes, **statics)
    executable = _cached[key]
    while len(_cached) > MAX_EXECUTABLES:
        _cached.popitem(last=False)
        jax.clear_caches()  # what is still in use lives on through its holders (here, `Run`s and a server's `held`)
    if held is not None:
        held[key] = executable
    return executable, seconds


def forget_compiled() -> None:
    """Drops every cached executable (a `Run` keeps its own): a long test run frees their memory mappings."""
    _cached.clear()


def compile_count() -> int:
    """How many executables the decode engine has compiled so far (for compile-once checks)."""
    return _compiles


@dataclasses.dataclass
class Run:
    """A prepared decode: static plan, padded prompts and sizes. Its two executables are compiled on
    first use (or by `compile`, to keep compile time off a clock)."""

    params: object
    config: ModelConfig
    plan: Plan
    prompts: np.ndarray  # [B, P_bucket]
    prompt_lengths: np.ndarray  # [B]
    max_new_tokens: int
    eos_ids: tuple[int, ...]
    seed: int
    max_len: int
    compile_seconds: float = 0.0
    policy: str = ""  # what chose the open fields of greedy S3D's plan, and why (`planning.drafting_policy`)
    held: dict | None = dataclasses.field(default=None, repr=False)  # the caller's own store of executables (`compiled`)
    executables: tuple | None = dataclasses.field(default=None, repr=False)  # (prefill, loop), once compiled

    @property
    def few_row_passes(self) -> bool:
        """Whether the loop's passes are products of a few rows, which the decode loop's CPU options
        suit; a large batch's are not (docs/cpu.md). Decided by the batch alone, as a plain step's two
        tokens a row, so that a plain and a speculative loop of one batch compile alike: options that
        order XLA's sums differently would part their results in the last bit."""
        return few_row_batch(len(self.prompts))

    def _prefill_args(self):
        return (
            self.params,
            jnp.asarray(self.prompts, jnp.int32),
            jnp.asarray(self.prompt_lengths, jnp.int32),
            jnp.full((len(self.prompts),), self.max_new_tokens, jnp.int32),
            eos_array(self.eos_ids),
            jax.random.key(self.seed),
        )

    def _prefill_executable(self):
        return compiled(prefill_jit, *self._prefill_args(), held=self.held, config=self.config, sampling=self.plan.sampling,
                        reach=self.plan.reach, max_len=self.max_len)

    def prefill(self) -> DecodeState:
        """The prefill alone, for a caller that runs the rows in a loop of its own (`serve.engine`)."""
        return self._prefill_executable()[0](*self._prefill_args())

    def compile(self) -> None:
        if self.executables is not None:
            return
        statics = dict(config=self.config, plan=self.plan)
        prefill_exe, prefill_seconds = self._prefill_executable()
        # The loop state's shapes, read off the executable rather than traced a second time.
        state = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=placement(x)), prefill_exe.out_info)
        stop = jax.ShapeDtypeStruct((), jnp.int32)
        advance_exe, advance_seconds = compiled(advance_jit, self.params, state, stop, few_row_passes=self.few_row_passes,
                                                held=self.held, **statics)
        self.executables = (prefill_exe, advance_exe)
        self.compile_seconds = prefill_seconds + advance_seconds

    def start(self) -> DecodeState:
        self.compile()
        return self.executables[0](*self._prefill_args())

    def loop_hlo(self) -> str:
        """The compiled loop's HLO text: a profile's operations by the model code that made them (`tools/decode_ab.py --profile`)."""
        self.compile()
        return self.executables[1].as_text()

    def advance(self, state: DecodeState, stop_iteration: int) -> DecodeState:
        self.compile()
        return self.executables[1](self.params, state, jnp.asarray(stop_iteration, jnp.int32))
