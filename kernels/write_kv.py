"""Writing the step's new K/V into the page pool, in place: Pallas kernels for GPU and TPU.

Both kernels alias the caches to their outputs (``input_output_aliases``), so with a donated cache XLA
updates it in place and only the T new rows move. Contract: ``reference.write_kv_ref`` -- token t goes
to ``slot_mapping[t] = page * page_size + offset`` of layer ``layer``; a negative slot writes nothing.
Two tokens with the same slot is undefined (as in the reference, where the scatter order is unspecified).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas import triton as plgpu

from jaxserve.kernels._common import settle_tpu_interpret
from jaxserve.utils import cdiv, next_pow2


def _validate(k_cache, v_cache, new_k, new_v, slot_mapping):
    if k_cache.ndim != 5 or k_cache.shape != v_cache.shape:
        raise ValueError(f"caches must be [L, pages, page_size, kv_heads, head_dim]: {k_cache.shape} {v_cache.shape}")
    if new_k.shape != new_v.shape or new_k.shape[1:] != k_cache.shape[3:]:
        raise ValueError(f"new_k/new_v {new_k.shape}/{new_v.shape} must be [T, {k_cache.shape[3]}, {k_cache.shape[4]}]")
    if slot_mapping.shape != new_k.shape[:1]:
        raise ValueError(f"slot_mapping must be [{new_k.shape[0]}], got {slot_mapping.shape}")


# ---------------------------------------------------------------------------------------------- GPU (Triton)
def _gpu_kernel(slots_ref, layer_ref, new_k_ref, new_v_ref, _k_in, _v_in, k_ref, v_ref, *, block_t):
    b, head = pl.program_id(0), pl.program_id(1)
    num_tokens, _, head_dim = new_k_ref.shape
    num_pages, page_size = k_ref.shape[1], k_ref.shape[2]
    t = b * block_t + jnp.arange(block_t, dtype=jnp.int32)
    t_c = jnp.minimum(t, num_tokens - 1)
    slot = plgpu.load(slots_ref.at[t_c])
    ok = (t < num_tokens) & (slot >= 0)
    # Skipped rows address page num_pages (out of range): masked on the GPU, dropped by the interpreter.
    page = jnp.where(ok, slot // page_size, num_pages)[:, None]
    off = jnp.where(ok, slot % page_size, 0)[:, None]
    dims = jnp.arange(head_dim, dtype=jnp.int32)[None, :]
    mask = jnp.broadcast_to(ok[:, None], (block_t, head_dim))
    layer = layer_ref[0]
    for src, dst in ((new_k_ref, k_ref), (new_v_ref, v_ref)):
        val = plgpu.load(src.at[t_c[:, None], head, dims])
        plgpu.store(dst.at[layer, page, off, head, dims], val.astype(dst.dtype), mask=mask)


@functools.partial(jax.jit, static_argnames=("block_t", "interpret"))
def _write_kv_gpu(k_cache, v_cache, layer, new_k, new_v, slot_mapping, *, block_t, interpret):
    num_tokens, num_kv_heads, _ = new_k.shape
    return pl.pallas_call(
        functools.partial(_gpu_kernel, block_t=block_t),
        out_shape=(jax.ShapeDtypeStruct(k_cache.shape, k_cache.dtype),
                   jax.ShapeDtypeStruct(v_cache.shape, v_cache.dtype)),
        grid=(cdiv(num_tokens, block_t), num_kv_heads),
        input_output_aliases={4: 0, 5: 1},
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=1),
        interpret=interpret,
        name="write_kv_gpu",
    )(slot_mapping, layer.reshape(1), new_k, new_v, k_cache, v_cache)


def write_kv_gpu(k_cache, v_cache, layer, new_k, new_v, slot_mapping, *, block_t: int = 16, interpret: bool = False):
    """In-place scatter of new K/V rows into one layer of the page pool (Pallas Triton); ``write_kv_ref``'s contract.

    Args:
      k_cache, v_cache, layer, new_k, new_v, slot_mapping: as in ``reference.write_kv_ref``.
      block_t: tokens per program (rounded to a power of two, at most the step's).
      interpret: run in the Pallas interpreter (any backend, slow).

    Returns:
      The updated (k_cache, v_cache): in place only when the caller donates the caches (the runner's jitted step
      does); otherwise XLA copies them first.

    Raises:
      ValueError: shapes that do not fit the caches.
    """
    _validate(k_cache, v_cache, new_k, new_v, slot_mapping)
    if new_k.shape[0] == 0:
        return k_cache, v_cache
    block_t = min(next_pow2(block_t), next_pow2(new_k.shape[0]))
    return _write_kv_gpu(k_cache, v_cache, jnp.asarray(layer, jnp.int32), new_k, new_v, slot_mapping.astype(jnp.int32),
                         block_t=block_t, interpret=interpret)


# ---------------------------------------------------------------------------------------------- TPU (Mosaic)
def _tpu_kernel(layer_ref, slots_ref, new_k_ref, new_v_ref, _k_in, _v_in, k_hbm, v_hbm, sem, *, block_t, page_size):
    b = pl.program_id(0)
    layer = layer_ref[0]

    def row_copies(i):
        slot = slots_ref[b * block_t + i]
        page, off = jnp.maximum(slot, 0) // page_size, jnp.maximum(slot, 0) % page_size
        return slot >= 0, [pltpu.make_async_copy(src.at[i], dst.at[layer, page, off], sem)
                           for src, dst in ((new_k_ref, k_hbm), (new_v_ref, v_hbm))]

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
def _write_kv_tpu(k_cache, v_cache, layer, new_k, new_v, slot_mapping, *, block_t, interpret):
    num_tokens, num_kv_heads, head_dim = new_k.shape
    padded = cdiv(num_tokens, block_t) * block_t
    pad = ((0, padded - num_tokens), (0, 0), (0, 0))
    new_k, new_v = jnp.pad(new_k, pad), jnp.pad(new_v, pad)
    slots = jnp.pad(slot_mapping, (0, padded - num_tokens), constant_values=-1)
    row_spec = pl.BlockSpec((block_t, num_kv_heads, head_dim), lambda b, *_: (b, 0, 0))
    any_spec = pl.BlockSpec(memory_space=pl.ANY)
    if interpret:
        interpret = pltpu.InterpretParams()
    return pl.pallas_call(
        functools.partial(_tpu_kernel, block_t=block_t, page_size=k_cache.shape[2]),
        out_shape=(jax.ShapeDtypeStruct(k_cache.shape, k_cache.dtype),
                   jax.ShapeDtypeStruct(v_cache.shape, v_cache.dtype)),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2,
            grid=(padded // block_t,),
            in_specs=[row_spec, row_spec, any_spec, any_spec],
            out_specs=(any_spec, any_spec),
            scratch_shapes=[pltpu.SemaphoreType.DMA(())],
        ),
        input_output_aliases={4: 0, 5: 1},  # operand indices count the two scalar-prefetch operands
        compiler_params=pltpu.CompilerParams(dimension_semantics=("arbitrary",)),
        interpret=interpret,
        name="write_kv_tpu",
    )(layer.reshape(1), slots, new_k.astype(k_cache.dtype), new_v.astype(v_cache.dtype), k_cache, v_cache)


def write_kv_tpu(k_cache, v_cache, layer, new_k, new_v, slot_mapping, *, block_t: int = 16, interpret: bool = False):
    """In-place scatter of new K/V rows into one layer of the page pool (Pallas Mosaic, row DMAs into HBM);
    ``write_kv_ref``'s contract.

    Args:
      k_cache, v_cache, layer, new_k, new_v, slot_mapping: as in ``reference.write_kv_ref``.
      block_t: tokens per program (at most the step's).
      interpret: run in Pallas' TPU interpret mode (on the CPU).

    Returns:
      The updated (k_cache, v_cache), in place when the caller donates them.

    Raises:
      ValueError: shapes that do not fit the caches.
    """
    _validate(k_cache, v_cache, new_k, new_v, slot_mapping)
    if new_k.shape[0] == 0:
        return k_cache, v_cache
    block_t = max(1, min(block_t, new_k.shape[0]))
    out = _write_kv_tpu(k_cache, v_cache, jnp.asarray(layer, jnp.int32), new_k, new_v, slot_mapping.astype(jnp.int32),
                        block_t=block_t, interpret=interpret)
    return settle_tpu_interpret(out, interpret)
