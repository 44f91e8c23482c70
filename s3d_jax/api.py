"""The public Python API: `load`, `logits`, `decode`, `stream`."""

from __future__ import annotations

import dataclasses
import functools
import numbers
import os
import time

import chex
import jax
import jax.numpy as jnp
import numpy as np

from s3d_jax import bundled, checkpoint, compile_cache, cpu, decoding, planning, sharding
from s3d_jax import drafter as drafter_lib
from s3d_jax.checkpoint import Model
from s3d_jax.config import ACTIVATION_MODES, ConfigError, ModelConfig
from s3d_jax.metrics import acceptance_per_depth, tokens_per_iteration
from s3d_jax.model import full_pass, lm_logits
from s3d_jax.options import DecodeOptions, bucket, check_int, prompt_bucket
from s3d_jax.speedup import NEVER

BUNDLED_DRAFTER = "bundled"


def load(
    path: str | os.PathLike | None = None,
    dtype: str | None = None,
    drafter: str | os.PathLike | None = BUNDLED_DRAFTER,
    draft_vocab_size: int | None = None,
    mesh: jax.sharding.Mesh | str | None = None,
    activations: str = "float32",
) -> Model:
    """Loads a converted model; with no path, the bundled SmolLM2-135M-Instruct (converted on first use).

    `path` is a converted model's directory, or a model's name (`bundled.MODELS`: "smollm2-135m", the
    default, "qwen2.5-coder-0.5b"), converted into the cache on first use.
    `drafter` is a drafter file to apply (see `s3d_jax.drafter`), or None for the bare model. Its default
    applies the drafter shipped for a model loaded by name, and nothing to a model loaded from a path.
    `draft_vocab_size` overrides the drafter's reduced draft head: N most frequent tokens, 0 for all.
    `mesh` (a Mesh with a `model` axis, or text such as "model=4") splits the model over devices,
    tensor-parallel; decoding then runs over them with the same outputs (docs/usage.md, "Several devices").
    `activations="int8"` has a quantized weight's products on a CPU quantize the activations per row and
    block of 16 and sum integers, llama.cpp's way: faster, slightly other numbers (docs/models.md,
    "Integer activations"); "float32", the default, reads them as they are."""
    compile_cache.enable()  # before anything compiles: a later process loads the decode loops instead
    if activations not in ACTIVATION_MODES:
        raise ValueError(f"activations must be one of {', '.join(ACTIVATION_MODES)}, got {activations!r}")
    if drafter is not None and not isinstance(drafter, (str, os.PathLike)):
        raise TypeError(f"drafter must be a path to a drafter file or None, got {type(drafter).__name__}")
    named = bundled.named(path) if path is None or bundled.is_name(path) else None
    if named is None and isinstance(path, str) and os.sep not in path and not os.path.exists(path):
        bundled.named(path)  # neither a directory nor a name: the error lists the names
    if drafter == BUNDLED_DRAFTER:
        drafter = named.drafter if named is not None and named.drafter.is_file() else None
    if drafter is None and draft_vocab_size:
        raise ValueError("draft_vocab_size needs a drafter, whose token ranking it reads")
    mesh = sharding.decode_mesh(mesh)
    if mesh is not None:  # before any weight is read, so that a mesh the model cannot use costs nothing
        sharding.check_divides(checkpoint.load_config(path if named is None else bundled.ensure_converted(model=named)), mesh)
    model = checkpoint.load(path, dtype, mesh) if named is None else bundled.load(dtype, mesh, named)
    if activations != model.config.activations:
        model = dataclasses.replace(model, config=model.config.replace(activations=activations))
    if drafter is not None:
        model = drafter_lib.apply(model, drafter, draft_vocab_size, reuse_base=True)
    if mesh is not None:  # the drafter's arrays, made on one device, join the layout
        model = dataclasses.replace(model, params=sharding.place(model.params, model.config, mesh))
    return model


