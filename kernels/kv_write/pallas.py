"""Writing the step's new K/V into the page pool, in place: Pallas kernels for GPU and TPU.

Both kernels alias the caches to their outputs (``input_output_aliases``), so with a donated cache XLA
updates it in place and only the T new rows move. Contract: ``reference.write_kv_ref`` -- token t goes
to ``batch.slot_mapping[t] = page * page_size + offset`` of layer ``layer``; a negative slot writes nothing.
Two tokens with the same slot is undefined (as in the reference, where the scatter order is unspecified).
An ``Int8Pages`` pool gets its new rows quantized as the reference quantizes them (``quantize_rows``, in XLA: T
rows), and the same kernel writes the values and the scales.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas import triton as plgpu
from jaxserve.kernels._common import Int8Pages, cdiv, is_int8_pages, next_pow2, quantize_rows, settle_tpu_interpret
from jaxserve.kernels.attention.batch import AttentionBatch, write_slots
from jaxserve.kernels.kv_write.reference import write_latent_ref


def _validate(k_cache, v_cache, new_k, new_v, batch):
    """``batch.slot_mapping``, once the shapes are checked to fit the caches (ValueError otherwise)."""
    slot_mapping = write_slots(batch)
    if is_int8_pages(k_cache) != is_int8_pages(v_cache):
        raise ValueError("k_cache and v_cache must both be Int8Pages or both plain pools")
    if k_cache.ndim != 5 or k_cache.shape != v_cache.shape:
        raise ValueError(f"caches must be [L, pages, page_size, kv_heads, head_dim]: {k_cache.shape} {v_cache.shape}")
    if new_k.shape != new_v.shape or new_k.shape[1:] != k_cache.shape[3:]:
        raise ValueError(f"new_k/new_v {new_k.shape}/{new_v.shape} must be [T, {k_cache.shape[3]}, {k_cache.shape[4]}]")
    if slot_mapping.shape != new_k.shape[:1]:
        raise ValueError(f"slot_mapping must be [{new_k.shape[0]}], got {slot_mapping.shape}")
    return slot_mapping


def _pools_and_rows(k_cache, v_cache, new_k, new_v):
    """(pools, rows) for the row writers: the K and V pools and their new rows; for ``Int8Pages`` the values and
    the scales of each, the new rows quantized by ``quantize_rows`` (the reference's rounding)."""
    if not is_int8_pages(k_cache):
        return (k_cache, v_cache), (new_k.astype(k_cache.dtype), new_v.astype(v_cache.dtype))
    (kq, ks), (vq, vs) = quantize_rows(new_k), quantize_rows(new_v)
    return (k_cache.values, v_cache.values, k_cache.scales, v_cache.scales), (kq, vq, ks, vs)


def _as_caches(like, pools):
    """The row writers' outputs back as (k_cache, v_cache) of ``like``'s kind."""
    if is_int8_pages(like):
        return Int8Pages(pools[0], pools[2]), Int8Pages(pools[1], pools[3])
    return tuple(pools)


# ---------------------------------------------------------------------------------------------- GPU (Triton)
def _gpu_kernel(slots_ref, layer_ref, *refs, block_t, num_pools):
    """Rows of ``num_pools`` sources into their pools: [T, K, H] rows into [L, P, S, K, H] (K/V values) or [T, K]
    into [L, P, S, K] (an int8 pool's scales). refs: the sources, the aliased pools (unused), the outputs."""
    b, head = pl.program_id(0), pl.program_id(1)
    srcs, dsts = refs[:num_pools], refs[2 * num_pools :]
    num_tokens = srcs[0].shape[0]
    num_pages, page_size = dsts[0].shape[1], dsts[0].shape[2]
    t = b * block_t + jnp.arange(block_t, dtype=jnp.int32)
    t_c = jnp.minimum(t, num_tokens - 1)
    slot = plgpu.load(slots_ref.at[t_c])
    ok = (t < num_tokens) & (slot >= 0)
    # Skipped rows address page num_pages (out of range): masked on the GPU, dropped by the interpreter.
    page = jnp.where(ok, slot // page_size, num_pages)
    off = jnp.where(ok, slot % page_size, 0)
    layer = layer_ref[0]
    for src, dst in zip(srcs, dsts, strict=True):
        if src.ndim == 2:  # one value per (token, head)
            val = plgpu.load(src.at[t_c, head])
            plgpu.store(dst.at[layer, page, off, head], val.astype(dst.dtype), mask=ok)
            continue
        dims = jnp.arange(src.shape[2], dtype=jnp.int32)[None, :]
        val = plgpu.load(src.at[t_c[:, None], head, dims])
        plgpu.store(
            dst.at[layer, page[:, None], off[:, None], head, dims],
            val.astype(dst.dtype),
            mask=jnp.broadcast_to(ok[:, None], val.shape),
        )


@functools.partial(jax.jit, static_argnames=("block_t", "interpret"))
def _write_rows_gpu(pools, layer, rows, slot_mapping, *, block_t, interpret):
    num_tokens, num_kv_heads = rows[0].shape[:2]
    n = len(pools)
    return pl.pallas_call(
        functools.partial(_gpu_kernel, block_t=block_t, num_pools=n),
        out_shape=tuple(jax.ShapeDtypeStruct(p.shape, p.dtype) for p in pools),
        grid=(cdiv(num_tokens, block_t), num_kv_heads),
        input_output_aliases={2 + n + i: i for i in range(n)},
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=1),
        interpret=interpret,
        name="write_kv_gpu",
    )(slot_mapping, layer.reshape(1), *rows, *pools)


def write_kv_gpu(
    k_cache, v_cache, layer, new_k, new_v, batch: AttentionBatch, *, block_t: int = 16, interpret: bool = False
):
    """In-place scatter of new K/V rows into one layer of the page pool (Pallas Triton); ``write_kv_ref``'s contract.

    Args:
      k_cache, v_cache, layer, new_k, new_v, batch: as in ``reference.write_kv_ref`` (its ``slot_mapping``).
      block_t: tokens per program (rounded to a power of two, at most the step's).
      interpret: run in the Pallas interpreter (any backend, slow).

    Returns:
      The updated (k_cache, v_cache): in place only when the caller donates the caches (the runner's jitted step
      does); otherwise XLA copies them first.

    Raises:
      ValueError: shapes that do not fit the caches.
    """
    slot_mapping = _validate(k_cache, v_cache, new_k, new_v, batch)
    if new_k.shape[0] == 0:
        return k_cache, v_cache
    block_t = min(next_pow2(block_t), next_pow2(new_k.shape[0]))
    pools, rows = _pools_and_rows(k_cache, v_cache, new_k, new_v)
    out = _write_rows_gpu(
        pools, jnp.asarray(layer, jnp.int32), rows, slot_mapping.astype(jnp.int32), block_t=block_t, interpret=interpret
    )
    return _as_caches(k_cache, out)


# ---------------------------------------------------------------------------------------------- TPU (Mosaic)
def _tpu_kernel(layer_ref, slots_ref, *refs, block_t, page_size, num_pools):
    """Row DMAs of ``num_pools`` sources into their pools (refs: sources, aliased pools (unused), outputs in HBM,
    the DMA semaphore): row i of a source block ([K, H] values or [K] scales) to ``pool[layer, page, offset]``."""
    b = pl.program_id(0)
    layer = layer_ref[0]
    srcs, dsts, sem = refs[:num_pools], refs[2 * num_pools : 3 * num_pools], refs[-1]

    def row_copies(i):
        slot = slots_ref[b * block_t + i]
        page, off = jnp.maximum(slot, 0) // page_size, jnp.maximum(slot, 0) % page_size
        return slot >= 0, [
            pltpu.make_async_copy(src.at[i], dst.at[layer, page, off], sem) for src, dst in zip(srcs, dsts, strict=True)
        ]

    def start(i, carry):
        ok, cps = row_copies(i)
        for c in cps:
            pl.when(ok)(c.start)
        return carry

    def wait(i, carry):
        ok, cps = row_copies(i)
        for c in cps:
            pl.when(ok)(c.wait)
        return carry

    # All rows of the block in flight at once, then drain: the DMA engine overlaps them.
    jax.lax.fori_loop(0, block_t, start, 0)
    jax.lax.fori_loop(0, block_t, wait, 0)


@functools.partial(jax.jit, static_argnames=("block_t", "interpret"))
def _write_rows_tpu(pools, layer, rows, slot_mapping, *, block_t, interpret):
    num_tokens = rows[0].shape[0]
    n = len(pools)
    padded = cdiv(num_tokens, block_t) * block_t
    rows = [
        jnp.pad(r.astype(p.dtype), ((0, padded - num_tokens),) + ((0, 0),) * (r.ndim - 1))
        for r, p in zip(rows, pools, strict=True)
    ]
    slots = jnp.pad(slot_mapping, (0, padded - num_tokens), constant_values=-1)
    row_specs = [pl.BlockSpec((block_t, *r.shape[1:]), lambda b, *_, nd=r.ndim: (b,) + (0,) * (nd - 1)) for r in rows]
    any_spec = pl.BlockSpec(memory_space=pl.ANY)
    if interpret:
        interpret = pltpu.InterpretParams()
    return pl.pallas_call(
        functools.partial(_tpu_kernel, block_t=block_t, page_size=pools[0].shape[2], num_pools=n),
        out_shape=tuple(jax.ShapeDtypeStruct(p.shape, p.dtype) for p in pools),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2,
            grid=(padded // block_t,),
            in_specs=row_specs + [any_spec] * n,
            out_specs=(any_spec,) * n,
            scratch_shapes=[pltpu.SemaphoreType.DMA(())],
        ),
        input_output_aliases={2 + n + i: i for i in range(n)},  # operand indices count the two scalar-prefetch ones
        compiler_params=pltpu.CompilerParams(dimension_semantics=("arbitrary",)),
        interpret=interpret,
        name="write_kv_tpu",
    )(layer.reshape(1), slots, *rows, *pools)


def write_kv_tpu(
    k_cache, v_cache, layer, new_k, new_v, batch: AttentionBatch, *, block_t: int = 16, interpret: bool = False
):
    """In-place scatter of new K/V rows into one layer of the page pool (Pallas Mosaic, row DMAs into HBM);
    ``write_kv_ref``'s contract.

    Args:
      k_cache, v_cache, layer, new_k, new_v, batch: as in ``reference.write_kv_ref`` (its ``slot_mapping``).
      block_t: tokens per program (at most the step's).
      interpret: run in Pallas' TPU interpret mode (on the CPU).

    Returns:
      The updated (k_cache, v_cache), in place when the caller donates them.

    Raises:
      ValueError: shapes that do not fit the caches.
    """
    slot_mapping = _validate(k_cache, v_cache, new_k, new_v, batch)
    if new_k.shape[0] == 0:
        return k_cache, v_cache
    block_t = max(1, min(block_t, new_k.shape[0]))
    if block_t < new_k.shape[0]:
        block_t = cdiv(block_t, 8) * 8  # a block of [block_t, K] scales: sublanes in multiples of 8
    pools, rows = _pools_and_rows(k_cache, v_cache, new_k, new_v)
    out = _write_rows_tpu(
        pools, jnp.asarray(layer, jnp.int32), rows, slot_mapping.astype(jnp.int32), block_t=block_t, interpret=interpret
    )
    return _as_caches(k_cache, settle_tpu_interpret(out, interpret))


# ---------------------------------------------------------------------------------------------- a latent pool
def write_latent(
    cache: jax.Array,
    layer,
    rows: jax.Array,
    batch: AttentionBatch,
    *,
    kernel: str = "reference",
    interpret: bool = False,
    block_t: int = 16,
) -> jax.Array:
    """Writes the step's latents rows [T, width] into one layer of a latent pool [L, num_pages, page_size, width]
    (multi-head latent attention), ``write_latent_ref``'s contract. ``kernel`` "gpu": the Triton row writer above (the
    rows as one head's), in place when the caller donates the pool. Anywhere else XLA's scatter
    (``write_latent_ref``): on a TPU it updates the donated pool in place (the AOT memory analysis shows no copy),
    where ``write_kv_tpu``'s row DMAs cannot go, since a token's row sits at an offset inside the pool's
    (page_size, width) tiles, which Mosaic does not address.

    Raises:
      ValueError: rows that do not fit the pool.
    """
    if cache.ndim != 4 or rows.ndim != 2 or rows.shape[1] != cache.shape[3]:
        raise ValueError(f"latent rows {rows.shape} must be [T, {cache.shape[-1]}] for a pool of shape {cache.shape}")
    slots = write_slots(batch)
    if slots.shape != rows.shape[:1]:
        raise ValueError(f"slot_mapping must be [{rows.shape[0]}], got {slots.shape}")
    if kernel != "gpu":
        return write_latent_ref(cache, layer, rows, batch)
    if rows.shape[0] == 0:
        return cache
    block_t = min(next_pow2(block_t), next_pow2(rows.shape[0]))
    (out,) = _write_rows_gpu(
        (cache[:, :, :, None, :],),
        jnp.asarray(layer, jnp.int32),
        (rows[:, None, :],),
        slots.astype(jnp.int32),
        block_t=block_t,
        interpret=interpret,
    )
    return out.reshape(cache.shape)
