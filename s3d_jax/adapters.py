"""The draft-only LoRA adapters: low-rank updates that only draft passes add to a projection, so the
verifier stays the original model (docs/design.md, section 5)."""

from __future__ import annotations

from collections.abc import Callable

import flax.linen as nn
import jax.numpy as jnp
import numpy as np

from s3d_jax import ops


class DraftLoRA(nn.Module):
    """A low-rank update `x A B` that only draft passes apply, so the verifier stays the original model.

    A fused projection (`slot_parts`) has an adapter per part, as separate projections would, in two
    products: the parts' A factors side by side, then their B factors as one product batched over
    the output's slots along `slot_axis`, each slot reading its own part's low-rank vector (a KV
    group's G query heads read q's). B holds no zeros, so a draft reads no more bytes than separate
    adapters would. The products go through the few-row kernel as the projections' do: in bfloat16,
    XLA's dot made a draft of 4 cost 0.88 plain steps against 0.80 (docs/cpu.md), and its batched
    dot for B cost a float32 draft of 4 about 1.8 ms more (docs/cpu.md, "The loop's own operations").
    A is read in the projection's own kernel call (`ops.matmuls`): 60 fewer calls per draft."""

    rank: int
    layers: int  # a stack of adapters, one per draft layer (`model.linear`), of which a call reads entry `entry`
    in_shape: tuple[int, ...]
    out_shape: tuple[int, ...]
    dtype: jnp.dtype
    precision: str
    init_a: Callable  # A's initializer (the model's own); B starts at zero, so an adapter starts as a no-op
    slot_parts: tuple[int, ...] | None = None  # the part of each slot of a fused output; None: one part
    slot_axis: int = 0
    activations: str = "float32"  # how the projection's product reads x (`ModelConfig.activations`)

    @nn.compact
    def __call__(self, x, layer, entry, projection):
        """`(x @ projection[layer], x A[entry] B[entry])`: the projection's product and the update, x's
        products with the projection and with A in one call (`ops.matmuls`)."""
        n_in, r, L = len(self.in_shape), self.rank, self.layers
        parts = 1 if self.slot_parts is None else max(self.slot_parts) + 1
        a = self.param("a", self.init_a, (L, *self.in_shape, parts * r), self.dtype)
        y, low = ops.matmuls(x, (projection, a), n_in, self.precision, at=(layer, entry), activations=self.activations)
        if self.slot_parts is None:
            b = self.param("b", nn.initializers.zeros, (L, r, *self.out_shape), self.dtype)
            return y, ops.matmul(low, b, 1, self.precision, at=entry)
        slot_shape = self.out_shape[: self.slot_axis] + self.out_shape[self.slot_axis + 1 :]
        b = self.param("b", nn.initializers.zeros, (L, len(self.slot_parts), r, *slot_shape), self.dtype)
        low = low.reshape(*low.shape[:-1], parts, r)[..., np.asarray(self.slot_parts), :]  # [.., slots, r]
        lead = low.shape[:-2]
        low_SMR = jnp.moveaxis(low, -2, 0).reshape(len(self.slot_parts), -1, r)
        update = ops.batched_matmul(low_SMR, b.reshape(*b.shape[:3], -1), entry, self.precision)  # [slots, M, slot size]
        update = update.reshape(len(self.slot_parts), *lead, *slot_shape)
        return y, jnp.moveaxis(update, 0, len(lead) + self.slot_axis).astype(x.dtype)
