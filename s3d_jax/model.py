"""Decoder-only Transformer (LLaMA, Mistral, Phi-3, Qwen2, Qwen3, Gemma-2, Gemma-3) as pure-functional
Flax modules; the families differ only in `ModelConfig` options.

Shapes carry their axes in their names: B batch, T new tokens, S context keys, D hidden,
H query heads, K key/value heads, G = H // K query heads per KV head, E head dim, F FFN, V vocab.

Projections that read the same input are one weight (`qkv` `[D, K, G + 2, E]`, `gate_up` `[D, 2, F]`),
and so are their draft adapters (`adapters.DraftLoRA`): one product where there would be several.

The layers are one stack: every layer's weights share one array `[L, ...]` per name (`params["layers"]`),
and a pass is a scan of one `Block` (`LayerScan`) over a static list of layer indices (`layers`): the full
model is all of them, the S3D drafter the full model minus a middle range. The loop compiles one
layer's code however many layers run, and each layer's weights and cache are read in place in the
stack. Attention always has two key segments, carried together as one `ops.Context`:
  - a *context*: keys and values computed earlier (the KV cache at inference, the clean
    sequence's target keys in training), visible through its mask;
  - the block itself, visible through the block mask: `[B, T, T]`, or a `Band` when each query sees
    only the few block keys just before it (training's draft pass under span masking).
The block's keys and values are returned, stacked over the pass's layers: the caller decides whether
to cache them. Each layer applies its own sliding window and RoPE (Gemma's layers differ) to both masks.

Every product, attention and table lookup is an operation of `s3d_jax.ops`, which picks the CPU
kernel, the quantized formats or XLA's operations beneath it: nothing here knows which runs.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from s3d_jax import ops
from s3d_jax.adapters import DraftLoRA
from s3d_jax.config import COMPUTE_DTYPE, ModelConfig
from s3d_jax.ops import NEG_INF, Context, softcap
from s3d_jax.positions import layer_frequencies, rope

init_normal = nn.initializers.normal(stddev=0.02)


# The fused `qkv`'s slot layout (above), for the model, conversion and old drafter files alike.
def qkv_slot_parts(group: int) -> tuple[int, ...]:
    """Which projection (0 q, 1 k, 2 v) each of the G + 2 slots holds."""
    return (0,) * group + (1, 2)


def split_qkv(qkv, group: int):
    """`[.., K, G + 2, E]` -> queries `[.., K, G, E]`, keys `[.., K, E]`, values `[.., K, E]`."""
    return qkv[..., :group, :], qkv[..., group, :], qkv[..., group + 1, :]


def join_qkv(q, k, v, num_kv_heads: int, axis: int = -2) -> np.ndarray:
    """Queries `[.., H, E]` and keys, values `[.., K, E]` as slots along `axis` of `[.., K, E]` (numpy)."""
    q = q.reshape(*q.shape[:-2], num_kv_heads, q.shape[-2] // num_kv_heads, q.shape[-1])
    return np.concatenate([np.moveaxis(q, -2, axis), np.expand_dims(k, axis), np.expand_dims(v, axis)], axis=axis)


def weight(module: nn.Module, name: str, in_shape, out_shape):
    """A weight `[*in_shape, *out_shape]`: a float array, or quantized (`quant`), as the params hold it
    (a QLoRA run holds quantized projections beside float tables); a new one in the config's dtype.
    A layer's weights are stacks, their `in_shape` led by the layer axis."""
    held = module.get_variable("params", name) if module.has_variable("params", name) else None
    return module.param(name, *ops.weight_init(module.config, name, held, tuple(in_shape), tuple(out_shape), init_normal))


def vocabulary_table(module: nn.Module, name: str):
    """The embedding or the head, `[D, V]`: one column per token, the layout the head's matmul reads in place."""
    return weight(module, name, (module.config.hidden_size,), (module.config.vocab_size,))


