"""Decoder-only Transformer (LLaMA, Mistral, Phi-3, Qwen2, Qwen3, Gemma-2, Gemma-3) as pure-functional
Flax modules; the families differ only in `ModelConfig` options.

Shapes carry their axes in their names: B batch, T new tokens, S context keys, D hidden,
H query heads, K key/value heads, G = H // K query heads per KV head, E head dim, F FFN, V vocab.

Projections that read the same input are one weight (`qkv` `[D, K, G + 2, E]`, `gate_up` `[D, 2, F]`),
and so are their draft adapters (`adapters.DraftLoRA`): one product where there would be several.

The layers are one stack: every layer's weights share one array `[L, ...]` per name (`params["layers"]`),
and a pass is a `lax.scan` of one `Block` over a static list of layer indices (`layers`): the full
model is all of them, the S3D drafter the full model minus a middle range. The loop compiles one
layer's code however many layers run, and each layer's weights and cache are read in place in the
stack (`few_rows.entry`). Attention always has two key segments:
  - a *context*: keys and values computed earlier (the KV cache at inference, the clean
    sequence's target keys in training), visible through `context_mask`;
  - the block itself, visible through `block_mask`: `[B, T, T]`, or a `Band` when each query sees
    only the few block keys just before it (training's draft pass under span masking).
The block's keys and values are returned, stacked over the pass's layers: the caller decides whether
to cache them. Each layer applies its own sliding window and RoPE (Gemma's layers differ) to both masks.
"""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from s3d_jax import few_rows, quant, tables
from s3d_jax.adapters import DraftLoRA
from s3d_jax.config import COMPUTE_DTYPE, ModelConfig
from s3d_jax.positions import layer_frequencies, rope, window_mask

NEG_INF = jnp.finfo(jnp.float32).min
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


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Band:
    """A block mask as a band: `mask_BTW[b, t, j]` says whether query t sees the block's key t - j.
    Where no query sees more than W block keys, attention scores W of them instead of all T."""

    mask_BTW: jax.Array

    def keys(self, x_BT):
        """`[B, T, W, ...]`: at `[b, t, j]` the entry of `x_BT` at t - j (zeros before the start)."""
        T, W = x_BT.shape[1], self.mask_BTW.shape[-1]
        padded = jnp.pad(x_BT, [(0, 0), (W - 1, 0)] + [(0, 0)] * (x_BT.ndim - 2))
        return jnp.stack([padded[:, W - 1 - j : W - 1 - j + T] for j in range(W)], axis=2)


@dataclasses.dataclass
class Prefix:
    """A context mask as a prefix, row b seeing slots `s < lengths_B[b]` (the KV cache), the only slots a CPU reads."""

    lengths_B: jax.Array

    def mask(self, T: int, S: int):
        return jnp.broadcast_to(jnp.arange(S)[None, None, :] < self.lengths_B[:, None, None], (len(self.lengths_B), T, S))


def weight(module: nn.Module, name: str, in_shape, out_shape):
    """A weight `[*in_shape, *out_shape]`: a float array, or quantized (`quant`), as the params hold it
    (a QLoRA run holds quantized projections beside float tables); a new one in the config's dtype.
    A layer's weights are stacks, their `in_shape` led by the layer axis."""
    c = module.config
    held = module.get_variable("params", name) if module.has_variable("params", name) else None
    fmt = (quant.format_of(held, len(in_shape)) if quant.is_quantized(held) else None) if held is not None else (
        quant.format_for(c, name) if c.quantized else None)
    if fmt:
        return module.param(name, quant.initializer(init_normal, fmt), tuple(in_shape), tuple(out_shape))
    return module.param(name, init_normal, (*in_shape, *out_shape), c.jnp_dtype)


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
                         init_normal, slot_parts, slot_axis, name=f"{name}_lora")
        y, update = lora(x, layer, jnp.where(layer < low, layer, layer - skipped), w)
    else:
        y = few_rows.matmul(x, w, len(in_shape), c.precision, at=layer)
    if bias:
        y = y + few_rows.entry(module.param(f"{name}_bias", nn.initializers.zeros, (L, *out_shape), c.jnp_dtype), layer)
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
            scale_D = few_rows.entry(self.param("scale", init, (self.layers, x_BTD.shape[-1]), self.dtype), layer)
        x32 = x_BTD.astype(jnp.float32)
        normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        if self.plus_one:
            return (normed * (1.0 + scale_D.astype(jnp.float32))).astype(x_BTD.dtype)
        return scale_D * normed.astype(x_BTD.dtype)


