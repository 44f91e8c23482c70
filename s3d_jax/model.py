"""Decoder-only Transformer (LLaMA, Mistral, Phi-3) as pure-functional Flax modules.

Shapes carry their axes in their names: B batch, T new tokens, S context keys, D hidden,
H query heads, K key/value heads, G = H // K query heads per KV head, E head dim, F FFN, V vocab.

Every pass runs a static subset of layers (`layers`): the full model is all of them, the S3D
drafter the full model minus a middle range. Attention always has two key segments:
  - a *context*: keys and values computed earlier (the KV cache at inference, the clean
    sequence's target keys in training), visible through `context_mask`;
  - the block itself, visible through `block_mask`.
The block's own keys and values are returned so the caller decides whether to cache them.
"""

from __future__ import annotations

from typing import Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp

from s3d_jax.config import ModelConfig

NEG_INF = jnp.finfo(jnp.float32).min
init_normal = nn.initializers.normal(stddev=0.02)


class RMSNorm(nn.Module):
    eps: float
    dtype: jnp.dtype

    @nn.compact
    def __call__(self, x_BTD):
        scale_D = self.param("scale", nn.initializers.ones, (x_BTD.shape[-1],), self.dtype)
        x32 = x_BTD.astype(jnp.float32)
        normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return scale_D * normed.astype(x_BTD.dtype)


def rope(x_BTNE, positions_BT, theta: float):
    """Rotary embedding in the rotate-half layout, with angles in float32."""
    half = x_BTNE.shape[-1] // 2
    inv_freq = 1.0 / theta ** (jnp.arange(half, dtype=jnp.float32) / half)
    angles_BTE = positions_BT.astype(jnp.float32)[..., None] * inv_freq
    cos, sin = jnp.cos(angles_BTE)[:, :, None, :], jnp.sin(angles_BTE)[:, :, None, :]
    x1, x2 = jnp.split(x_BTNE.astype(jnp.float32), 2, axis=-1)
    rotated = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return rotated.astype(x_BTNE.dtype)


class Attention(nn.Module):
    config: ModelConfig

    @nn.compact
    def __call__(self, x_BTD, positions_BT, context_kv, context_mask_BTS, block_mask_BTT):
        c = self.config
        dt = c.jnp_dtype
        D, H, K, E = c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim
        G = H // K
        wq_DHE = self.param("q", init_normal, (D, H, E), dt)
        wk_DKE = self.param("k", init_normal, (D, K, E), dt)
        wv_DKE = self.param("v", init_normal, (D, K, E), dt)
        wo_HED = self.param("o", init_normal, (H, E, D), dt)

        q_BTHE = rope(jnp.einsum("btd,dhe->bthe", x_BTD, wq_DHE), positions_BT, c.rope_theta)
        k_BTKE = rope(jnp.einsum("btd,dke->btke", x_BTD, wk_DKE), positions_BT, c.rope_theta)
        v_BTKE = jnp.einsum("btd,dke->btke", x_BTD, wv_DKE)

        B, T = x_BTD.shape[:2]
        q_BTKGE = q_BTHE.reshape(B, T, K, G, E)
        context_k_BSKE, context_v_BSKE = context_kv
        f32, scale = jnp.float32, E**-0.5
        scores_ctx = jnp.einsum("btkge,bske->bkgts", q_BTKGE, context_k_BSKE, preferred_element_type=f32) * scale
        scores_blk = jnp.einsum("btkge,bske->bkgts", q_BTKGE, k_BTKE, preferred_element_type=f32) * scale
        S = scores_ctx.shape[-1]
        scores = jnp.concatenate(
            [
                jnp.where(context_mask_BTS[:, None, None], scores_ctx, NEG_INF),
                jnp.where(block_mask_BTT[:, None, None], scores_blk, NEG_INF),
            ],
            axis=-1,
        )
        probs = jax.nn.softmax(scores, axis=-1).astype(dt)
        out_BTKGE = jnp.einsum("bkgts,bske->btkge", probs[..., :S], context_v_BSKE) + jnp.einsum(
            "bkgts,bske->btkge", probs[..., S:], v_BTKE
        )
        out_BTD = jnp.einsum("bthe,hed->btd", out_BTKGE.reshape(B, T, H, E), wo_HED)
        return out_BTD, (k_BTKE, v_BTKE)