def linear(module: nn.Module, name: str, x, layer, in_shape, out_shape, draft: bool, bias: bool = False,
           slot_parts: tuple[int, ...] | None = None, slot_axis: int = 0):
    """`x @ W[layer]` (+ b) over the trailing `in_shape` axes, plus the draft-only LoRA update in draft
    passes. A fused `W` names the part of each slot of its output along `slot_axis` (`DraftLoRA`)."""
    c = module.config
    L = c.num_layers
    w = weight(module, name, (L, *in_shape), out_shape)
    update = None
    if c.draft_lora_rank and (draft or module.is_initializing()):
        low, high = c.draft_skip  # the adapters' stacks hold the draft layers only, in order
        skipped = high - low + 1
        lora = DraftLoRA(c.draft_lora_rank, L - skipped, tuple(in_shape), tuple(out_shape), c.draft_jnp_dtype, c.precision,
                         init_normal, slot_parts, slot_axis, c.activations, name=f"{name}_lora")
        y, update = lora(x, layer, jnp.where(layer < low, layer, layer - skipped), w)
    else:
        y = ops.linear(x, w, layer, len(in_shape), c.precision, c.activations)
    if bias:
        y = y + ops.entry(module.param(f"{name}_bias", nn.initializers.zeros, (L, *out_shape), c.jnp_dtype), layer)
    return y if update is None else y + update


class RMSNorm(nn.Module):
    """Over the last axis. `plus_one` (Gemma): the stored `w` scales by `1 + w`, in float32 before
    the cast back, as transformers' Gemma norms do; otherwise by `w`, after the cast (LLaMA). A
    layer's norm is a stack of `layers` scales, of which a call reads entry `layer`."""

    eps: float
    dtype: jnp.dtype
    plus_one: bool = False
    layers: int | None = None

    @nn.compact
    def __call__(self, x_BTD, layer=None):
        init = nn.initializers.zeros if self.plus_one else nn.initializers.ones
        if self.layers is None:
            scale_D = self.param("scale", init, (x_BTD.shape[-1],), self.dtype)
        else:
            scale_D = ops.entry(self.param("scale", init, (self.layers, x_BTD.shape[-1]), self.dtype), layer)
        x32 = x_BTD.astype(jnp.float32)
        normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        if self.plus_one:
            return (normed * (1.0 + scale_D.astype(jnp.float32))).astype(x_BTD.dtype)
        return scale_D * normed.astype(x_BTD.dtype)


class Attention(nn.Module):
    config: ModelConfig

    @nn.compact
    def __call__(self, x_BTD, layer, positions_BT, context: Context, draft: bool):
        c = self.config
        D, H, K, E = c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim
        G = H // K
        B, T = x_BTD.shape[:2]
        qkv_BTKPE = linear(self, "qkv", x_BTD, layer, (D,), (K, G + 2, E), draft, c.qkv_bias, qkv_slot_parts(G), 1)  # P = G + 2
        q_BTKGE, k_BTKE, v_BTKE = split_qkv(qkv_BTKPE, G)
        q_BTHE = q_BTKGE.reshape(B, T, H, E)
        if c.qk_norm:
            q_BTHE = RMSNorm(c.rms_norm_eps, c.jnp_dtype, c.norm_plus_one, c.num_layers, name="q_norm")(q_BTHE, layer)
            k_BTKE = RMSNorm(c.rms_norm_eps, c.jnp_dtype, c.norm_plus_one, c.num_layers, name="k_norm")(k_BTKE, layer)
        inv_freq = layer_frequencies(c, layer)
        q_BTHE, k_BTKE = rope(q_BTHE, positions_BT, inv_freq), rope(k_BTKE, positions_BT, inv_freq)

        scale = (c.query_pre_attn_scalar or E) ** -0.5
        out_BTKGE = ops.attention(c, layer, q_BTHE.reshape(B, T, K, G, E), k_BTKE, v_BTKE, positions_BT, context, scale)
        out_BTD = linear(self, "o", out_BTKGE.reshape(B, T, H, E), layer, (H, E), (D,), draft)
        # Keys are laid out [B, K, S, E] and values [B, K, E, S], as in the cache: in both of XLA's
        # attention matmuls the heads are a batch axis and the contracted axis is minor, the layout
        # XLA's CPU dot wants; any other layout makes it transpose (copy) the whole cache per step.
        return out_BTD, (k_BTKE.transpose(0, 2, 1, 3), v_BTKE.transpose(0, 2, 3, 1))