def token_array(token_ids, config: ModelConfig) -> np.ndarray:
    """Token ids as an int64 array: ints only (a float or bool is an error, not truncated), each
    inside the vocabulary."""
    arrays = (np.ndarray, jax.Array)
    ids = np.asarray(token_ids) if isinstance(token_ids, arrays) else np.asarray(token_ids, dtype=object)
    if ids.size == 0:
        raise ValueError("empty prompt: give at least one token")
    if ids.dtype == object:  # Python values: a bool stays a bool, a big int stays exact
        for t in ids.flat:
            if isinstance(t, (list, tuple, np.ndarray)):
                raise ValueError(f"token ids must be a flat list or a rectangular batch, got a ragged row {t!r}")
            if isinstance(t, (bool, np.bool_)) or not isinstance(t, numbers.Integral):
                raise TypeError(f"token ids must be ints, got {t!r}")
    elif ids.dtype.kind not in "iu":
        raise TypeError(f"token ids must be ints, got an array of {ids.dtype}")
    vocab = config.produced_vocab_size  # past it: the rows a conversion adds (mask, padding)
    outside = ids[(ids < 0) | (ids >= vocab)]
    if outside.size:
        raise ValueError(f"token id {outside.flat[0]} is outside the vocabulary [0, {vocab})")
    if config.mask_token_id is not None and np.any(ids == config.mask_token_id):
        raise ValueError(f"token id {config.mask_token_id} is the mask token, which only the draft's input may hold")
    return ids.astype(np.int64)


@functools.partial(jax.jit, static_argnames="config")
def _full_logits(params, config: ModelConfig, token_ids_BT):
    hidden, _ = full_pass(params, config, token_ids_BT)
    return lm_logits(params, config, hidden)[..., : config.produced_vocab_size]


def logits(model: Model, token_ids) -> jax.Array:
    """Full-model float32 logits `[batch, time, vocab]` for a rectangular batch of token ids, over the
    model's vocabulary (the padding rows a conversion adds are left out)."""
    if not isinstance(model, Model):
        raise TypeError(f"logits needs a Model from s3d_jax.load, got {type(model).__name__}")
    token_ids = token_array(token_ids, model.config)
    if token_ids.ndim == 1:
        token_ids = token_ids[None]
    if token_ids.ndim != 2:
        raise ValueError(f"token_ids must be [time] or [batch, time], got shape {token_ids.shape}")
    if token_ids.shape[1] > model.config.max_position_embeddings:
        raise ValueError(
            f"{token_ids.shape[1]} tokens exceed the model's context of {model.config.max_position_embeddings} positions"
        )
    out = _full_logits(model.params, model.config, jnp.asarray(token_ids, jnp.int32))
    chex.assert_shape(out, (*token_ids.shape, model.config.produced_vocab_size))
    return out


# ---------------------------------------------------------------- decoding