class MLP(nn.Module):
    config: ModelConfig

    @nn.compact
    def __call__(self, x_BTD):
        c = self.config
        dt = c.jnp_dtype
        gate_DF = self.param("gate", init_normal, (c.hidden_size, c.intermediate_size), dt)
        up_DF = self.param("up", init_normal, (c.hidden_size, c.intermediate_size), dt)
        down_FD = self.param("down", init_normal, (c.intermediate_size, c.hidden_size), dt)
        h_BTF = nn.silu(x_BTD @ gate_DF) * (x_BTD @ up_DF)
        return h_BTF @ down_FD


class Block(nn.Module):
    config: ModelConfig

    @nn.compact
    def __call__(self, x_BTD, positions_BT, context_kv, context_mask_BTS, block_mask_BTT):
        c = self.config
        attn_out, kv = Attention(c, name="attn")(
            RMSNorm(c.rms_norm_eps, c.jnp_dtype, name="attn_norm")(x_BTD),
            positions_BT,
            context_kv,
            context_mask_BTS,
            block_mask_BTT,
        )
        h_BTD = x_BTD + attn_out
        return h_BTD + MLP(c, name="mlp")(RMSNorm(c.rms_norm_eps, c.jnp_dtype, name="mlp_norm")(h_BTD)), kv


class Transformer(nn.Module):
    config: ModelConfig

    def setup(self):
        c = self.config
        self.embedding = self.param("embed", init_normal, (c.vocab_size, c.hidden_size), c.jnp_dtype)
        self.blocks = [Block(c, name=f"layer_{i}") for i in range(c.num_layers)]
        self.final_norm = RMSNorm(c.rms_norm_eps, c.jnp_dtype)
        if not c.tie_embeddings:
            self.lm_head = self.param("lm_head", init_normal, (c.hidden_size, c.vocab_size), c.jnp_dtype)

    def __call__(
        self,
        tokens_BT,
        positions_BT,
        context_kvs: Sequence,
        context_mask_BTS,
        block_mask_BTT,
        layers: Sequence[int],
    ):
        """Runs `layers` in order; returns final-normed hidden states and each layer's block K/V.

        `context_kvs[i]` is the context for the i-th entry of `layers`.
        """
        x_BTD = jnp.take(self.embedding, tokens_BT, axis=0)
        block_kvs = []
        for layer, context_kv in zip(layers, context_kvs, strict=True):
            x_BTD, kv = self.blocks[layer](x_BTD, positions_BT, context_kv, context_mask_BTS, block_mask_BTT)
            block_kvs.append(kv)
        return self.final_norm(x_BTD), tuple(block_kvs)

    def logits(self, hidden_BTD):
        """Float32 logits over the whole embedding table (the mask row included)."""
        head_DV = self.embedding.T if self.config.tie_embeddings else self.lm_head
        return jnp.einsum("btd,dv->btv", hidden_BTD, head_DV, preferred_element_type=jnp.float32)

    def init_all(self, tokens_BT):
        """Touches every parameter, for `init`."""
        c = self.config
        B, T = tokens_BT.shape
        empty = jnp.zeros((B, 0, c.num_kv_heads, c.head_dim), c.jnp_dtype)
        positions = jnp.broadcast_to(jnp.arange(T), (B, T))
        hidden, _ = self(
            tokens_BT,
            positions,
            [(empty, empty)] * c.num_layers,
            jnp.zeros((B, T, 0), bool),
            jnp.tril(jnp.ones((B, T, T), bool)),
            c.all_layers,
        )
        return self.logits(hidden)


def init_params(config: ModelConfig, rng: jax.Array):
    """Random parameters (normal, std 0.02), for tests and new models."""
    tokens = jnp.zeros((1, 1), jnp.int32)
    return Transformer(config).init(rng, tokens, method=Transformer.init_all)["params"]


def abstract_params(config: ModelConfig):
    """Parameter shapes and dtypes, allocating nothing."""
    return jax.eval_shape(lambda: init_params(config, jax.random.key(0)))


def run_layers(params, config: ModelConfig, tokens_BT, positions_BT, context_kvs, context_mask, block_mask, layers):
    return Transformer(config).apply(
        {"params": params}, tokens_BT, positions_BT, context_kvs, context_mask, block_mask, tuple(layers)
    )


def lm_logits(params, config: ModelConfig, hidden_BTD):
    return Transformer(config).apply({"params": params}, hidden_BTD, method=Transformer.logits)