class MLP(nn.Module):
    config: ModelConfig

    @nn.compact
    def __call__(self, x_BTD, layer, draft: bool):
        c = self.config
        D, F = c.hidden_size, c.intermediate_size
        gate_up_BT2F = linear(self, "gate_up", x_BTD, layer, (D,), (2, F), draft, slot_parts=(0, 1))
        act = nn.silu if c.hidden_act == "silu" else lambda x: nn.gelu(x, approximate=True)  # GeGLU: tanh GELU
        h_BTF = act(gate_up_BT2F[..., 0, :]) * gate_up_BT2F[..., 1, :]
        return linear(self, "down", h_BTF, layer, (F,), (D,), draft)


class Block(nn.Module):
    """Layer `layer` (traced) of the stack: pre-norm attention and MLP, each added to the residual;
    with `post_norms` (Gemma) their outputs are normed too before the addition. Returns the new
    residual and the layer's block keys and values (a step of the layer scan, `LayerScan`)."""

    config: ModelConfig

    @nn.compact
    def __call__(self, x_BTD, layer, positions_BT, context: Context, draft: bool):
        c = self.config

        def norm(name, x):
            return RMSNorm(c.rms_norm_eps, c.jnp_dtype, c.norm_plus_one, c.num_layers, name=name)(x, layer)

        attn_out, kv = Attention(c, name="attn")(norm("attn_norm", x_BTD), layer, positions_BT, context, draft)
        if c.post_norms:
            attn_out = norm("attn_post_norm", attn_out)
        h_BTD = x_BTD + attn_out
        mlp_out = MLP(c, name="mlp")(norm("mlp_norm", h_BTD), layer, draft)
        if c.post_norms:
            mlp_out = norm("mlp_post_norm", mlp_out)
        return h_BTD + mlp_out, kv


# The layer stack as one scan of `Block` over layer indices: the stack's weights are shared by every
# step (broadcast, read in place at the step's layer), the residual is the carry, and each step's
# keys and values are stacked.
LayerScan = nn.scan(Block, variable_broadcast="params", split_rngs={"params": False},
                    in_axes=(0, nn.broadcast, nn.broadcast, nn.broadcast))


