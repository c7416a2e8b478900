"""The C++ K/V write for the CPU (``cpu/kv_write.cc``, built and registered by ``cpu/ffi.py``): new K/V rows into
the pool in place (into an ``Int8Pages`` pool: the rows quantized with ``quantize_rows``, values and scales each in
place)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxserve.kernels._common import Int8Pages, int8_pools, quantize_rows
from jaxserve.kernels.attention.batch import AttentionBatch, write_slots
from jaxserve.kernels.cpu import ffi


def write_kv(k_cache, v_cache, layer, new_k, new_v, batch: AttentionBatch) -> tuple:
    """``reference.write_kv_ref`` in place: the caches are aliased to the outputs, so inside a jit that donates
    them only the new rows are written (without donation XLA copies the pool first, as for any aliased call).

    ``Int8Pages`` caches give ``Int8Pages``: the new rows are quantized (``quantize_rows``, T rows in jnp), then the
    values and the scales are each written in place by the same byte-copying target (the scales as [T, K] rows
    into [L, P, S, K])."""
    ffi.require("the C++ K/V write")
    if new_k.shape != new_v.shape or new_k.shape[1:] != k_cache.shape[3:] or k_cache.shape != v_cache.shape:
        raise ValueError(f"write_kv: new rows {new_k.shape}/{new_v.shape} do not fit caches {k_cache.shape}")
    slot_mapping = write_slots(batch)
    if int8_pools(k_cache, v_cache, "write_kv"):
        kq, ks = quantize_rows(new_k)
        vq, vs = quantize_rows(new_v)
        values = _write_rows(k_cache.values, v_cache.values, layer, kq, vq, slot_mapping)
        scales = _write_rows(k_cache.scales, v_cache.scales, layer, ks, vs, slot_mapping)
        return Int8Pages(values[0], scales[0]), Int8Pages(values[1], scales[1])
    return _write_rows(k_cache, v_cache, layer, new_k, new_v, slot_mapping)


def _write_rows(k_cache, v_cache, layer, new_k, new_v, slot_mapping) -> tuple[jax.Array, jax.Array]:
    """The C++ write of [T, K, H] rows into two [L, P, S, K, H] arrays, or [T, K] into [L, P, S, K] (any 1-, 2- or
    4-byte dtype), aliased."""
    out = (jax.ShapeDtypeStruct(k_cache.shape, k_cache.dtype), jax.ShapeDtypeStruct(v_cache.shape, v_cache.dtype))
    call = jax.ffi.ffi_call(ffi.WRITE_TARGET, out, input_output_aliases={0: 0, 1: 1}, vmap_method="sequential")
    return call(
        k_cache,
        v_cache,
        jnp.asarray(layer, jnp.int32),
        new_k.astype(k_cache.dtype),
        new_v.astype(v_cache.dtype),
        jnp.asarray(slot_mapping, jnp.int32),
    )
