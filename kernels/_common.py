"""What the kernel families share: the K/V pools' element formats (fp8 pages, ``Int8Pages`` and their rounding),
the TPU interpreter's settling, and integer helpers (the kernels import no engine module).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


def cdiv(a, b):
    """Ceiling division ``ceil(a / b)`` for ``b > 0``: Python ints, or integer numpy / jax arrays (elementwise)."""
    return -(-a // b)


def next_pow2(n: int) -> int:
    """The smallest power of two >= ``n`` (1 for ``n <= 1``)."""
    return 1 << max(int(n) - 1, 0).bit_length()


FP8_DTYPES = (jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float8_e5m2))


def is_fp8(dtype) -> bool:
    """fp8 KV pages (stored without scales): the kernels widen each block they read to the queries' dtype."""
    return jnp.dtype(dtype) in FP8_DTYPES


def widen_fp8(x: jax.Array, dtype) -> jax.Array:
    """``x`` in ``dtype`` when it is fp8 (K/V read from an fp8 pool), else unchanged."""
    return x.astype(dtype) if is_fp8(x.dtype) else x


INT8_MAX = 127.0


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Int8Pages:
    """An int8 K (or V) pool with one float32 scale per token and KV head: row ``x[l, p, s, h, :]`` is
    ``values[l, p, s, h, :] * scales[l, p, s, h]``.

    It travels wherever a pool array does (a pytree: jit, donation, scan carries, shard_map), and reports the
    values' shape and dtype, so shape checks read it as a pool. Every attention path and every K/V write accepts it;
    ``quantize_rows`` defines the rounding (symmetric, per row: scale = max|x| / 127).
    """

    values: jax.Array  # [L, pages, page_size, kv_heads, head_dim] int8
    scales: jax.Array  # [L, pages, page_size, kv_heads] float32

    @property
    def shape(self) -> tuple[int, ...]:
        return self.values.shape

    @property
    def dtype(self):
        return self.values.dtype

    @property
    def ndim(self) -> int:
        return self.values.ndim

    def is_deleted(self) -> bool:
        return self.values.is_deleted() or self.scales.is_deleted()


def is_int8_pages(cache) -> bool:
    return isinstance(cache, Int8Pages)


INT8 = jnp.dtype(jnp.int8)


def int8_pools(k_cache, v_cache, what: str) -> bool:
    """True for two ``Int8Pages`` pools, False for two plain arrays of one dtype; raises ValueError otherwise (a
    plain int8 array has no scales to read it with)."""
    int8 = is_int8_pages(k_cache), is_int8_pages(v_cache)
    if int8[0] != int8[1]:
        raise ValueError(
            f"{what}: k_cache and v_cache must both be Int8Pages or both arrays, got "
            f"{type(k_cache).__name__}/{type(v_cache).__name__}"
        )
    if not int8[0] and INT8 in (k_cache.dtype, v_cache.dtype):
        raise ValueError(
            f"{what}: an int8 pool needs its scales: pass Int8Pages(values, scales), not a plain int8 array"
        )
    return int8[0]


def quantize_rows(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """[..., D] -> (int8 [..., D], float32 scales [...]): symmetric, one scale per row, max|x| -> 127.

    An all-zero row gets scale 1 (and zeros); non-finite inputs are not expected (K/V of a finite model).
    """
    x = x.astype(jnp.float32)
    amax = jnp.max(jnp.abs(x), axis=-1)
    scale = jnp.where(amax > 0, amax / INT8_MAX, 1.0)
    q = jnp.clip(jnp.round(x / scale[..., None]), -INT8_MAX, INT8_MAX).astype(jnp.int8)
    return q, scale


def dequantize_rows(values: jax.Array, scales: jax.Array, dtype=jnp.float32) -> jax.Array:
    """``values * scales[..., None]`` in ``dtype`` (the product in float32)."""
    return (values.astype(jnp.float32) * scales.astype(jnp.float32)[..., None]).astype(dtype)


def split_pool(cache):
    """(values, scales or None) of a pool: an ``Int8Pages`` or a plain array."""
    return (cache.values, cache.scales) if is_int8_pages(cache) else (cache, None)


def settle_tpu_interpret(out, interpret: bool):
    """Waits for a Pallas TPU kernel run in interpret mode when it was called eagerly (outside ``jit``).

    The TPU interpreter's io_callbacks run small jax ops on CPU device 0 while the kernel's own computation is still
    running there. If the caller dispatches another op to that device in the meantime (async dispatch lets it), that
    op queues ahead of the callbacks' ops and waits for the kernel, which waits for its callbacks: a deadlock (seen
    on a cold compilation cache, where the caller's next op is slow to compile). Under ``jit`` the kernel is part of
    one computation and there is nothing to wait for here.
    """
    if interpret and not any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves(out)):
        jax.block_until_ready(out)
    return out
