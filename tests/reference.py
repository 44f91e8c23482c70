"""Independent references for the tests: random tiny models and a plain float64 numpy forward pass."""

from __future__ import annotations

import functools
import os

import jax
import numpy as np

import s3d_jax
from s3d_jax import Model, ModelConfig, bundled, checkpoint
from s3d_jax.cache import cached_forward, prompt_forward
from s3d_jax.cpu import FEW_ROW_OPTIONS
from s3d_jax.model import init_params
from s3d_jax.speculative import draft_s3d

# How the test run compiles, in its processes and the command lines they start (conftest.py adds these to
# XLA_FLAGS): without XLA's elemental fusion emitters, as the decode loop compiles on a CPU
# (`cpu.FEW_ROW_OPTIONS`), and at LLVM's optimisation level 0, the loop's too (`XLA_FLAGS` wins over
# `FEW_ROW_OPTIONS`). The tests are bound by XLA's compiler: these compile a tiny model's passes 2-3x
# faster, and change no number (LLVM reorders no float arithmetic without fast-math, which XLA leaves
# off). `users_env()` gives a child process the compiler as users have it (docs/guarantees.md, "Tests").
TEST_XLA_FLAGS = (f"--xla_cpu_use_fusion_emitters={str(FEW_ROW_OPTIONS['xla_cpu_use_fusion_emitters']).lower()}",
                  "--xla_backend_optimization_level=0")


def users_env(**extra) -> dict:
    """The environment of a child process that compiles as a user's does: without `TEST_XLA_FLAGS`."""
    flags = " ".join(f for f in os.environ.get("XLA_FLAGS", "").split() if f not in TEST_XLA_FLAGS)
    return {**os.environ, "XLA_FLAGS": flags, **extra}


def devices_env(devices: int, as_users: bool = False, **extra) -> dict:
    """The environment of a child process with `devices` simulated CPU devices, keeping the test run's
    own XLA flags (conftest.py) unless it is to compile `as_users` do (`users_env`)."""
    env = users_env() if as_users else dict(os.environ)
    flags = f"{env.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={devices}".strip()
    return {**env, "XLA_FLAGS": flags, **extra}


# `cached_forward` jitted, for tests that run passes one by one: one compile per shape instead of one per operation.
forward = jax.jit(cached_forward, static_argnums=(1, 4, 5))


@functools.partial(jax.jit, static_argnames=("config", "plan"))
def draft_logits_after(params, config, plan, tokens_1T, n, context_1L=None):
    """`draft_s3d`'s logits `[γ, V]` for the block at `x_n = tokens_1T[0, n]`, the prompt pass having put
    all of `tokens_1T` in the cache: its slots at or past `n` are stale, never read (so one compile
    serves every `n`, and a draft that read them would see what follows)."""
    _, cache = prompt_forward(params, config, tokens_1T, 32)
    return draft_s3d(params, config, plan, cache.replace(lengths=n[None]), tokens_1T[:, n], jax.random.key(0), context_1L)[1][0]

# The options that change how a decode drafts, never what it emits: its plain twin drops them.
SPECULATIVE_OPTIONS = ("method", "gamma", "skip", "tree", "lookup", "min_certainty")


def assert_exact(model, prompt, plain_model=None, plain=None, **options):
    """The invariant every exactness test states: decoding `prompt` with `options` (speculatively, trees,
    gates and all) emits exactly the tokens of plain decoding with the same sampling options, of the
    same verifier (`plain_model`, where `model` is it with a drafter applied). `plain`: that plain
    output, decoded once for several checks (a real model's). Returns (output, plain output)."""
    out = s3d_jax.decode(model, prompt, **options)
    if plain is None:
        plain_options = {k: v for k, v in options.items() if k not in SPECULATIVE_OPTIONS}
        plain = s3d_jax.decode(model if plain_model is None else plain_model, prompt, method="ar", **plain_options)
    assert out.tokens == plain.tokens, f"{options}: speculative {out.tokens} != plain {plain.tokens}"
    return out, plain


def tiny_config(**overrides) -> ModelConfig:
    fields = dict(
        architecture="llama",
        vocab_size=96,
        hidden_size=48,
        intermediate_size=96,
        num_layers=6,
        num_heads=4,
        num_kv_heads=2,
        head_dim=12,
        rope_theta=10000.0,
        mask_token_id=95,
        max_position_embeddings=512,
    )
    fields.update(overrides)
    return ModelConfig(**fields)


def tiny_model(seed: int = 0, scale: float = 4.0, **overrides) -> Model:
    """A random model; weights scaled up from std 0.02 so its predictions are not near-uniform."""
    config = tiny_config(**overrides)
    params = init_params(config, jax.random.key(seed))
    params = jax.tree_util.tree_map_with_path(  # on the host: an eager multiply would compile once per shape
        lambda path, x: x if "scale" in jax.tree_util.keystr(path) else jax.numpy.asarray(np.asarray(x) * np.float32(scale)), params
    )
    return Model(params, config)


