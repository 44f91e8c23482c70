"""Static-shape KV cache and the cached forward pass.

The cache holds every layer's keys in one array `[L, B, K, S, E]` and values in one `[L, B, K, E, S]`
(the layouts attention reads without a copy, see `model.Attention`; a layer reads its own entry in
place); `lengths[b]` says how many leading
positions of row b hold valid full-model entries. A block of T tokens always runs at positions
`lengths[b] .. lengths[b] + T - 1` of its row. Entries at or past `lengths` are stale: they are
masked out and overwritten later, so speculative rejections need no rollback.
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp

from s3d_jax.config import COMPUTE_DTYPE, ModelConfig
from s3d_jax.model import causal_mask, full_pass, run_layers
from s3d_jax.ops import Context, Prefix, ordered_after


@flax.struct.dataclass
class KVCache:
    keys: jax.Array  # [L, B, K, S, E]
    values: jax.Array  # [L, B, K, E, S]
    lengths: jax.Array  # [B] int32

    @classmethod
    def zeros(cls, config: ModelConfig, batch: int, max_len: int) -> KVCache:
        L, K, E = config.num_layers, config.num_kv_heads, config.head_dim
        return cls(
            keys=jnp.zeros((L, batch, K, max_len, E), COMPUTE_DTYPE),
            values=jnp.zeros((L, batch, K, E, max_len), COMPUTE_DTYPE),
            lengths=jnp.zeros((batch,), jnp.int32),
        )

    @property
    def max_len(self) -> int:
        return self.keys.shape[3]

    def block_positions(self, block_len: int) -> jax.Array:
        return self.lengths[:, None] + jnp.arange(block_len)[None, :]

    def write(self, layers: tuple[int, ...], block_kv) -> KVCache:
        """Stores the block's keys `[n, B, K, T, E]` and values `[n, B, K, E, T]` of `layers` (in that
        order) at positions `lengths ..` of each row: one scatter each, in place."""
        keys, values = block_kv
        return self.replace(keys=_put(self.keys, keys, layers, self.lengths, 3), values=_put(self.values, values, layers, self.lengths, 4))


def _put(stack, block, layers, lengths_B, axis: int):
    """`stack [L, B, ..]` with `block [n, B, ..]` written at layers `layers` and, along `axis`, from
    each row's `lengths[b]` on (clamped into the stack, as a dynamic update is)."""
    B = block.shape[1]
    starts = jnp.clip(lengths_B, 0, stack.shape[axis] - block.shape[axis])
    index = jnp.stack(jnp.broadcast_arrays(jnp.asarray(layers, jnp.int32)[:, None], jnp.arange(B)[None, :], starts[None, :]), -1)
    numbers = jax.lax.ScatterDimensionNumbers(update_window_dims=(2, 3, 4), inserted_window_dims=(0, 1),
                                              scatter_dims_to_operand_dims=(0, 1, axis))
    return jax.lax.scatter(stack, index, block.astype(stack.dtype), numbers, indices_are_sorted=True, unique_indices=True,
                           mode=jax.lax.GatherScatterMode.PROMISE_IN_BOUNDS)


def context(cache: KVCache, block_mask_BTT) -> Context:
    """What a block at `lengths ..` attends to: the cache's slots below each row's length (a `Prefix`;
    slot s holds position s) and the block through `block_mask_BTT`. Sliding windows are left to each
    layer (`ops.attention`), which knows its own."""
    B = len(cache.lengths)
    positions_BS = jnp.broadcast_to(jnp.arange(cache.max_len), (B, cache.max_len))
    return Context(cache.keys, cache.values, positions_BS, Prefix(cache.lengths), block_mask_BTT)


def block_forward(params, config: ModelConfig, cache: KVCache, tokens_BT, layers: tuple[int, ...], draft: bool = False,
                  positions_BT=None, block_mask_BTT=None):
    """Runs `tokens` through `layers` against the cache, which it only reads; returns (final hidden
    states, each layer's block keys and values).

    The block is a causal run at positions `lengths ..` unless `positions_BT` and `block_mask_BTT` say
    otherwise (a token tree)."""
    B, T = tokens_BT.shape
    block_mask_BTT = jnp.broadcast_to(causal_mask(T), (B, T, T)) if block_mask_BTT is None else block_mask_BTT
    positions_BT = cache.block_positions(T) if positions_BT is None else positions_BT
    return run_layers(params, config, tokens_BT, positions_BT, context(cache, block_mask_BTT), layers, draft)


def cached_forward(params, config: ModelConfig, cache: KVCache, tokens_BT, layers: tuple[int, ...], write: bool, draft: bool = False,
                   positions_BT=None, block_mask_BTT=None):
    """`block_forward`, returning (final hidden states, cache). With `write`, the block's keys and
    values are stored at slots `lengths ..`; `cache.lengths` never moves here: the caller advances
    it by however many tokens it keeps.
    """
    hidden, block_kvs = block_forward(params, config, cache, tokens_BT, layers, draft, positions_BT, block_mask_BTT)
    if write:
        cache = cache.write(layers, ordered_after(hidden, block_kvs))
    return hidden, cache


def prompt_forward(params, config: ModelConfig, tokens_BT, max_len: int):
    """The prompt pass: the full model over `tokens` with nothing before them; returns (hidden states,
    a new cache of `max_len` positions holding their keys and values, `lengths` still 0). The context
    segment is empty rather than an all-zero cache, which XLA would spend seconds constant-folding."""
    hidden, block_kvs = full_pass(params, config, tokens_BT)
    return hidden, KVCache.zeros(config, tokens_BT.shape[0], max_len).write(config.all_layers, block_kvs)
