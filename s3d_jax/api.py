"""The public Python API: `load`, `logits`, `decode`."""

from __future__ import annotations

import dataclasses
import functools
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from s3d_jax import checkpoint, decoding
from s3d_jax.cache import KVCache, cached_forward
from s3d_jax.checkpoint import Model
from s3d_jax.config import ModelConfig, validate_skip
from s3d_jax.model import lm_logits
from s3d_jax.sampling import Sampling
from s3d_jax.speculative import METHODS, Plan


def load(path: str | os.PathLike | None = None, dtype: str | None = None) -> Model:
    """Loads a converted model; with no path, the bundled SmolLM2-135M-Instruct (converted on first use)."""
    return checkpoint.load_default(dtype) if path is None else checkpoint.load(path, dtype)


def check_token_ids(token_ids: np.ndarray, config: ModelConfig) -> None:
    if token_ids.size == 0:
        raise ValueError("empty prompt: give at least one token")
    bad = token_ids[(token_ids < 0) | (token_ids >= config.vocab_size)]
    if bad.size:
        raise ValueError(f"token id {int(bad[0])} is outside the vocabulary [0, {config.vocab_size})")


@functools.partial(jax.jit, static_argnames="config")
def _full_logits(params, config: ModelConfig, token_ids_BT):
    cache = KVCache.zeros(config, token_ids_BT.shape[0], 0)
    hidden, _ = cached_forward(params, config, cache, token_ids_BT, config.all_layers, write=False)
    return lm_logits(params, config, hidden)


def logits(model: Model, token_ids) -> jax.Array:
    """Full-model float32 logits `[batch, time, vocab]` for a rectangular batch of token ids."""
    token_ids = np.asarray(token_ids, dtype=np.int64)
    if token_ids.ndim == 1:
        token_ids = token_ids[None]
    if token_ids.ndim != 2:
        raise ValueError(f"token_ids must be [time] or [batch, time], got shape {token_ids.shape}")
    check_token_ids(token_ids, model.config)
    return _full_logits(model.params, model.config, jnp.asarray(token_ids, jnp.int32))


# ---------------------------------------------------------------- decoding

DEFAULT_GAMMA = 4


def default_skip(num_layers: int) -> tuple[int, int]:
    """About half of the layers, centred: the paper's best region."""
    low = num_layers // 4
    return low, low + num_layers // 2 - 1


def bucket(n: int, minimum: int = 16) -> int:
    """Pads lengths to powers of two so that a new length seldom compiles again."""
    return max(minimum, 1 << (n - 1).bit_length())


def tokens_per_iteration(histogram) -> float:
    """E from a histogram over k = 0..γ accepted drafts: each iteration emits k + 1 tokens."""
    hist = np.asarray(histogram)
    return float(np.dot(hist, np.arange(1, len(hist) + 1)) / max(hist.sum(), 1))


def acceptance_per_depth(histogram) -> list[float]:
    """α_j from a histogram over k = 0..γ: the chance that draft j is accepted given 1..j-1 were."""
    hist = np.asarray(histogram)
    reached = np.cumsum(hist[::-1])[::-1]  # reached[j] = iterations with k >= j
    return [float(reached[j + 1] / reached[j]) if reached[j] else float("nan") for j in range(len(hist) - 1)]


@dataclasses.dataclass
class DecodeStats:
    method: str
    gamma: int
    skip: tuple[int, int] | None
    generated_tokens: list[int]  # per row
    iterations: list[int]  # per row: iterations while the row was active
    accept_histogram: list[list[int]]  # per row: how many iterations accepted k = 0..γ drafts
    decode_seconds: float  # prefill and loop, compilation excluded
    compile_seconds: float

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
        depth = " ".join(f"{a:.2f}" for a in self.acceptance_per_depth)
        text = (
            f"{self.method}: {sum(self.generated_tokens)} tokens in {self.decode_seconds:.2f}s "
            f"({self.tokens_per_second:.1f} tok/s, compile {self.compile_seconds:.1f}s), "
            f"{sum(self.iterations)} iterations, {self.tokens_per_iteration:.2f} tokens/iteration"
        )
        return text + (f", acceptance per depth [{depth}]" if self.gamma else "")


@dataclasses.dataclass
class DecodeOutput:
    tokens: list  # generated ids: a list per prompt, or one list for a single prompt
    text: list | str | None  # decoded text where the tokenizer is known
    stats: DecodeStats


def _encode(model: Model, prompt, chat: bool) -> tuple[list[list[int]], bool]:
    """Prompts as token-id lists, and whether the input was a batch."""

    def tokenizer():
        if model.tokenizer is None:
            raise ValueError("this model has no tokenizer: pass token ids instead of text")
        return model.tokenizer

    def one(p) -> list[int]:
        if isinstance(p, str):
            if chat:
                p = [{"role": "user", "content": p}]
            else:
                return list(tokenizer()(p)["input_ids"])
        if isinstance(p, (list, tuple)) and p and isinstance(p[0], dict):
            ids = tokenizer().apply_chat_template(list(p), add_generation_prompt=True, tokenize=True)
            return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)
        return [int(t) for t in np.asarray(p).reshape(-1)]

    if isinstance(prompt, (list, tuple)) and not prompt:
        raise ValueError("empty prompt: give at least one token")
    if isinstance(prompt, (str, np.ndarray, jax.Array)) and np.ndim(prompt) < 2:
        return [one(prompt)], False
    if isinstance(prompt, (list, tuple)) and prompt and isinstance(prompt[0], (int, np.integer, dict)):
        return [one(prompt)], False
    if isinstance(prompt, (list, tuple, np.ndarray, jax.Array)):
        return [one(p) for p in prompt], True
    raise ValueError(f"unsupported prompt type {type(prompt).__name__}: give text, chat messages or token ids")