class Transformer(nn.Module):
    config: ModelConfig

    def setup(self):
        c = self.config
        # One column per token, [D, V]: the layout the (tied) head's matmul reads in place. A step
        # looks up only B x T columns, so the lookup's layout hardly matters.
        self.embedding = vocabulary_table(self, "embed")
        self.layers = LayerScan(c)
        self.final_norm = RMSNorm(c.rms_norm_eps, c.jnp_dtype, c.norm_plus_one)
        if not c.tie_embeddings:
            self.lm_head = vocabulary_table(self, "lm_head")
        if c.draft_vocab_size:  # the reduced draft head: token ids (ascending) and a copy of their head columns (`draft_head_table`)
            self.draft_vocab = self.param("draft_vocab", lambda _: default_draft_vocab(c))
            self.draft_head = self.param("draft_head", lambda _: draft_head_table(self.head(), self.draft_vocab, c))

    def __call__(self, tokens_BT, positions_BT, context: Context, layers: tuple[int, ...], draft: bool = False):
        """Runs `layers` in order over `context`; returns final-normed hidden states and the block's keys
        `[n, B, K, T, E]` and values `[n, B, K, E, T]`, stacked in the order of `layers`. `draft`
        applies the draft-only adapters, if the model has them."""
        x_BTD = ops.embed(self.embedding, tokens_BT).astype(COMPUTE_DTYPE)
        if self.config.scale_embeddings:  # by sqrt(D) rounded to the weights' dtype, as transformers does
            x_BTD = x_BTD * jnp.asarray(np.float32(self.config.hidden_size**0.5)).astype(self.config.jnp_dtype)
        x_BTD, block_kv = self.layers(x_BTD, jnp.asarray(layers, jnp.int32), positions_BT, context, draft)
        return self.final_norm(x_BTD), block_kv

    def head(self):
        """The output head `[D, V]`: the embedding table when tied."""
        return self.embedding if self.config.tie_embeddings else self.lm_head

    def logits(self, hidden_BTD):
        """Float32 logits over the whole embedding table (the mask row included)."""
        return ops.head(hidden_BTD, self.head(), self.config.precision, self.config.activations)

    def context_logits(self, hidden_BTD, ids_BL, counts_B):
        """Float32 logits of each row at its first `counts[b]` token ids `ids_BL`, `[B, T, L]` (the rest: any value)."""
        return ops.column_logits(hidden_BTD, self.head(), ids_BL, counts_B, self.config.precision)

    def reduced_logits(self, hidden_BTD):
        """Float32 logits over the draft vocabulary only, `[B, T, draft_vocab_size]`."""
        return ops.head(hidden_BTD, self.draft_head, self.config.precision)

    def full(self, tokens_BT, positions_BT, mask_BTT):
        """All layers over `tokens` with nothing before them (prompt pass, training target, `logits`)."""
        return self(tokens_BT, positions_BT, Context.empty(self.config, mask_BTT), self.config.all_layers)

    def init_all(self, tokens_BT):
        """Touches every parameter, for `init`."""
        hidden, _ = self.full(tokens_BT, *causal_inputs(tokens_BT))
        return self.logits(hidden), (self.reduced_logits(hidden) if self.config.draft_vocab_size else None)


def default_draft_vocab(config: ModelConfig):
    """The first `draft_vocab_size` producible ids (a random model's draft vocabulary; a drafter sets its own)."""
    ids = np.arange(config.draft_vocab_size + 1)
    return jnp.asarray(ids[ids != config.mask_token_id][: config.draft_vocab_size], jnp.int32)


def draft_head_table(head, ids, config: ModelConfig):
    """The reduced draft head: `head`'s columns `ids`, quantized as `head` is, else in the adapters' float type."""
    return ops.select_columns(head, ids, config.draft_jnp_dtype)


def causal_inputs(tokens_BT):
    """Positions `0 .. T-1` and the causal mask of one unpadded sequence per row."""
    B, T = tokens_BT.shape
    return jnp.broadcast_to(jnp.arange(T), (B, T)), jnp.broadcast_to(causal_mask(T), (B, T, T))


def causal_mask(T: int):
    """`[T, T]`: each position sees itself and the positions before it (layers apply their windows)."""
    t = jnp.arange(T)
    return t[:, None] >= t[None, :]


def _random_params(config: ModelConfig, rng: jax.Array):
    tokens = jnp.zeros((1, 1), jnp.int32)
    return Transformer(config).init(rng, tokens, method=Transformer.init_all)["params"]


# LLVM's level 1 compiles a normal sampler's polynomial about 5x faster than its default 2, to the same bits.
RANDOM_INIT_OPTIONS = {"xla_backend_optimization_level": 1}
# One program per config: run eagerly, each distinct shape's sampler compiles on its own (7.6 s for a
# tiny 6-layer model on a 2-core CPU, against 1.1 s so).
_init_program = jax.jit(_random_params, static_argnums=0, compiler_options=RANDOM_INIT_OPTIONS)


def init_params(config: ModelConfig, rng: jax.Array):
    """Random parameters (normal, std 0.02), for tests and new models."""
    return _init_program(config, rng)


def abstract_params(config: ModelConfig):
    """Parameter shapes and dtypes, allocating nothing."""
    return jax.eval_shape(lambda: _random_params(config, jax.random.key(0)))