@dataclasses.dataclass
class DecodeStats:
    method: str
    gamma: int
    skip: tuple[int, int] | None
    generated_tokens: list[int]  # per row
    iterations: list[int]  # per row: speculative iterations (drafted, or the branch alone) while the row was active
    accept_histogram: list[list[int]]  # per row: how many iterations accepted k = 0..reach drafts (Plan.reach)
    decode_seconds: float  # prefill and loop, compilation excluded
    compile_seconds: float
    tree: int = 0  # the token tree's nodes; 0: the argmax chain
    lookup: bool = False  # the tree had a branch copied from the context
    branch_only: list[int] = dataclasses.field(default_factory=list)  # per row: iterations that verified that branch alone
    # per row: plain steps taken instead of drafting (`decoding.wants_draft`)
    plain_steps: list[int] = dataclasses.field(default_factory=list)
    min_certainty: float = 0.0
    drafted_cost: float = 0.0  # > 0: each row learned where its drafts paid (`Plan.drafted_cost`)
    policy: str = ""  # the calibrated drafting policy and the pass costs behind it, where one chose the defaults

    @property
    def tokens_per_iteration(self) -> float:
        """E: mean tokens emitted per iteration (accepted drafts plus the verifier's token)."""
        return tokens_per_iteration(np.sum(self.accept_histogram, axis=0))

    @property
    def acceptance_per_depth(self) -> list[float]:
        """α_j: the chance that draft j is accepted given drafts 1..j-1 were."""
        return acceptance_per_depth(np.sum(self.accept_histogram, axis=0))

    @property
    def tokens_per_second(self) -> float:
        return sum(self.generated_tokens) / self.decode_seconds

    def summary(self) -> str:
        """One line for a person: speed, what kinds of iteration ran, acceptance at the depths that some
        draft reached (a depth no draft reached has nothing to report), and the calibrated policy if one chose."""
        return "; ".join([self._iterations()] + [self.policy] * bool(self.policy))

    def _iterations(self) -> str:
        method = f"{self.method}, tree of {self.tree}{' + context branch' if self.lookup else ''}" if self.tree else self.method
        text = (f"{method}: {sum(self.generated_tokens)} tokens in {self.decode_seconds:.2f} s, {self.tokens_per_second:.1f} tokens/s "
                f"(compiling took {self.compile_seconds:.1f} s)")
        if not self.gamma:  # plain decoding: one token per step, nothing drafted
            return text
        speculative, branch, plain = sum(self.iterations), sum(self.branch_only), sum(self.plain_steps)
        kinds = [f"{speculative - branch} drafted"] + [f"{branch} the context branch alone"] * bool(branch)
        if plain:
            where = ("drafting never pays here" if self.min_certainty == NEVER
                     else "the drafts had stopped paying" if self.drafted_cost
                     else f"the text was less predictable than {self.min_certainty:g}")
            kinds.append(f"{plain} plain steps, where {where}")
        text += f"; {speculative + plain} iterations: " + ", ".join(kinds)
        if not speculative:
            return text + "; no draft was verified"
        histogram = np.sum(self.accept_histogram, axis=0)
        reached = np.cumsum(histogram[::-1])[::-1]  # reached[j]: iterations whose draft j + 1 was checked, if it existed
        depths = [f"{j + 1}: {a:.0%} of {reached[j]}" for j, a in enumerate(self.acceptance_per_depth) if reached[j]]
        text += f"; {self.tokens_per_iteration:.2f} tokens per drafted or branch iteration"
        return text + "; drafts accepted at depth " + ", ".join(depths)


@dataclasses.dataclass
class DecodeOutput:
    tokens: list  # generated ids: a list per prompt, or one list for a single prompt
    text: list | str | None  # decoded text where the tokenizer is known
    stats: DecodeStats


def encode(model: Model, prompt, chat: bool) -> tuple[list[list[int]], bool]:
    """Prompts as token-id lists, and whether the input was a batch."""

    def tokenizer():
        if model.tokenizer is None:
            raise ValueError("this model has no tokenizer: pass token ids instead of text")
        return model.tokenizer

    def one(p) -> list[int]:
        if isinstance(p, str):
            check_text(p, "prompt")
            p = [{"role": "user", "content": p}] if chat else tokenizer()(p)["input_ids"]
        if isinstance(p, (list, tuple)) and p and isinstance(p[0], dict):
            check_messages(p)
            ids = tokenizer().apply_chat_template(list(p), add_generation_prompt=True, tokenize=True)
            p = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
        ids = token_array(p, model.config)
        if ids.ndim > 1:
            raise ValueError(f"each prompt must be a flat list of token ids, got shape {ids.shape}")
        return ids.reshape(-1).tolist()

    if isinstance(prompt, (list, tuple)) and not prompt:
        raise ValueError("empty prompt: give at least one token")
    if isinstance(prompt, (str, np.ndarray, jax.Array)) and np.ndim(prompt) < 2:
        return [one(prompt)], False
    if isinstance(prompt, (list, tuple)) and isinstance(prompt[0], (numbers.Number, np.bool_, dict)):
        return [one(prompt)], False
    if isinstance(prompt, (list, tuple, np.ndarray, jax.Array)):
        if not len(prompt):
            raise ValueError("empty batch: give at least one prompt")
        return [one(p) for p in prompt], True
    raise TypeError(f"unsupported prompt type {type(prompt).__name__}: give text, chat messages or token ids")


