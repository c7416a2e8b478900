"""The K/V write's entry point: one layer of the pool takes the step's new rows, written by the implementation
``impl`` picks (``kernels/dispatch.py``) on this platform."""

from __future__ import annotations

import jax
from jaxserve.kernels.attention.batch import POOL_LAYOUTS, AttentionBatch
from jaxserve.kernels.cpu import ffi
from jaxserve.kernels.dispatch import choose_kernel
from jaxserve.kernels.kv_write import cpu as kv_write_cpu
from jaxserve.kernels.kv_write.pallas import write_kv_gpu, write_kv_tpu, write_latent
from jaxserve.kernels.kv_write.reference import write_kv_ref


def write_kv(
    k_cache: jax.Array,
    v_cache: jax.Array,
    layer: jax.Array | int,
    new_k: jax.Array,
    new_v: jax.Array,
    batch: AttentionBatch,
    *,
    impl: str = "auto",
    interpret: bool | None = None,
    backend: str | None = None,
    layout: str = "tokens_heads",
) -> tuple[jax.Array, jax.Array]:
    """Writes the step's new K/V into one layer of the pool.

    Args:
      k_cache, v_cache: [L, num_pages, page_size, num_kv_heads, head_dim], the whole pool (or ``Int8Pages``).
      layer: int32 scalar (may be traced), the layer to write.
      new_k, new_v: [T, num_kv_heads, head_dim], cast to the cache dtype (``Int8Pages``: quantized per row). A
        latent pool k_cache [L, num_pages, page_size, width] takes new_k [T, width]; v_cache and new_v are unused.
      batch: the step's ``AttentionBatch``; the write reads its slot_mapping: [T] int32, ``page * page_size +
        offset`` of token t; negative slots (padding) write nothing.
      impl, backend, interpret: see ``kernels/dispatch.py`` ("xla" on the CPU: the C++ in-place write when it is
        available, else the reference scatter).
      layout: the pools', as for ``ragged_paged_attention``; "heads_tokens" is written by XLA's scatter (in place
        on a donated pool), which Mosaic's row DMAs cannot do into a tiled (page_size, head_dim) page.

    Returns:
      The updated (k_cache, v_cache). Donate the caches to the enclosing jit so that the update happens in place
      (without donation XLA copies the pool).

    Raises:
      ValueError: bad impl/backend; the Pallas and C++ writes also refuse new rows that do not fit the caches.
    """
    kernel, interp = choose_kernel(impl, backend, interpret)
    if k_cache.ndim == 4:  # a latent pool (MLA): new_k's rows [T, width] written, v_cache left as it is
        return write_latent(k_cache, layer, new_k, batch, kernel=kernel, interpret=interp), v_cache
    if layout not in POOL_LAYOUTS:
        raise ValueError(f"layout must be one of {POOL_LAYOUTS}, got {layout!r}")
    if layout == "heads_tokens":
        return write_kv_ref(k_cache, v_cache, layer, new_k, new_v, batch, layout=layout)
    if kernel == "xla" and jax.default_backend() == "cpu" and ffi.available():
        return kv_write_cpu.write_kv(k_cache, v_cache, layer, new_k, new_v, batch)  # in place, in C++
    if kernel in ("reference", "xla"):
        return write_kv_ref(k_cache, v_cache, layer, new_k, new_v, batch)
    fn = write_kv_gpu if kernel == "gpu" else write_kv_tpu
    return fn(k_cache, v_cache, layer, new_k, new_v, batch, interpret=interp)
