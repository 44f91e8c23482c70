"""The operations the model is made of, and the one module it calls for them: a layer's projection
(`linear`), attention over a `Context` (`attention`), and the vocabulary-table lookups (`embed`,
`head`, `column_logits`), with the parameter helpers that know how a quantized weight is held.

Beneath them: the CPU kernel (`s3d_jax.kernel`) where it applies, the quantized formats (`quant`),
and XLA's operations everywhere else (other backends, sharded runs, training, a prompt's pass). The
model never asks which one ran; each gives the same numbers within its documented tolerance, and the
kernel's are bit-identical for a row alone or beside others (docs/cpu.md).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from s3d_jax import quant
from s3d_jax.config import COMPUTE_DTYPE, ModelConfig
from s3d_jax.kernel import dispatch
from s3d_jax.kernel.dispatch import batched_matmul, column_logits, entry, matmul, matmuls  # noqa: F401  (the seam's products)
from s3d_jax.positions import window_mask

NEG_INF = jnp.finfo(jnp.float32).min


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


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Prefix:
    """A context mask as a prefix, row b seeing slots `s < lengths_B[b]` (the KV cache), the only slots a CPU reads."""

    lengths_B: jax.Array

    def mask(self, T: int, S: int):
        return jnp.broadcast_to(jnp.arange(S)[None, None, :] < self.lengths_B[:, None, None], (len(self.lengths_B), T, S))


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Context:
    """What a pass's queries attend to, as one value from `Transformer` to `attention`: the context,
    keys and values computed earlier (the KV cache at inference, the clean sequence's target keys in
    training) for every layer, keys `[L, B, K, S, E]` and values `[L, B, K, E, S]` at `positions_BS`,
    visible through `mask_BTS` (`[B, T, S]`, or a `Prefix`); and the block itself, visible through
    `block_mask_BTT` (`[B, T, T]`, or a `Band`). Each layer applies its own sliding window to both."""

    keys_LBKSE: jax.Array
    values_LBKES: jax.Array
    positions_BS: jax.Array
    mask_BTS: jax.Array | Prefix
    block_mask_BTT: jax.Array | Band

    @classmethod
    def empty(cls, config: ModelConfig, block_mask_BTT):
        """No context: the block alone (a prompt's pass, training's target pass)."""
        B, T = block_mask_BTT.shape[:2]
        L, K, E = config.num_layers, config.num_kv_heads, config.head_dim
        return cls(jnp.zeros((L, B, K, 0, E), COMPUTE_DTYPE), jnp.zeros((L, B, K, E, 0), COMPUTE_DTYPE), jnp.zeros((B, 0), jnp.int32),
                   jnp.zeros((B, T, 0), bool), block_mask_BTT)


def weight_init(config: ModelConfig, name: str, held, in_shape: tuple, out_shape: tuple, init):
    """`(initializer, *args)` for `module.param(name, ...)` of a weight `[*in_shape, *out_shape]`: a
    quantized one (`quant`) as the params hold it (a QLoRA run holds quantized projections beside
    float tables) or, new, as the config's formats say; a float one in the config's dtype."""
    fmt = (quant.format_of(held, len(in_shape)) if quant.is_quantized(held) else None) if held is not None else (
        quant.format_for(config, name) if config.quantized else None)
    if fmt:
        return quant.initializer(init, fmt), in_shape, out_shape
    return init, (*in_shape, *out_shape), config.jnp_dtype


def linear(x, stack, layer, n_in: int = 1, precision=None, activations="float32"):
    """`x @ stack[layer]` over x's last `n_in` axes: a layer's projection, read in place in its stack."""
    return matmul(x, stack, n_in, precision, at=layer, activations=activations)


def embed(table_DV, tokens_BT):
    """`[B, T, D]` float32: the tokens' columns of a vocabulary table."""
    return jnp.moveaxis(dispatch.columns(table_DV, tokens_BT), 0, -1)


def head(hidden_BTD, table_DV, precision=None, activations="float32"):
    """Float32 scores `[B, T, V]` of the hidden states against every column of a vocabulary table."""
    return matmul(hidden_BTD, table_DV, precision=precision, preferred_element_type=jnp.float32, activations=activations)