def check_text(text: str, what: str) -> None:
    """Refuses text that is not valid Unicode (a lone surrogate such as "\\ud800"), which no tokenizer can encode."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"{what} is not valid Unicode: {text[e.start : e.end]!r} at index {e.start} is a lone surrogate") from None


def check_messages(messages) -> None:
    """Chat messages must be dicts with text `role` and `content`."""
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise TypeError(f"chat message {i} must be a dict with 'role' and 'content', got {type(message).__name__}")
        for key in ("role", "content"):
            if not isinstance(message.get(key), str):
                raise TypeError(f"chat message {i} {key} must be text, got {type(message.get(key)).__name__}")
            check_text(message[key], f"chat message {i} {key}")


def resolve(model, config: ModelConfig | None = None) -> Model:
    """A Model from a Model, a path, None (the bundled default), or raw params with their config."""
    if isinstance(model, Model):
        if config is not None and config != model.config:
            raise ConfigError("config= is for raw params only: this Model already has its own config")
        return model
    if config is not None:
        if not isinstance(config, ModelConfig):
            raise TypeError(f"config must be a ModelConfig, got {type(config).__name__}")
        checkpoint.check_params(model, config)
        return Model(model, config)
    if model is None or isinstance(model, (str, os.PathLike)):
        return load(model)
    raise ConfigError(f"expected a Model from s3d_jax.load, a path, or None; got {type(model).__name__} (raw params need config=)")


def options_from(options: DecodeOptions | None, overrides: dict) -> DecodeOptions:
    """`options` (default DecodeOptions()) with keyword overrides, e.g. `decode(m, p, method="ar")`."""
    options = DecodeOptions() if options is None else options
    if not isinstance(options, DecodeOptions):
        raise TypeError(f"options must be a DecodeOptions, got {type(options).__name__} (or pass fields as keywords)")
    unknown = sorted(set(overrides) - {f.name for f in dataclasses.fields(DecodeOptions)})
    if unknown:
        raise TypeError(f"unknown decode option {unknown[0]!r}; see s3d_jax.DecodeOptions")
    return options.replace(**overrides) if overrides else options


def eos_ids_for(model: Model, options: DecodeOptions) -> tuple[int, ...]:
    """The tokens that end a reply: the options', else the checkpoint's and the tokenizer's."""
    cfg, eos_token_ids = model.config, options.eos_token_ids
    if eos_token_ids is None:
        eos_token_ids = set(cfg.eos_token_ids)
        if model.tokenizer is not None and model.tokenizer.eos_token_id is not None:
            eos_token_ids.add(model.tokenizer.eos_token_id)
    for eos in eos_token_ids:
        if eos >= cfg.vocab_size or eos == cfg.mask_token_id:
            what = "the mask token, which is never emitted" if eos == cfg.mask_token_id else f"outside the vocabulary of {cfg.vocab_size}"
            raise ValueError(f"eos token id {eos} is {what}")
    return tuple(sorted(eos_token_ids))


def prepare(
    params, prompt, options: DecodeOptions | None = None, *, config: ModelConfig | None = None, **overrides
) -> tuple[Model, decoding.Run, bool]:
    """Validates a decode request and builds its plan and padded inputs (nothing runs yet).
    Returns (model, run, whether the prompt was a batch)."""
    options = options_from(options, overrides)
    model = resolve(params, config)
    cfg = model.config
    policy, why = planning.drafting_policy(model, options)
    plan = planning.plan_for(cfg, options, policy)
    max_new_tokens = options.max_new_tokens
    eos_token_ids = eos_ids_for(model, options)
    ids, batched = encode(model, prompt, options.chat)
    lengths = np.array([len(row) for row in ids])
    padded_len = prompt_bucket(int(lengths.max()))
    needed = int(lengths.max()) + max_new_tokens + plan.block
    limit = cfg.max_position_embeddings
    max_len = options.max_len
    if max_len is not None and max_len > limit:
        raise ValueError(f"max_len {max_len} exceeds the model's context of {limit} positions (max_position_embeddings)")
    if max_len is None:
        max_len = min(bucket(max(needed, padded_len), minimum=128), max(limit, needed))
    if needed > max_len or needed > limit:
        block = f"gamma {plan.gamma}"
        if plan.nodes > plan.gamma:  # the tree's slots are the block
            block = f"tree {plan.tree}" + (f" + lookup {plan.gamma}" if plan.lookup else "")
        raise ValueError(
            f"prompt of {int(lengths.max())} tokens + max_new_tokens {max_new_tokens} + {block} (the draft block) "
            f"= {needed} does not fit the cache of {min(max_len, limit)} positions"
        )
    max_len = max(max_len, padded_len)
    prompts = np.zeros((len(ids), padded_len), np.int32)
    for b, row in enumerate(ids):
        prompts[b, : len(row)] = row
    run = decoding.Run(model.params, cfg, plan, prompts, lengths, max_new_tokens, eos_token_ids, options.seed, max_len,
                       policy=why)
    return model, run, batched