def softcap(x, cap: float | None):
    """`cap * tanh(x / cap)` (Gemma-2's attention scores and logits); `x` itself without a cap."""
    return x if cap is None else cap * jnp.tanh(x / cap)


def xla_attention(c: ModelConfig, layer, q_BTKGE, k_BTKE, v_BTKE, positions_BT, context_kv, context_positions_BS, context_mask_BTS,
                  block_mask_BTT, scale: float):
    """`[B, T, K, G, E]`: attention over the context and the block by XLA's operations, for every pass
    that `few_rows.cache_attention` does not take (training, the prompt pass, other backends, sharded
    runs, sliding windows, softcaps, a `Band`)."""
    B, T, K, G, E = q_BTKGE.shape
    f32 = jnp.float32
    k_BKTE, v_BKET = k_BTKE.transpose(0, 2, 1, 3), v_BTKE.transpose(0, 2, 3, 1)
    context_k_LBKSE, context_v_LBKES = context_kv
    S = context_k_LBKSE.shape[3]
    band = block_mask_BTT if isinstance(block_mask_BTT, Band) else None
    context_mask_BTS = context_mask_BTS.mask(T, S) if isinstance(context_mask_BTS, Prefix) else context_mask_BTS
    scores_ctx = jnp.einsum("btkge,bkse->bkgts", q_BTKGE, few_rows.entry(context_k_LBKSE, layer), preferred_element_type=f32,
                            precision=c.precision) * scale
    q_pos_BT1 = positions_BT[:, :, None]
    if band is not None:  # the block's keys t - j for each query t: a product and sum over E, no matmul
        k_BTWKE, v_BTWKE = band.keys(k_BTKE), band.keys(v_BTKE)
        scores_blk = jnp.einsum("btkge,btwke->bkgtw", q_BTKGE, k_BTWKE, precision=c.precision) * scale
        block_mask_BTT = band.mask_BTW & window_mask(c, layer, q_pos_BT1, band.keys(positions_BT))
    elif T == 1:  # a plain step: the token's one block key, a product and sum over E rather than a matmul
        scores_blk = (q_BTKGE * k_BTKE[:, :, :, None]).sum(-1).transpose(0, 2, 3, 1)[..., None] * scale
    else:
        scores_blk = jnp.einsum("btkge,bkse->bkgts", q_BTKGE, k_BKTE, preferred_element_type=f32, precision=c.precision) * scale
        block_mask_BTT = block_mask_BTT & window_mask(c, layer, q_pos_BT1, positions_BT[:, None, :])
    scores_ctx, scores_blk = softcap(scores_ctx, c.attn_softcap), softcap(scores_blk, c.attn_softcap)
    context_mask_BTS = context_mask_BTS & window_mask(c, layer, q_pos_BT1, context_positions_BS[:, None, :])
    scores = jnp.concatenate([jnp.where(context_mask_BTS[:, None, None], scores_ctx, NEG_INF),
                              jnp.where(block_mask_BTT[:, None, None], scores_blk, NEG_INF)], axis=-1)
    probs = jax.nn.softmax(scores, axis=-1)
    out_BTKGE = jnp.einsum("bkgts,bkes->btkge", probs[..., :S], few_rows.entry(context_v_LBKES, layer), preferred_element_type=f32,
                           precision=c.precision)
    if band is not None:
        out_BTKGE += jnp.einsum("bkgtw,btwke->btkge", probs[..., S:], v_BTWKE, preferred_element_type=f32, precision=c.precision)
    elif T == 1:
        out_BTKGE += probs[..., S:].transpose(0, 3, 1, 2, 4) * v_BTKE[:, :, :, None]
    else:
        out_BTKGE += jnp.einsum("bkgts,bkes->btkge", probs[..., S:], v_BKET, preferred_element_type=f32, precision=c.precision)
    return out_BTKGE