def run_layers(params, config: ModelConfig, tokens_BT, positions_BT, context: Context, layers, draft=False):
    """`Transformer.__call__`: `layers` over `context`; (final hidden states, the block's keys and values)."""
    return Transformer(config).apply({"params": params}, tokens_BT, positions_BT, context, tuple(layers), draft)


def full_pass(params, config: ModelConfig, tokens_BT, positions_BT=None, mask_BTT=None):
    """The full model with no context: (final hidden states, every layer's keys and values).
    Positions and mask default to one causal sequence per row."""
    if positions_BT is None:
        positions_BT, mask_BTT = causal_inputs(tokens_BT)
    return Transformer(config).apply({"params": params}, tokens_BT, positions_BT, mask_BTT, method=Transformer.full)


def lm_logits(params, config: ModelConfig, hidden_BTD):
    """Float32 logits over every row of the vocabulary, the mask row included (soft-capped for Gemma-2)."""
    logits = Transformer(config).apply({"params": params}, hidden_BTD, method=Transformer.logits)
    return softcap(logits, config.final_softcap)


def head_logits(params, config: ModelConfig, hidden_BTD):
    """Float32 logits with the mask token's and the padding rows' forced to -inf: drafts and outputs
    never produce them."""
    return never_produced(lm_logits(params, config, hidden_BTD), config)


def draft_head_logits(params, config: ModelConfig, hidden_BTD, context_BL=None, context_lengths_B=None):
    """The draft pass's logits `[B, T, V]`: `head_logits`, or with a reduced draft vocabulary its
    scores at those ids and -inf everywhere else (so sampling and acceptance read them unchanged).

    `context_BL`, each row's tokens so far (the first `context_lengths_B[b]` of row b; default all),
    adds those ids to a reduced vocabulary: a reply copies names and identifiers from its prompt, and
    those are what a list of frequent tokens misses (docs/design.md, "The reduced draft head")."""
    if not config.draft_vocab_size:
        return head_logits(params, config, hidden_BTD)
    reduced = softcap(reduced_logits(params, config, hidden_BTD), config.final_softcap)
    full = jnp.full((*reduced.shape[:-1], config.vocab_size), NEG_INF, jnp.float32)
    full = full.at[..., params["draft_vocab"]].set(reduced)
    if context_BL is not None:
        counts = jnp.full(context_BL.shape[:1], context_BL.shape[1]) if context_lengths_B is None else context_lengths_B
        unscored = jnp.ones(config.vocab_size, bool).at[params["draft_vocab"]].set(False)
        # Past a row's context, and the ids the reduced head already scored: dropped, and not scored again.
        ids = jnp.where((jnp.arange(context_BL.shape[1]) < counts[:, None]) & unscored[context_BL], context_BL, config.vocab_size)
        seen = softcap(context_logits(params, config, hidden_BTD, ids, counts), config.final_softcap)
        full = jax.vmap(lambda row, ids, scores: row.at[:, ids].set(scores, mode="drop"))(full, ids, seen)
    return never_produced(full, config)


def context_logits(params, config: ModelConfig, hidden_BTD, ids_BL, counts_B):
    """Each row's logits at its first `counts[b]` ids `ids_BL` (not soft-capped), `[B, T, L]`."""
    return Transformer(config).apply({"params": params}, hidden_BTD, ids_BL, counts_B, method=Transformer.context_logits)


def reduced_logits(params, config: ModelConfig, hidden_BTD):
    """Logits over the draft vocabulary only (not soft-capped), `[B, T, draft_vocab_size]`."""
    return Transformer(config).apply({"params": params}, hidden_BTD, method=Transformer.reduced_logits)


def never_produced(logits, config: ModelConfig):
    """`lm_logits` with the mask token's and the padding rows' logits forced to -inf."""
    if config.output_vocab_size is not None:
        logits = logits.at[..., config.output_vocab_size :].set(NEG_INF)
    return logits if config.mask_token_id is None else logits.at[..., config.mask_token_id].set(NEG_INF)