def tiny_chat_model(**overrides) -> Model:
    """A small random model over SmolLM2's vocabulary with the bundled tokenizer and its chat template:
    a command line's or a server's whole path, compiled in seconds."""
    fields = dict(seed=0, vocab_size=49153, mask_token_id=49152, hidden_size=32, intermediate_size=64, head_dim=8)
    model = tiny_model(**{**fields, **overrides})
    return Model(model.params, model.config, bundled.tokenizer())


def drafting_chat_model() -> Model:
    """`tiny_chat_model` with a drafter's settings (layers 1-2 skipped, chains of 3, trees of 4), as the
    server's tests serve it."""
    model = tiny_chat_model()
    return Model(model.params, model.config.replace(draft_skip=(1, 2), draft_gamma=3, draft_tree=4), model.tokenizer)


def save_chat_model(path, **overrides):
    """`tiny_chat_model` saved as a model directory that stops at SmolLM2's end-of-turn id (2); returns `path`."""
    model = tiny_chat_model(**overrides)
    checkpoint.save(path, model.params, model.config.replace(eos_token_ids=(2,)), model.tokenizer)
    return path


def layer_params(params, i: int):
    """Layer i's weights: entry i of every array of the layer stack."""
    return jax.tree.map(lambda a: a[i], params["layers"])


def _rms(x, w, eps):
    return w * (x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps))


def _rope(x_THE, positions, theta):
    half = x_THE.shape[-1] // 2
    inv_freq = 1.0 / theta ** (np.arange(half) / half)
    angles = positions[:, None, None] * inv_freq[None, None, :]
    x1, x2 = x_THE[..., :half], x_THE[..., half:]
    return np.concatenate([x1 * np.cos(angles) - x2 * np.sin(angles), x2 * np.cos(angles) + x1 * np.sin(angles)], -1)


def _layer(p, x_TD, c: ModelConfig):
    T = x_TD.shape[0]
    pos = np.arange(T, dtype=np.float64)
    h = _rms(x_TD, p["attn_norm"]["scale"], c.rms_norm_eps)
    group = c.num_heads // c.num_kv_heads
    qkv = p["attn"]["qkv"]  # [D, K, G + 2, E]: each KV head's query heads, then its key and value
    q_DHE = qkv[:, :, :group].reshape(c.hidden_size, c.num_heads, c.head_dim)
    q = _rope(np.einsum("td,dhe->the", h, q_DHE), pos, c.rope_theta)
    k = _rope(np.einsum("td,dke->tke", h, qkv[:, :, group]), pos, c.rope_theta)
    v = np.einsum("td,dke->tke", h, qkv[:, :, group + 1])
    k, v = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)
    scores = np.einsum("the,she->hts", q, k) / np.sqrt(c.head_dim)
    allowed = np.tril(np.ones((T, T), bool))
    if c.sliding_window is not None:
        allowed &= np.subtract.outer(np.arange(T), np.arange(T)) < c.sliding_window
    scores = np.where(allowed, scores, -np.inf)
    probs = np.exp(scores - scores.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    x_TD = x_TD + np.einsum("hts,she,hed->td", probs, v, p["attn"]["o"])
    h = _rms(x_TD, p["mlp_norm"]["scale"], c.rms_norm_eps)
    gate, up = h @ p["mlp"]["gate_up"][:, 0], h @ p["mlp"]["gate_up"][:, 1]  # [D, 2, F]
    return x_TD + (gate / (1 + np.exp(-gate)) * up) @ p["mlp"]["down"]


def numpy_logits(model: Model, tokens, layers=None, frozen_prefix: int = 0):
    """Float64 logits of one sequence through `layers` (default: all).

    With `frozen_prefix = n`, the first n positions enter every layer with the *full model's* hidden
    states, so their keys and values are the full model's: the S3D draft pass, recomputed plainly.
    """
    c = model.config
    params = jax.tree.map(lambda a: np.asarray(a, np.float64), model.params)
    embed_DV = params["embed"]
    x = embed_DV[:, np.asarray(tokens)].T
    full_inputs = [x]
    for i in range(c.num_layers):
        full_inputs.append(_layer(layer_params(params, i), full_inputs[-1], c))
    for i in c.all_layers if layers is None else layers:
        x = x.copy()
        x[:frozen_prefix] = full_inputs[i][:frozen_prefix]
        x = _layer(layer_params(params, i), x, c)
    x = _rms(x, params["final_norm"]["scale"], c.rms_norm_eps)
    head = embed_DV if c.tie_embeddings else params["lm_head"]
    return x @ head


def one_tensor_gguf(path, arch: str, tensor: np.ndarray):
    """A GGUF file of architecture `arch` holding one block count and `token_embd.weight`: enough for
    the reader to reach the checks of what a file holds."""
    import gguf

    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", tensor)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