def _collect(state: decoding.DecodeState, run: decoding.Run) -> list[list[int]]:
    tokens, starts, counts = sharding.to_host((state.tokens, state.prompt_lengths, state.num_generated))
    return [tokens[b, s : s + c].tolist() for b, (s, c) in enumerate(zip(starts, counts))]


def _output(model: Model, run: decoding.Run, state, batched: bool, seconds: float) -> DecodeOutput:
    tokens = _collect(state, run)
    hist, branch_only, plain_steps = sharding.to_host((state.stats.accept_histogram, state.stats.branch_only, state.stats.plain_steps))
    stats = DecodeStats(
        method=run.plan.method,
        gamma=run.plan.gamma,
        skip=run.plan.skip,
        generated_tokens=[len(t) for t in tokens],
        iterations=hist.sum(axis=1).tolist(),
        accept_histogram=hist.tolist(),
        decode_seconds=seconds,
        compile_seconds=run.compile_seconds,
        tree=run.plan.tree,
        lookup=run.plan.lookup,
        branch_only=branch_only.tolist(),
        plain_steps=plain_steps.tolist(),
        min_certainty=run.plan.min_certainty,
        drafted_cost=run.plan.drafted_cost,
        policy=run.policy,
    )
    text = None
    if model.tokenizer is not None:
        text = [model.tokenizer.decode(t, skip_special_tokens=True) for t in tokens]
    if not batched:
        tokens, text = tokens[0], None if text is None else text[0]
    return DecodeOutput(tokens, text, stats)


def decode(params, prompt, options: DecodeOptions | None = None, *, config: ModelConfig | None = None, **overrides) -> DecodeOutput:
    """Decodes `prompt` speculatively (default S3D) or plainly (`method="ar"`).

    `params` is a Model from `s3d_jax.load`, a path, None (the bundled model), or raw params with
    `config=`. `prompt` is text, chat messages, token ids, or a list of those (a batch). `options` is
    a DecodeOptions; keyword overrides change single fields of it (`method="ar"`, `gamma=3`, ...).
    """
    model, run, batched = prepare(params, prompt, options, config=config, **overrides)
    run.compile()  # before the clock: compile time is reported apart
    start = time.perf_counter()
    state = run.advance(run.start(), np.iinfo(np.int32).max)
    jax.block_until_ready(state.tokens)
    output = _output(model, run, state, batched, time.perf_counter() - start)
    del state
    cpu.release_freed_memory()  # the decode's buffers, freed: decodes of other shapes would each leave their pages
    return output


def stream(
    params, prompt, options: DecodeOptions | None = None, *, chunk_iterations: int = 8, config: ModelConfig | None = None, **overrides
):
    """Like `decode`, but yields each row's tokens so far after every `chunk_iterations` iterations,
    then the final DecodeOutput. The loop runs on the device between yields."""
    chunk_iterations = check_int("chunk_iterations", chunk_iterations, 1)
    model, run, batched = prepare(params, prompt, options, config=config, **overrides)
    return _stream(model, run, batched, chunk_iterations)  # a generator, after the checks have run


def _stream(model: Model, run: decoding.Run, batched: bool, chunk_iterations: int):
    run.compile()  # before the clock: compile time is reported apart
    start = time.perf_counter()
    state = run.start()
    stop = 0
    while True:
        stop = min(stop + chunk_iterations, np.iinfo(np.int32).max)
        state = run.advance(state, stop)
        if bool(jnp.all(state.done)):
            break
        yield _collect(state, run)
    output = _output(model, run, state, batched, time.perf_counter() - start)
    del state
    cpu.release_freed_memory()
    yield output
