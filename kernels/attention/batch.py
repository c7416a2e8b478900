"""The step's batch metadata (``AttentionBatch``), input validation and ragged-batch bookkeeping of the attention
kernels.

Everything here runs at trace time on shapes (validation) or as a few tiny XLA ops on the [S]-sized
metadata arrays (block maps); none of it touches the K/V cache.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jaxserve.kernels._common import cdiv, is_int8_pages


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class AttentionBatch:
    """Arrays that describe one step's ragged batch (layouts in ``reference.py``), passed whole to every attention
    kernel, which reads kv_lens, page_indices, cu_q_lens and num_seqs, and to every K/V write, which reads
    slot_mapping. The model fills all six; a direct caller of one kernel may leave what it does not read as None.
    A pytree: it crosses jit, scan and shard_map as its arrays."""

    positions: jax.Array | None = None  # [T] int32 absolute position of each token
    slot_mapping: jax.Array | None = None  # [T] int32 page * page_size + offset, -1 for padding tokens
    kv_lens: jax.Array | None = None  # [S] int32 context length after this step
    page_indices: jax.Array | None = None  # [S, P] int32
    cu_q_lens: jax.Array | None = None  # [S + 1] int32
    num_seqs: jax.Array | None = None  # [] int32


def write_slots(batch: AttentionBatch) -> jax.Array:
    """``batch.slot_mapping`` (what the K/V writes read); ValueError when it is missing."""
    if batch.slot_mapping is None:
        raise ValueError("write_kv needs batch.slot_mapping ([T] int32), got None")
    return batch.slot_mapping


def int32_metadata(batch: AttentionBatch) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """(kv_lens, page_indices, cu_q_lens, num_seqs) of ``batch`` as int32 arrays: what the attention kernels read."""
    return tuple(
        jnp.asarray(a, jnp.int32) for a in (batch.kv_lens, batch.page_indices, batch.cu_q_lens, batch.num_seqs)
    )


# The K/V pool's layouts: "tokens_heads" [L, pages, page_size, kv_heads, head_dim] everywhere; "heads_tokens" [L,
# pages, kv_heads, page_size, head_dim] on a TPU, whose minor dims (page_size, head_dim) are its tiles' (the other
# layout's (kv_heads, head_dim) pad a chip's one or two KV heads to 8-16 sublanes).
POOL_LAYOUTS = ("tokens_heads", "heads_tokens")


def validate_attention_inputs(
    q, k_cache, v_cache, batch: AttentionBatch, *, sm_scale, soft_cap, layout: str = "tokens_heads"
) -> None:
    """Checks shapes, dtypes and head counts at trace time. Raises ValueError with the offending values.

    ``layout``: the pool's, "tokens_heads" ([L, pages, page_size, kv_heads, head_dim]) or "heads_tokens" ([L,
    pages, kv_heads, page_size, head_dim], the TPU's); a 4-D pool is a latent pool either way.

    When ``batch.kv_lens`` is concrete (not traced) it also checks that the page table is long enough.
    """
    for name in ("kv_lens", "page_indices", "cu_q_lens", "num_seqs"):
        if getattr(batch, name) is None:
            raise ValueError(f"attention needs batch.{name}, got None")
    kv_lens, page_indices, cu_q_lens = batch.kv_lens, batch.page_indices, batch.cu_q_lens
    if q.ndim != 3:
        raise ValueError(f"q must be [num_tokens, num_q_heads, head_dim], got shape {q.shape}")
    if layout not in POOL_LAYOUTS:
        raise ValueError(f"layout must be one of {POOL_LAYOUTS}, got {layout!r}")
    if k_cache.ndim not in (4, 5):
        raise ValueError(
            f"k_cache must be [layers, num_pages, page_size, num_kv_heads, head_dim] (or a latent pool [layers, "
            f"num_pages, page_size, width]), got {k_cache.shape}"
        )
    latent = k_cache.ndim == 4  # MLA's latent pool [layers, num_pages, page_size, width]: keys and values alike
    if latent and is_int8_pages(k_cache):
        raise ValueError("a latent pool of Int8Pages is not supported")
    if layout == "heads_tokens" and is_int8_pages(k_cache):
        raise ValueError("Int8Pages come in the 'tokens_heads' layout only")
    shape = k_cache.shape  # as [L, pages, page_size, kv_heads, head_dim]
    if layout == "heads_tokens" and not latent:
        shape = (*shape[:2], shape[3], shape[2], *shape[4:])
    if not latent and (k_cache.shape != v_cache.shape or k_cache.dtype != v_cache.dtype):
        raise ValueError(
            f"k_cache and v_cache differ: {k_cache.shape} {k_cache.dtype} vs {v_cache.shape} {v_cache.dtype}"
        )
    if is_int8_pages(k_cache) != is_int8_pages(v_cache):
        raise ValueError("k_cache and v_cache must both be Int8Pages or both plain arrays")
    if is_int8_pages(k_cache):
        if k_cache.dtype != jnp.int8 or k_cache.scales.shape != k_cache.shape[:4]:
            raise ValueError(
                f"Int8Pages needs int8 values and scales of shape {k_cache.shape[:4]}, got "
                f"{k_cache.dtype} values and scales {k_cache.scales.shape}"
            )
    elif jnp.issubdtype(k_cache.dtype, jnp.integer):
        raise ValueError(f"an {k_cache.dtype} pool needs its scales: pass Int8Pages(values, scales)")
    _, num_q_heads, head_dim = q.shape
    num_kv_heads, kv_head_dim = (1, shape[3]) if latent else shape[3:]
    if kv_head_dim != head_dim:
        raise ValueError(f"head_dim of q ({head_dim}) and of the cache ({kv_head_dim}) differ")
    if num_kv_heads <= 0 or num_q_heads % num_kv_heads:
        raise ValueError(f"num_q_heads ({num_q_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
    if page_indices.ndim != 2:
        raise ValueError(f"page_indices must be [num_seqs, pages_per_seq], got shape {page_indices.shape}")
    num_seqs = page_indices.shape[0]
    if kv_lens.shape != (num_seqs,):
        raise ValueError(f"kv_lens must have shape ({num_seqs},) like page_indices rows, got {kv_lens.shape}")
    if cu_q_lens.shape != (num_seqs + 1,):
        raise ValueError(f"cu_q_lens must have shape ({num_seqs + 1},), got {cu_q_lens.shape}")
    for name, a in (("kv_lens", kv_lens), ("page_indices", page_indices), ("cu_q_lens", cu_q_lens)):
        if not jnp.issubdtype(a.dtype, jnp.integer):
            raise ValueError(f"{name} must be an integer array, got {a.dtype}")
    try:
        float(sm_scale)
    except (TypeError, jax.errors.ConcretizationTypeError) as e:
        raise ValueError(f"sm_scale must be a static number (it is baked into the kernel), got {sm_scale!r}") from e
    if soft_cap is not None and not soft_cap > 0:
        raise ValueError(f"soft_cap must be None or > 0, got {soft_cap!r}")
    try:
        kv_lens_np = np.asarray(kv_lens)
    except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError):
        kv_lens_np = None  # traced: the length check happens on the host that built the page table
    if kv_lens_np is not None:
        page_size, pages_per_seq = shape[2], page_indices.shape[1]
        max_kv = int(np.max(kv_lens_np, initial=0))
        if cdiv(max_kv, page_size) > pages_per_seq:
            raise ValueError(
                f"page table too short: max kv_len {max_kv} needs {cdiv(max_kv, page_size)} pages of {page_size}, "
                f"page_indices has {pages_per_seq} per sequence"
            )


def valid_token_mask(cu_q_lens: jax.Array, num_seqs, num_tokens: int) -> jax.Array:
    """[T] bool: token t belongs to one of the first ``num_seqs`` sequences (the rest is padding)."""
    return jnp.arange(num_tokens, dtype=jnp.int32) < cu_q_lens[jnp.asarray(num_seqs, jnp.int32)]


def seq_q_blocks(cu_q_lens: jax.Array, num_seqs, block_q: int, num_blocks: int):
    """Packs every valid sequence's query tokens into blocks of ``block_q`` that never straddle sequences.

    Returns (blk_seq, blk_tok0), both [num_blocks] int32: the sequence of block b (-1 when b is unused) and
    the index of its first token. ``num_blocks`` must be >= sum_i cdiv(q_len_i, block_q); see num_seq_q_blocks.
    """
    num_seqs_padded = cu_q_lens.shape[0] - 1
    seq = jnp.arange(num_seqs_padded, dtype=jnp.int32)
    q_lens = jnp.where(seq < num_seqs, jnp.maximum(cu_q_lens[1:] - cu_q_lens[:-1], 0), 0)
    blocks = cdiv(q_lens, block_q)
    ends = jnp.cumsum(blocks).astype(jnp.int32)  # [S] exclusive end block of each sequence
    b = jnp.arange(num_blocks, dtype=jnp.int32)
    # == S when b is past the last block; compare_all: one fused comparison, not a loop of tiny ops in every layer
    owner = jnp.searchsorted(ends, b, side="right", method="compare_all").astype(jnp.int32)
    owner_c = jnp.minimum(owner, num_seqs_padded - 1)
    tok0 = cu_q_lens[owner_c] + (b - (ends[owner_c] - blocks[owner_c])) * block_q
    used = owner < num_seqs_padded
    return jnp.where(used, owner_c, -1), jnp.where(used, tok0, 0).astype(jnp.int32)


def num_seq_q_blocks(num_tokens: int, num_seqs_padded: int, block_q: int) -> int:
    """Static upper bound on sum_i cdiv(q_len_i, block_q) given sum_i q_len_i <= num_tokens."""
    return max(1, min(num_tokens, num_tokens // block_q + num_seqs_padded))
