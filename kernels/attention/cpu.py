"""The C++ ragged paged attention for the CPU (``cpu/attention.cc``, built and registered by ``cpu/ffi.py``).

``paged_attention`` computes every sequence's query tokens (prefill chunks and decode tokens alike) with the
contract of ``reference.ragged_paged_attention_ref``; ``ragged_paged_attention_xla`` hands its whole call to it on
the CPU when the caches are float32, bfloat16 or fp8 arrays, or ``Int8Pages`` (int8 values and one float32 scale per
token and KV head: a second target that also takes the scales).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jaxserve.kernels._common import FP8_DTYPES, INT8, int8_pools
from jaxserve.kernels.attention.batch import AttentionBatch, int32_metadata
from jaxserve.kernels.cpu import ffi

# What the C++ attention reads as plain arrays: float32, bfloat16, and fp8 pools (stored without scales).
CACHE_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16)) + FP8_DTYPES


def serves(dtype) -> bool:
    """Whether the C++ kernels apply to a pool of this dtype on the current backend (built or not: see
    ``cpu.ffi.available``). int8 means an ``Int8Pages`` pool (its values' dtype)."""
    dtype = jnp.dtype(dtype)
    return (dtype in CACHE_DTYPES or dtype == INT8) and jax.default_backend() == "cpu"


def paged_attention(
    q,
    k_cache,
    v_cache,
    layer,
    batch: AttentionBatch,
    *,
    sm_scale: float,
    sliding_window=0,
    soft_cap: float | None,
    sinks: jax.Array | None = None,
) -> jax.Array:
    """[T, Nq, H] float32 ragged paged attention (``reference.ragged_paged_attention_ref``'s contract): every
    sequence's query tokens, zeros for padding tokens. float32, bfloat16 or fp8 caches (one dtype for both), or two
    ``Int8Pages`` (each row widened times its scale); products and softmax in float32; ``sliding_window`` <= 0 means
    no window; ``sinks`` [Nq] the attention sinks' logits (None: none)."""
    ffi.require("the C++ paged attention")
    int8 = int8_pools(k_cache, v_cache, "the C++ paged attention")
    if not int8 and (k_cache.dtype != v_cache.dtype or k_cache.dtype not in CACHE_DTYPES):
        raise ValueError(
            f"the C++ paged attention needs float32, bfloat16 or fp8 caches (or Int8Pages), got "
            f"{k_cache.dtype}/{v_cache.dtype}"
        )
    if int8 and (k_cache.scales.dtype != jnp.float32 or v_cache.scales.dtype != jnp.float32):
        raise ValueError(f"Int8Pages scales must be float32, got {k_cache.scales.dtype}/{v_cache.scales.dtype}")
    i32 = functools.partial(jnp.asarray, dtype=jnp.int32)
    out = jax.ShapeDtypeStruct(q.shape, jnp.float32)
    caches = (k_cache.values, v_cache.values, k_cache.scales, v_cache.scales) if int8 else (k_cache, v_cache)
    call = jax.ffi.ffi_call(ffi.INT8_TARGET if int8 else ffi.TARGET, out, vmap_method="sequential")
    return call(
        q.astype(jnp.float32),
        *caches,
        i32(layer),
        *int32_metadata(batch),
        i32(sliding_window),
        jnp.zeros((0,), jnp.float32) if sinks is None else jnp.asarray(sinks, jnp.float32).reshape(q.shape[1]),
        sm_scale=np.float32(sm_scale),
        soft_cap=np.float32(0.0 if soft_cap is None else soft_cap),
    )
