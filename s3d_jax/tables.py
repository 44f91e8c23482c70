"""Lookups in a vocabulary table `[D, V]` (the embedding, the tied or separate head, the reduced
draft head): a pass's token columns, and its scores at a row's context ids. On a CPU both go to the
few-row kernel (`few_rows.cc`) where it applies, which reads only the columns asked for; XLA's
gather everywhere else."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from s3d_jax import few_rows, quant


def column_logits(hidden_BTD, table_DV, ids_BL, counts_B, precision=None):
    """`[B, T, L]`: each row's hidden states against the columns of a vocabulary table `[D, V]` at its
    own ids, for the first `counts[b]` ids of row b that lie inside the table; the others may hold
    anything, and the caller drops them. The kernel, where it applies (a float32 table), reads only
    those ids' columns, each distinct id's once, and sets the others to 0; XLA gathers every id's
    column first, a cost that grows with L (the draft head's context is the whole token buffer,
    `docs/cpu.md`, "The loop's own operations")."""
    if few_rows.float32_handlers_apply(hidden_BTD.dtype, getattr(table_DV, "dtype", None)):
        out = jax.ShapeDtypeStruct((*hidden_BTD.shape[:2], ids_BL.shape[1]), jnp.float32)
        return jax.ffi.ffi_call(few_rows.TARGET_CONTEXT_LOGITS, out, vmap_method="sequential")(
            hidden_BTD, table_DV, ids_BL.astype(jnp.int32), counts_B.astype(jnp.int32))
    vocab = (table_DV["values"] if quant.is_quantized(table_DV) else table_DV).shape[1]
    ids_BL = jnp.clip(ids_BL, 0, vocab - 1)  # ids outside the table: scored as its last, and dropped by the caller
    return jnp.einsum("btd,dbl->btl", hidden_BTD, columns(table_DV, ids_BL), preferred_element_type=jnp.float32,
                      precision=precision)


def columns(table_DV, ids):
    """Columns `ids` (any shape) of a vocabulary table as float32 `[D, *ids.shape]` (`quant.columns`).
    A 16-bit table's come from the kernel: XLA's CPU widens the whole table before its gather and, in
    the decode loop, hoisted that out, a float32 copy of the table held for as long as the loop ran
    (docs/cpu.md, "bfloat16")."""
    if getattr(table_DV, "dtype", None) in (jnp.bfloat16, jnp.float16) and few_rows.on_one_cpu() and few_rows.available():
        return _table_columns(table_DV, ids.astype(jnp.int32))
    return quant.columns(table_DV, ids).astype(jnp.float32)


@jax.custom_jvp
def _table_columns(table_DV, ids):
    out = jax.ShapeDtypeStruct((table_DV.shape[0], *ids.shape), jnp.float32)
    return jax.ffi.ffi_call(few_rows.TARGET_TABLE_COLUMNS, out, vmap_method="sequential")(table_DV, ids)


@_table_columns.defjvp
def _table_columns_jvp(primals, tangents):  # linear in the table (a drafter's trained mask row)
    (table, ids), (dtable, _) = primals, tangents
    return _table_columns(table, ids), jnp.take(dtable, ids, axis=1).astype(jnp.float32)
