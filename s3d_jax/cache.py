"""Static-shape KV cache and the cached forward pass.

Per layer the cache holds keys `[B, K, S, E]` and values `[B, K, E, S]` (the layouts attention reads
without a copy, see `model.Attention`); `lengths[b]` says how many leading
positions of row b hold valid full-model entries. A block of T tokens always runs at positions
`lengths[b] .. lengths[b] + T - 1` of its row. Entries at or past `lengths` are stale: they are
masked out and overwritten later, so speculative rejections need no rollback.
"""

from __future__ import annotations

from collections.abc import Sequence

import flax.struct
import jax
import jax.numpy as jnp

from s3d_jax.config import COMPUTE_DTYPE, ModelConfig
from s3d_jax.model import Prefix, causal_mask, full_pass, run_layers


@flax.struct.dataclass
class KVCache:
    keys: tuple  # per layer [B, K, S, E]
    values: tuple  # per layer [B, K, E, S]
    lengths: jax.Array  # [B] int32

    @classmethod
    def zeros(cls, config: ModelConfig, batch: int, max_len: int) -> KVCache:
        K, E, layers = config.num_kv_heads, config.head_dim, range(config.num_layers)
        return cls(
            keys=tuple(jnp.zeros((batch, K, max_len, E), COMPUTE_DTYPE) for _ in layers),
            values=tuple(jnp.zeros((batch, K, E, max_len), COMPUTE_DTYPE) for _ in layers),
            lengths=jnp.zeros((batch,), jnp.int32),
        )

    @property
    def max_len(self) -> int:
        return self.keys[0].shape[2]

    def block_positions(self, block_len: int) -> jax.Array:
        return self.lengths[:, None] + jnp.arange(block_len)[None, :]

    def write(self, layers: Sequence[int], block_kvs) -> KVCache:
        """Stores each layer's block keys and values at positions `lengths ..` of its row."""
        def put(axis):  # per row: the block goes to positions lengths[b] .. along `axis`
            return jax.vmap(lambda buf, block, at: jax.lax.dynamic_update_slice_in_dim(buf, block.astype(buf.dtype), at, axis=axis))

        keys, values = list(self.keys), list(self.values)
        for layer, (k, v) in zip(layers, block_kvs, strict=True):
            keys[layer] = put(1)(keys[layer], k, self.lengths)
            values[layer] = put(2)(values[layer], v, self.lengths)
        return self.replace(keys=tuple(keys), values=tuple(values))


def attention_masks(lengths_B, block_len: int):
    """Masks for a block at `lengths ..`: the cached context (a `Prefix`: slots below each row's length)
    and the block `[B, T, T]`. Sliding windows are left to each layer (`model.Attention`), which knows its own."""
    return Prefix(lengths_B), jnp.broadcast_to(causal_mask(block_len), (len(lengths_B), block_len, block_len))


def block_forward(params, config: ModelConfig, cache: KVCache, tokens_BT, layers: Sequence[int], draft: bool = False,
                  positions_BT=None, block_mask_BTT=None):
    """Runs `tokens` through `layers` against the cache, which it only reads; returns (final hidden
    states, each layer's block keys and values).

    The block is a causal run at positions `lengths ..` unless `positions_BT` and `block_mask_BTT` say
    otherwise (a token tree)."""
    T = tokens_BT.shape[1]
    context_mask, block_mask = attention_masks(cache.lengths, T)
    block_mask = block_mask if block_mask_BTT is None else block_mask_BTT
    positions_BT = cache.block_positions(T) if positions_BT is None else positions_BT
    contexts = [(cache.keys[i], cache.values[i]) for i in layers]
    context_positions = jnp.broadcast_to(jnp.arange(cache.max_len), (tokens_BT.shape[0], cache.max_len))  # slot s holds position s
    return run_layers(params, config, tokens_BT, positions_BT, contexts, context_positions, context_mask, block_mask, layers, draft)


def cached_forward(params, config: ModelConfig, cache: KVCache, tokens_BT, layers: Sequence[int], write: bool, draft: bool = False,
                   positions_BT=None, block_mask_BTT=None):
    """`block_forward`, returning (final hidden states, cache). With `write`, the block's keys and
    values are stored at slots `lengths ..`; `cache.lengths` never moves here: the caller advances
    it by however many tokens it keeps.
    """
    hidden, block_kvs = block_forward(params, config, cache, tokens_BT, layers, draft, positions_BT, block_mask_BTT)
    if write:
        cache = cache.write(layers, after(hidden, block_kvs))
    return hidden, cache


def after(output, block_kvs):
    """`block_kvs`, made to depend on a pass's `output`, which every layer's attention over the cache precedes.
    A block's keys and values do not depend on its layer's attention, so without this XLA cannot
    order the cache's reads before its writes and copies every layer's cache on every pass (the cost
    of a step then grows with the cache's allocated length). Adding zero keeps every value exact."""
    zero = (jnp.sum(output) > 0).astype(jnp.float32) * 0  # never NaN, and XLA cannot fold it away
    return jax.tree.map(lambda x: x + zero.astype(x.dtype), block_kvs)


def prompt_forward(params, config: ModelConfig, tokens_BT, max_len: int):
    """The prompt pass: the full model over `tokens` with nothing before them; returns (hidden states,
    a new cache of `max_len` positions holding their keys and values, `lengths` still 0). The context
    segment is empty rather than an all-zero cache, which XLA would spend seconds constant-folding."""
    hidden, block_kvs = full_pass(params, config, tokens_BT)
    return hidden, KVCache.zeros(config, tokens_BT.shape[0], max_len).write(config.all_layers, block_kvs)