class Attention(nn.Module):
    config: ModelConfig

    @nn.compact
    def __call__(self, x_BTD, layer, positions_BT, context_kv, context_positions_BS, context_mask_BTS, block_mask_BTT, draft: bool):
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

        q_BTKGE = q_BTHE.reshape(B, T, K, G, E)
        context_k_LBKSE, context_v_LBKES = context_kv  # every layer's: this layer's is read in place
        scale = (c.query_pre_attn_scalar or E) ** -0.5
        lengths_B = context_mask_BTS.lengths_B if isinstance(context_mask_BTS, Prefix) else None  # the cache's
        if (lengths_B is not None and not isinstance(block_mask_BTT, Band) and c.attn_softcap is None and c.sliding_window is None
                and few_rows.cache_attention_applies(T, E, q_BTKGE.dtype, context_k_LBKSE.dtype)):  # a decode pass on a CPU
            out_BTKGE = few_rows.cache_attention(q_BTKGE, context_k_LBKSE, context_v_LBKES, k_BTKE, v_BTKE, block_mask_BTT,
                                                 lengths_B, layer, scale)
        else:
            out_BTKGE = xla_attention(c, layer, q_BTKGE, k_BTKE, v_BTKE, positions_BT, context_kv, context_positions_BS,
                                      context_mask_BTS, block_mask_BTT, scale)
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
    with `post_norms` (Gemma) their outputs are normed too before the addition."""

    config: ModelConfig

    @nn.compact
    def __call__(self, x_BTD, layer, positions_BT, context_kv, context_positions_BS, context_mask_BTS, block_mask_BTT, draft: bool):
        c = self.config

        def norm(name, x):
            return RMSNorm(c.rms_norm_eps, c.jnp_dtype, c.norm_plus_one, c.num_layers, name=name)(x, layer)

        attn_out, kv = Attention(c, name="attn")(
            norm("attn_norm", x_BTD), layer, positions_BT, context_kv, context_positions_BS, context_mask_BTS, block_mask_BTT, draft)
        if c.post_norms:
            attn_out = norm("attn_post_norm", attn_out)
        h_BTD = x_BTD + attn_out
        mlp_out = MLP(c, name="mlp")(norm("mlp_norm", h_BTD), layer, draft)
        if c.post_norms:
            mlp_out = norm("mlp_post_norm", mlp_out)
        return h_BTD + mlp_out, kv


class Transformer(nn.Module):
    config: ModelConfig

    def setup(self):
        c = self.config
        # One column per token, [D, V]: the layout the (tied) head's matmul reads in place. A step
        # looks up only B x T columns, so the lookup's layout hardly matters.
        self.embedding = vocabulary_table(self, "embed")
        self.layers = Block(c)
        self.final_norm = RMSNorm(c.rms_norm_eps, c.jnp_dtype, c.norm_plus_one)
        if not c.tie_embeddings:
            self.lm_head = vocabulary_table(self, "lm_head")
        if c.draft_vocab_size:  # the reduced draft head: token ids (ascending) and a copy of their head columns (`draft_head_table`)
            self.draft_vocab = self.param("draft_vocab", lambda _: default_draft_vocab(c))
            self.draft_head = self.param("draft_head", lambda _: draft_head_table(self.head(), self.draft_vocab, c))

    def __call__(self, tokens_BT, positions_BT, context_kv, context_positions_BS, context_mask_BTS, block_mask_BTT,
                 layers: tuple[int, ...], draft: bool = False):
        """Runs `layers` in order; returns final-normed hidden states and the block's keys `[n, B, K, T, E]`
        and values `[n, B, K, E, T]`, stacked in the order of `layers`.

        `context_kv` is every layer's context, keys `[L, B, K, S, E]` and values `[L, B, K, E, S]`, at
        positions `context_positions_BS` (for sliding windows). `draft` applies the draft-only
        adapters, if the model has them.
        """
        x_BTD = jnp.moveaxis(tables.columns(self.embedding, tokens_BT), 0, -1).astype(COMPUTE_DTYPE)
        if self.config.scale_embeddings:  # by sqrt(D) rounded to the weights' dtype, as transformers does
            x_BTD = x_BTD * jnp.asarray(np.float32(self.config.hidden_size**0.5)).astype(self.config.jnp_dtype)
        inputs = (positions_BT, context_kv, context_positions_BS, context_mask_BTS, block_mask_BTT, draft)
        if self.is_initializing():  # creates the stack's parameters
            self.layers(x_BTD, jnp.int32(0), *inputs)
        stack = {"params": self.layers.variables["params"]}

        def layer_step(x_BTD, layer):  # the stack's weights enter as constants of the loop: no layer is sliced out
            return Block(self.config, parent=None).apply(stack, x_BTD, layer, *inputs)

        x_BTD, block_kv = jax.lax.scan(layer_step, x_BTD, jnp.asarray(layers, jnp.int32))
        return self.final_norm(x_BTD), block_kv

    def head(self):
        """The output head `[D, V]`: the embedding table when tied."""
        return self.embedding if self.config.tie_embeddings else self.lm_head

    def logits(self, hidden_BTD):
        """Float32 logits over the whole embedding table (the mask row included)."""
        return few_rows.matmul(hidden_BTD, self.head(), precision=self.config.precision, preferred_element_type=jnp.float32)

    def context_logits(self, hidden_BTD, ids_BL, counts_B):
        """Float32 logits of each row at its first `counts[b]` token ids `ids_BL`, `[B, T, L]` (the rest: any value)."""
        return tables.column_logits(hidden_BTD, self.head(), ids_BL, counts_B, self.config.precision)

    def reduced_logits(self, hidden_BTD):
        """Float32 logits over the draft vocabulary only, `[B, T, draft_vocab_size]`."""
        return few_rows.matmul(hidden_BTD, self.draft_head, precision=self.config.precision,
                               preferred_element_type=jnp.float32)

    def full(self, tokens_BT, positions_BT, mask_BTT):
        """All layers over `tokens` with nothing before them (prompt pass, training target, `logits`)."""
        c = self.config
        B = tokens_BT.shape[0]
        empty_k = jnp.zeros((c.num_layers, B, c.num_kv_heads, 0, c.head_dim), COMPUTE_DTYPE)
        empty_v = jnp.zeros((c.num_layers, B, c.num_kv_heads, c.head_dim, 0), COMPUTE_DTYPE)
        no_context_BS = jnp.zeros((B, 0), jnp.int32)
        no_context_BTS = jnp.zeros((*mask_BTT.shape[:2], 0), bool)
        return self(tokens_BT, positions_BT, (empty_k, empty_v), no_context_BS, no_context_BTS, mask_BTT, c.all_layers)

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
    table = quant.select_columns(head, ids)
    return table if quant.is_quantized(table) else table.astype(config.draft_jnp_dtype)


def cast_dtype(leaf_dtype, dtype):
    """A leaf's dtype once cast to `dtype`: floating-point leaves take it; the draft vocabulary's token ids stay integers."""
    return dtype if jnp.issubdtype(leaf_dtype, jnp.floating) else leaf_dtype


def cast_params(params, dtype):
    """Float leaves cast to `dtype`; a quantized weight (`quant`) keeps its format."""
    return jax.tree.map(lambda x: x if quant.is_quantized(x) else x.astype(cast_dtype(x.dtype, dtype)), params, is_leaf=quant.is_quantized)


def causal_inputs(tokens_BT):
    """Positions `0 .. T-1` and the causal mask of one unpadded sequence per row."""
    B, T = tokens_BT.shape
    return jnp.broadcast_to(jnp.arange(T), (B, T)), jnp.broadcast_to(causal_mask(T), (B, T, T))


def causal_mask(T: int):
    """`[T, T]`: each position sees itself and the positions before it (layers apply their windows)."""
    t = jnp.arange(T)
    return t[:, None] >= t[None, :]


def init_params(config: ModelConfig, rng: jax.Array):
    """Random parameters (normal, std 0.02), for tests and new models."""
    tokens = jnp.zeros((1, 1), jnp.int32)
    return Transformer(config).init(rng, tokens, method=Transformer.init_all)["params"]


def abstract_params(config: ModelConfig):
    """Parameter shapes and dtypes, allocating nothing."""
    return jax.eval_shape(lambda: init_params(config, jax.random.key(0)))


def run_layers(
    params, config: ModelConfig, tokens_BT, positions_BT, context_kv, context_positions, context_mask, block_mask, layers, draft=False
):
    return Transformer(config).apply(
        {"params": params}, tokens_BT, positions_BT, context_kv, context_positions, context_mask, block_mask, tuple(layers), draft
    )


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
