"""The draft-only LoRA adapters: low-rank updates that only draft passes add to a projection, so the
verifier stays the original model (docs/design.md, section 5)."""

from __future__ import annotations

from collections.abc import Callable

import flax.linen as nn
import jax.numpy as jnp
import numpy as np

from s3d_jax import few_rows


class DraftLoRA(nn.Module):
    """A low-rank update `x A B` that only draft passes apply, so the verifier stays the original model.

    A fused projection (`slot_parts`) has an adapter per part, as separate projections would, in two
    products: the parts' A factors side by side, then their B factors as one product batched over
    the output's slots along `slot_axis`, each slot reading its own part's low-rank vector (a KV
    group's G query heads read q's). B holds no zeros, so a draft reads no more bytes than separate
    adapters would. The products go through the few-row kernel as the projections' do: in bfloat16,
    XLA's dot made a draft of 4 cost 0.88 plain steps against 0.80 (docs/cpu.md), and its batched
    dot for B cost a float32 draft of 4 about 1.8 ms more (docs/cpu.md, "The loop's own operations")."""

    rank: int
    layers: int  # a stack of adapters, one per layer (`model.linear`), of which a call reads entry `layer`
    in_shape: tuple[int, ...]
    out_shape: tuple[int, ...]
    dtype: jnp.dtype
    precision: str
    init_a: Callable  # A's initializer (the model's own); B starts at zero, so an adapter starts as a no-op
    slot_parts: tuple[int, ...] | None = None  # the part of each slot of a fused output; None: one part
    slot_axis: int = 0

    @nn.compact
    def __call__(self, x, layer):
        n_in, r, L = len(self.in_shape), self.rank, self.layers
        if self.slot_parts is None:
            a = self.param("a", self.init_a, (L, *self.in_shape, r), self.dtype)
            b = self.param("b", nn.initializers.zeros, (L, r, *self.out_shape), self.dtype)
            return few_rows.matmul(few_rows.matmul(x, a, n_in, self.precision, at=layer), b, 1, self.precision, at=layer)
        parts = max(self.slot_parts) + 1
        slot_shape = self.out_shape[: self.slot_axis] + self.out_shape[self.slot_axis + 1 :]
        a = self.param("a", self.init_a, (L, *self.in_shape, parts * r), self.dtype)
        b = self.param("b", nn.initializers.zeros, (L, len(self.slot_parts), r, *slot_shape), self.dtype)
        low = few_rows.matmul(x, a, n_in, self.precision, at=layer)
        low = low.reshape(*low.shape[:-1], parts, r)[..., np.asarray(self.slot_parts), :]  # [.., slots, r]
        lead = low.shape[:-2]
        low_SMR = jnp.moveaxis(low, -2, 0).reshape(len(self.slot_parts), -1, r)
        y = few_rows.batched_matmul(low_SMR, b.reshape(*b.shape[:3], -1), layer, self.precision)  # [slots, M, slot size]
        y = y.reshape(len(self.slot_parts), *lead, *slot_shape)
        return jnp.moveaxis(y, 0, len(lead) + self.slot_axis).astype(x.dtype)