def _model(params, config) -> Model:
    if isinstance(params, Model):
        return params
    if config is None:
        return checkpoint.resolve(params)
    return Model(params, config)


def prepare(
    params,
    prompt,
    *,
    config: ModelConfig | None = None,
    method: str = "s3d",
    gamma: int | None = None,
    skip: tuple[int, int] | None = None,
    max_new_tokens: int = 128,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    seed: int = 0,
    chat: bool = False,
    eos_token_ids=None,
    max_len: int | None = None,
) -> tuple[Model, decoding.Run, bool]:
    """Validates a decode request and builds its plan and padded inputs (nothing runs yet)."""
    model = _model(params, config)
    cfg = model.config
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}; choose one of {', '.join(METHODS)}")
    if method == "ar":
        gamma, skip = 0, None
    else:
        gamma = (cfg.draft_gamma or DEFAULT_GAMMA) if gamma is None else gamma
        skip = validate_skip((cfg.draft_skip or default_skip(cfg.num_layers)) if skip is None else skip, cfg.num_layers)
        if int(gamma) < 1:
            raise ValueError(f"gamma must be >= 1 for method {method!r}, got {gamma}")
        if method == "s3d" and cfg.mask_token_id is None:
            raise ValueError("this checkpoint has no mask token row (mask_token_id is unset): S3D drafting needs one; convert it again with tools/convert_hf.py")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    plan = Plan(method, int(gamma), cfg.draft_layers(skip) if skip else (), Sampling(temperature, top_k, top_p))

    ids, batched = _encode(model, prompt, chat)
    for row in ids:
        check_token_ids(np.asarray(row), cfg)
    lengths = np.array([len(row) for row in ids])
    padded_len = bucket(int(lengths.max()))
    needed = int(lengths.max()) + max_new_tokens + plan.gamma
    limit = cfg.max_position_embeddings
    if max_len is None:
        max_len = min(bucket(max(needed, padded_len), minimum=128), max(limit, needed))
    if needed > max_len or needed > limit:
        raise ValueError(
            f"prompt of {int(lengths.max())} tokens + max_new_tokens {max_new_tokens} + draft block {plan.gamma} "
            f"= {needed} does not fit the cache of {min(max_len, limit)} positions"
        )
    max_len = max(max_len, padded_len)
    prompts = np.zeros((len(ids), padded_len), np.int32)
    for b, row in enumerate(ids):
        prompts[b, : len(row)] = row
    if eos_token_ids is None:
        eos_token_ids = set(cfg.eos_token_ids)
        if model.tokenizer is not None and model.tokenizer.eos_token_id is not None:
            eos_token_ids.add(model.tokenizer.eos_token_id)
    run = decoding.Run(model.params, cfg, plan, prompts, lengths, max_new_tokens, tuple(sorted(eos_token_ids)), seed, max_len)
    return model, run, batched


def _collect(state: decoding.DecodeState, run: decoding.Run) -> list[list[int]]:
    tokens, starts, counts = jax.device_get((state.tokens, state.prompt_lengths, state.num_generated))
    return [tokens[b, s : s + c].tolist() for b, (s, c) in enumerate(zip(starts, counts))]


def _output(model: Model, run: decoding.Run, state, batched: bool, seconds: float) -> DecodeOutput:
    tokens = _collect(state, run)
    hist, iterations = jax.device_get((state.accept_histogram, state.accept_histogram.sum(axis=1)))
    stats = DecodeStats(
        method=run.plan.method,
        gamma=run.plan.gamma,
        skip=_skip_of(run),
        generated_tokens=[len(t) for t in tokens],
        iterations=iterations.tolist(),
        accept_histogram=hist.tolist(),
        decode_seconds=seconds,
        compile_seconds=run.compile_seconds,
    )
    text = None
    if model.tokenizer is not None:
        text = [model.tokenizer.decode(t, skip_special_tokens=True) for t in tokens]
    if not batched:
        tokens, text = tokens[0], None if text is None else text[0]
    return DecodeOutput(tokens, text, stats)


def _skip_of(run: decoding.Run):
    skipped = sorted(set(run.config.all_layers) - set(run.plan.draft_layers))
    return (skipped[0], skipped[-1]) if run.plan.draft_layers else None


def decode(params, prompt, **options) -> DecodeOutput:
    """Decodes `prompt` speculatively (default S3D) or plainly (`method="ar"`).

    `params` is a Model from `s3d_jax.load`, a path, or raw params with `config=`. `prompt` is text,
    chat messages, token ids, or a list of those (a batch). See `prepare` for the options.
    """
    model, run, batched = prepare(params, prompt, **options)
    run.compile()  # before the clock: compile time is reported apart
    start = time.perf_counter()
    state = run.advance(run.start(), np.iinfo(np.int32).max)
    jax.block_until_ready(state.tokens)
    return _output(model, run, state, batched, time.perf_counter() - start)


def stream(params, prompt, *, chunk_iterations: int = 8, **options):
    """Like `decode`, but yields each row's tokens so far after every `chunk_iterations` iterations,
    then the final DecodeOutput. The loop runs on the device between yields."""
    model, run, batched = prepare(params, prompt, **options)
    run.compile()  # before the clock: compile time is reported apart
    start = time.perf_counter()
    state = run.start()
    stop = 0
    while True:
        stop += chunk_iterations
        state = run.advance(state, stop)
        if bool(jnp.all(state.done)):
            break
        yield _collect(state, run)
    yield _output(model, run, state, batched, time.perf_counter() - start)
