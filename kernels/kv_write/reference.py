"""Plain-jnp reference for writing the step's new K/V into the pages of one layer: the contract of every K/V write
(the Pallas kernels of ``pallas.py``, the C++ one of ``cpu.py``); layouts in ``attention/reference.py``."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxserve.kernels._common import Int8Pages, is_int8_pages, quantize_rows
from jaxserve.kernels.attention.batch import AttentionBatch, write_slots


def write_kv_ref(
    k_cache: jax.Array,
    v_cache: jax.Array,
    layer: jax.Array | int,
    new_k: jax.Array,
    new_v: jax.Array,
    batch: AttentionBatch,
    layout: str = "tokens_heads",
) -> tuple[jax.Array, jax.Array]:
    """Scatters the step's new K/V into the pages of one layer (XLA's scatter: in place on a donated pool).

    Args:
      k_cache, v_cache: [L, num_pages, page_size, num_kv_heads, head_dim], or ``Int8Pages`` (each new row is
        quantized with ``quantize_rows``: its own scale per token and KV head).
      layer: int32 scalar (may be traced).
      new_k, new_v: [T, num_kv_heads, head_dim], cast to the cache dtype.
      batch: its ``slot_mapping`` [T], ``page * page_size + offset`` for token t; a negative slot (padding) writes
        nothing.
      layout: the pools', "tokens_heads", or "heads_tokens" ([L, num_pages, num_kv_heads, page_size, head_dim];
        plain arrays only).

    Returns:
      The updated (k_cache, v_cache).
    """
    heads_tokens = layout == "heads_tokens"
    page, offset = _pages_and_offsets(batch, k_cache.shape[1], k_cache.shape[3 if heads_tokens else 2])

    def put(cache, rows):
        if is_int8_pages(cache):
            values, scales = quantize_rows(rows)
            return Int8Pages(put(cache.values, values), put(cache.scales, scales))
        if heads_tokens:  # row t's head h to [layer, page_t, h, offset_t]
            heads = jnp.arange(cache.shape[2])[None, :]
            where = (layer, page[:, None], heads, offset[:, None])
            return cache.at[where].set(rows.astype(cache.dtype), mode="drop")
        return cache.at[layer, page, offset].set(rows.astype(cache.dtype), mode="drop")

    return put(k_cache, new_k), put(v_cache, new_v)


def write_latent_ref(cache: jax.Array, layer: jax.Array | int, rows: jax.Array, batch: AttentionBatch) -> jax.Array:
    """Scatters the step's new latents rows [T, width] into one layer of a latent pool [L, num_pages, page_size,
    width] (multi-head latent attention: one row a token, no V) at ``batch.slot_mapping`` (negative: nothing)."""
    page, offset = _pages_and_offsets(batch, *cache.shape[1:3])
    return cache.at[layer, page, offset].set(rows.astype(cache.dtype), mode="drop")


def _pages_and_offsets(batch: AttentionBatch, num_pages: int, page_size: int) -> tuple[jax.Array, jax.Array]:
    """Each new row's (page, offset in the page) from ``batch.slot_mapping``; a negative slot's page is out of
    range (``num_pages``), so a ``mode="drop"`` scatter writes nothing for it."""
    slot_mapping = write_slots(batch)
    page = jnp.where(slot_mapping >= 0, slot_mapping // page_size, num_pages)
    offset = jnp.where(slot_mapping >= 0, slot_mapping % page_size, 0)
    return page, offset