def select_columns(table_DV, ids, float_dtype):
    """Columns `ids` of a vocabulary table, quantized as the table is, else in `float_dtype` (the reduced draft head)."""
    table = quant.select_columns(table_DV, ids)
    return table if quant.is_quantized(table) else table.astype(float_dtype)


def softcap(x, cap: float | None):
    """`cap * tanh(x / cap)` (Gemma-2's attention scores and logits); `x` itself without a cap."""
    return x if cap is None else cap * jnp.tanh(x / cap)


def attention(c: ModelConfig, layer, q_BTKGE, k_BTKE, v_BTKE, positions_BT, context: Context, scale: float):
    """`[B, T, K, G, E]`: the block's queries over `context` at layer `layer` and over the block's own
    keys and values. A decode pass on a CPU (a cached `Prefix`, a full block mask, no window or
    softcap) goes to the kernel, which reads each row's live cache slots only; the rest to XLA."""
    T, E = q_BTKGE.shape[1], q_BTKGE.shape[-1]
    if (isinstance(context.mask_BTS, Prefix) and not isinstance(context.block_mask_BTT, Band) and c.attn_softcap is None
            and c.sliding_window is None and dispatch.cache_attention_applies(T, E, q_BTKGE.dtype, context.keys_LBKSE.dtype)):
        return dispatch.cache_attention(q_BTKGE, context.keys_LBKSE, context.values_LBKES, k_BTKE, v_BTKE, context.block_mask_BTT,
                                        context.mask_BTS.lengths_B, layer, scale)
    return xla_attention(c, layer, q_BTKGE, k_BTKE, v_BTKE, positions_BT, context, scale)


def xla_attention(c: ModelConfig, layer, q_BTKGE, k_BTKE, v_BTKE, positions_BT, context: Context, scale: float):
    """`attention` by XLA's operations: training, the prompt pass, other backends, sharded runs,
    sliding windows, softcaps, a `Band`."""
    B, T, K, G, E = q_BTKGE.shape
    f32 = jnp.float32
    k_BKTE, v_BKET = k_BTKE.transpose(0, 2, 1, 3), v_BTKE.transpose(0, 2, 3, 1)
    S = context.keys_LBKSE.shape[3]
    block_mask_BTT = context.block_mask_BTT
    band = block_mask_BTT if isinstance(block_mask_BTT, Band) else None
    context_mask_BTS = context.mask_BTS.mask(T, S) if isinstance(context.mask_BTS, Prefix) else context.mask_BTS
    scores_ctx = jnp.einsum("btkge,bkse->bkgts", q_BTKGE, entry(context.keys_LBKSE, layer), preferred_element_type=f32,
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
    context_mask_BTS = context_mask_BTS & window_mask(c, layer, q_pos_BT1, context.positions_BS[:, None, :])
    scores = jnp.concatenate([jnp.where(context_mask_BTS[:, None, None], scores_ctx, NEG_INF),
                              jnp.where(block_mask_BTT[:, None, None], scores_blk, NEG_INF)], axis=-1)
    probs = jax.nn.softmax(scores, axis=-1)
    out_BTKGE = jnp.einsum("bkgts,bkes->btkge", probs[..., :S], entry(context.values_LBKES, layer), preferred_element_type=f32,
                           precision=c.precision)
    if band is not None:
        out_BTKGE += jnp.einsum("bkgtw,btwke->btkge", probs[..., S:], v_BTWKE, preferred_element_type=f32, precision=c.precision)
    elif T == 1:
        out_BTKGE += probs[..., S:].transpose(0, 3, 1, 2, 4) * v_BTKE[:, :, :, None]
    else:
        out_BTKGE += jnp.einsum("bkgts,bkes->btkge", probs[..., S:], v_BKET, preferred_element_type=f32, precision=c.precision)
    return out_BTKGE


def ordered_after(output, values):
    """`values`, made to depend on a pass's `output`, which every layer's attention over the cache precedes.
    A block's keys and values do not depend on its layer's attention, so without this XLA cannot
    order the cache's reads before its writes and copies every layer's cache on every pass (the cost
    of a step then grows with the cache's allocated length). Adding zero keeps every value exact."""
    zero = (jnp.sum(output) > 0).astype(jnp.float32) * 0  # never NaN, and XLA cannot fold it away
    return jax.tree.map(lambda x: x + zero.astype(x.dtype), values)
