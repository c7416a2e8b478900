"""Ragged paged attention as a Triton-style Pallas kernel (GPU), with flash-decoding context splits.

Grid: (query block, kv head, context split). A query block is ``block_q`` consecutive query tokens of ONE
sequence (blocks never straddle sequences; the wrapper packs them with a tiny searchsorted), and the
program handles those tokens for all ``group`` query heads that share one KV head, so each K/V row it
loads serves ``block_q * group`` query rows:

    rows of the program = [block_q tokens x group_pad heads]   (group_pad = next power of two >= group)

The program walks its share of the context in blocks of ``block_kv`` tokens, gathering each K/V row
through the page table straight from the full cache [L, pages, page_size, kv_heads, head_dim] (the layer
is a scalar input, so nothing is sliced or copied in the wrapper), with an online softmax in float32.
Long contexts are split over ``num_splits`` programs; each writes its normalized partial output and
log-sum-exp, and the wrapper combines them (flash-decoding). With one split the kernel writes the final
output directly.

Numerics: scores and the softmax are float32; QK^T and PV run on the tensor cores in the cache dtype
(bf16) with float32 accumulation, or in full float32 (IEEE, not TF32) for float32 caches. fp8 rows are widened
to the queries' dtype; int8 rows (``Int8Pages``) are multiplied by their scales in float32 and then cast to it.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu
from jaxserve.kernels._common import cdiv, is_fp8, next_pow2, split_pool, widen_fp8
from jaxserve.kernels.attention.batch import (
    AttentionBatch,
    int32_metadata,
    num_seq_q_blocks,
    seq_q_blocks,
    valid_token_mask,
    validate_attention_inputs,
)

# Enough programs to fill an H100-class GPU (132 SMs) about twice over before splitting contexts further.
_TARGET_PROGRAMS = 256


def _kernel(
    blk_seq_ref,  # [NB] int32: sequence of each query block, -1 = unused block
    blk_tok0_ref,  # [NB] int32: first token of each query block
    cu_q_lens_ref,  # [S + 1]
    kv_lens_ref,  # [S]
    page_indices_ref,  # [S, pages_per_seq]
    scalars_ref,  # [2]: layer, sliding_window
    q_ref,  # [T, num_q_heads, head_dim]
    k_ref,  # [L, num_pages, page_size, num_kv_heads, head_dim]
    v_ref,  # [L, num_pages, page_size, num_kv_heads, head_dim]
    *refs,  # int8 pools: k_scales, v_scales [L, num_pages, page_size, num_kv_heads]; then o_ref, *lse_refs:
    # o_ref [T, num_q_heads, head_dim] (one split) or [num_splits, T, num_q_heads, head_dim] float32
    # lse_refs () or ([num_splits, T, num_q_heads] float32,)
    quantized: bool,
    sm_scale: float,
    soft_cap: float | None,
    block_q: int,
    group: int,
    group_pad: int,
    block_kv: int,
    num_splits: int,
):
    b, kv_head, split = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    seq = blk_seq_ref[b]
    scale_refs, (o_ref, *lse_refs) = (refs[:2], refs[2:]) if quantized else ((), refs)

    @pl.when(seq >= 0)
    def _():
        num_tokens = q_ref.shape[0]
        page_size = k_ref.shape[2]
        pages_per_seq = page_indices_ref.shape[1]
        layer, window = scalars_ref[0], scalars_ref[1]
        tok0 = blk_tok0_ref[b]
        q_start, q_end, kv_len = cu_q_lens_ref[seq], cu_q_lens_ref[seq + 1], kv_lens_ref[seq]
        first_pos = kv_len - (q_end - q_start)  # absolute position of the sequence's first query token

        rows = jnp.arange(block_q * group_pad, dtype=jnp.int32)
        tok = tok0 + rows // group_pad  # [BM]
        g = rows % group_pad
        row_ok = (tok < q_end) & (g < group)
        head_dim = q_ref.shape[2]
        dims = jnp.arange(head_dim, dtype=jnp.int32)[None, :]
        # Loads use clamped (in-bounds) indices; stores send masked rows one past the end so that they can
        # never collide with a real row (the interpreter's masked scatter writes back what it read).
        tok_c = jnp.minimum(tok, num_tokens - 1)[:, None]
        tok_st = jnp.where(row_ok, tok, num_tokens)[:, None]
        head = (kv_head * group + jnp.minimum(g, group - 1))[:, None]
        pos = first_pos + (tok - q_start)  # [BM] absolute position of each row's token
        row_mask = jnp.broadcast_to(row_ok[:, None], (tok.shape[0], head_dim))
        q = plgpu.load(q_ref.at[tok_c, head, dims], mask=row_mask, other=0)  # [BM, D]

        # Context this block needs: [lo, hi), lo aligned down to block_kv; this split's share of it.
        block_first = first_pos + (tok0 - q_start)
        hi = jnp.minimum(block_first + jnp.minimum(block_q, q_end - tok0), kv_len)
        lo = jnp.where(window > 0, jnp.maximum(block_first - window + 1, 0), 0)
        lo = (lo // block_kv) * block_kv
        num_blocks = jnp.maximum(cdiv(hi - lo, block_kv), 0)
        per_split = cdiv(num_blocks, num_splits)
        j_start = split * per_split
        j_end = jnp.minimum(j_start + per_split, num_blocks)
        precision = lax.Precision.HIGHEST  # IEEE for float32 inputs; no effect on bf16

        def load_kv(ref, mask):
            if not is_fp8(ref.dtype):
                return plgpu.load(ref, mask=mask, other=0)
            # Triton cannot cast a fill value to fp8: load the masked lanes as they come, then zero them once widened.
            return jnp.where(mask, widen_fp8(plgpu.load(ref, mask=mask), q.dtype), 0)

        def body(j, carry):
            acc, m, l = carry
            kv_tok = lo + j * block_kv + jnp.arange(block_kv, dtype=jnp.int32)  # [BK]
            kv_ok = kv_tok < hi
            slot = jnp.minimum(kv_tok // page_size, pages_per_seq - 1)
            page = plgpu.load(page_indices_ref.at[seq, slot], mask=kv_ok, other=0)[:, None]
            off = (kv_tok % page_size)[:, None]
            kv_mask = jnp.broadcast_to(kv_ok[:, None], (block_kv, head_dim))
            k, v = (load_kv(r.at[layer, page, off, kv_head, dims], kv_mask) for r in (k_ref, v_ref))  # [BK, D]
            if quantized:  # int8 rows times their scales, in float32, then the queries' dtype
                k, v = (
                    x.astype(jnp.float32)
                    * plgpu.load(sr.at[layer, page[:, 0], off[:, 0], kv_head], mask=kv_ok, other=0)[:, None]
                    for x, sr in ((k, scale_refs[0]), (v, scale_refs[1]))
                )
                k, v = k.astype(q.dtype), v.astype(q.dtype)
            k, v = widen_fp8(k, q.dtype), widen_fp8(v, q.dtype)
            s = (
                lax.dot_general(q, k, (((1,), (1,)), ((), ())), precision=precision, preferred_element_type=jnp.float32)
                * sm_scale
            )  # [BM, BK]
            if soft_cap is not None:
                s = soft_cap * jnp.tanh(s / soft_cap)
            ok = row_ok[:, None] & kv_ok[None, :] & (kv_tok[None, :] <= pos[:, None])
            ok &= (window <= 0) | (kv_tok[None, :] > pos[:, None] - window)
            s = jnp.where(ok, s, -jnp.inf)
            m_new = jnp.maximum(m, jnp.max(s, axis=1))
            m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)  # a row with nothing visible yet stays at 0
            alpha = jnp.exp(m - m_safe)
            p = jnp.exp(s - m_safe[:, None])
            l = alpha * l + jnp.sum(p, axis=1)
            pv = lax.dot_general(
                p.astype(v.dtype), v, (((1,), (0,)), ((), ())), precision=precision, preferred_element_type=jnp.float32
            )
            return acc * alpha[:, None] + pv, m_new, l

        bm = block_q * group_pad
        init = (
            jnp.zeros((bm, head_dim), jnp.float32),
            jnp.full((bm,), -jnp.inf, jnp.float32),
            jnp.zeros((bm,), jnp.float32),
        )
        acc, m, l = lax.fori_loop(j_start, j_end, body, init)
        out = acc / jnp.where(l > 0, l, 1.0)[:, None]  # rows that saw nothing give 0
        if lse_refs:
            plgpu.store(o_ref.at[split, tok_st, head, dims], out, mask=row_mask)
            lse = jnp.where(l > 0, m + jnp.log(l), -jnp.inf)
            plgpu.store(lse_refs[0].at[split, tok_st[:, 0], head[:, 0]], lse, mask=row_ok)
        else:
            plgpu.store(o_ref.at[tok_st, head, dims], out.astype(o_ref.dtype), mask=row_mask)


def _combine_splits(o: jax.Array, lse: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Flash-decoding merge. o: [NS, T, N, H] (each split normalized), lse: [NS, T, N] -> ([T, N, H], the whole
    context's log-sum-exp [T, N]: -inf where nothing was seen)."""
    m = jnp.max(lse, axis=0)
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    w = jnp.exp(lse - m)  # [NS, T, N]; splits that saw nothing weigh 0
    den = jnp.sum(w, axis=0)
    out = jnp.einsum("stn,stnh->tnh", w, o) / jnp.where(den > 0, den, 1.0)[..., None]
    return out, jnp.where(den > 0, m + jnp.log(jnp.where(den > 0, den, 1.0)), -jnp.inf)


def default_block_sizes(num_tokens, num_seqs_padded, group, head_dim, kv_heads, max_ctx):
    """(block_q, block_kv, num_splits) heuristics; every value is static."""
    group_pad = next_pow2(group)
    block_m = 16 if num_tokens <= 2 * num_seqs_padded else 64  # decode-like batches: small query tiles
    block_q = max(1, block_m // group_pad)
    block_kv = 32 if head_dim > 128 else 64
    programs = num_seq_q_blocks(num_tokens, num_seqs_padded, block_q) * kv_heads
    num_splits = next_pow2(cdiv(_TARGET_PROGRAMS, programs)) if programs < _TARGET_PROGRAMS else 1
    num_splits = max(1, min(num_splits, cdiv(max_ctx, 2 * block_kv)))  # at least ~2 KV blocks per split
    return block_q, block_kv, num_splits


def ragged_paged_attention_gpu(
    q: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array,
    layer: jax.Array | int,
    batch: AttentionBatch,
    *,
    sm_scale: float,
    sliding_window: jax.Array | int = 0,
    soft_cap: float | None = None,
    sinks: jax.Array | None = None,
    block_q: int | None = None,
    block_kv: int | None = None,
    num_splits: int | None = None,
    num_warps: int | None = None,
    num_stages: int = 2,
    interpret: bool = False,
) -> jax.Array:
    """Ragged paged attention on a GPU (Pallas Triton); same contract as ``ragged_paged_attention_ref``.

    Args:
      q, k_cache, v_cache, layer, batch, sm_scale, sliding_window, soft_cap, sinks: as in
        ``reference.ragged_paged_attention_ref``.
        Sinks are applied to the kernel's output: a row's softmax without the sink, times
        sigmoid(lse - sink), lse its scores' log-sum-exp, is the softmax with it.
      block_q: query tokens per program (power of two); block_q * next_pow2(group) rows per tile.
      block_kv: context tokens per inner step (power of two, >= 16).
      num_splits: context splits per query block (flash-decoding); None picks one from the shapes.
      num_warps, num_stages: Triton compiler parameters (num_warps None: 8 for big tiles, else 4).
      interpret: run the kernel in the Pallas interpreter (any backend, slow).

    Returns:
      [T, num_q_heads, head_dim] in q.dtype; padding tokens are zeros.

    Raises:
      ValueError: inconsistent shapes or head counts, or a page table too short for a concrete kv_lens.
    """
    validate_attention_inputs(q, k_cache, v_cache, batch, sm_scale=sm_scale, soft_cap=soft_cap)
    num_tokens, num_q_heads, head_dim = q.shape
    _, _, page_size, kv_heads, _ = k_cache.shape
    num_seqs_padded, pages_per_seq = batch.page_indices.shape
    group = num_q_heads // kv_heads
    dq, dkv, dsplit = default_block_sizes(
        num_tokens, num_seqs_padded, group, head_dim, kv_heads, pages_per_seq * page_size
    )
    block_q, block_kv, num_splits = block_q or dq, block_kv or dkv, num_splits or dsplit
    for name, val in (("block_q", block_q), ("block_kv", block_kv)):
        if val != next_pow2(val):
            raise ValueError(f"{name} must be a power of two, got {val}")
    if num_warps is None:  # keep the float32 accumulator tile from spilling on wide tiles
        num_warps = 8 if block_q * next_pow2(group) * head_dim >= 64 * 256 else 4
    if block_kv < 16 or block_q * next_pow2(group) < 16:
        raise ValueError(
            f"tiles must be >= 16 wide for tensor cores: block_kv={block_kv}, "
            f"block_q*group_pad={block_q * next_pow2(group)}"
        )
    return _rpa_gpu(
        q,
        k_cache,
        v_cache,
        jnp.asarray(layer, jnp.int32),
        *int32_metadata(batch),
        jnp.asarray(sliding_window, jnp.int32),
        None if sinks is None else jnp.asarray(sinks, jnp.float32),
        sm_scale=float(sm_scale),
        soft_cap=soft_cap,
        block_q=block_q,
        block_kv=block_kv,
        num_splits=num_splits,
        num_warps=num_warps,
        num_stages=num_stages,
        interpret=interpret,
    )


@functools.partial(
    jax.jit,
    static_argnames=(
        "sm_scale",
        "soft_cap",
        "block_q",
        "block_kv",
        "num_splits",
        "num_warps",
        "num_stages",
        "interpret",
    ),
)
def _rpa_gpu(
    q,
    k_cache,
    v_cache,
    layer,
    kv_lens,
    page_indices,
    cu_q_lens,
    num_seqs,
    sliding_window,
    sinks,
    *,
    sm_scale,
    soft_cap,
    block_q,
    block_kv,
    num_splits,
    num_warps,
    num_stages,
    interpret,
):
    num_tokens, num_q_heads, head_dim = q.shape
    kv_heads = k_cache.shape[3]
    group = num_q_heads // kv_heads
    (k_values, k_scales), (v_values, v_scales) = split_pool(k_cache), split_pool(v_cache)
    quantized = k_scales is not None
    num_blocks = num_seq_q_blocks(num_tokens, page_indices.shape[0], block_q)
    blk_seq, blk_tok0 = seq_q_blocks(cu_q_lens, num_seqs, block_q, num_blocks)
    scalars = jnp.stack([layer.reshape(()), sliding_window.reshape(())])
    if num_splits == 1 and sinks is None:
        out_shape = [jax.ShapeDtypeStruct(q.shape, q.dtype)]
    else:
        out_shape = [
            jax.ShapeDtypeStruct((num_splits, *q.shape), jnp.float32),
            jax.ShapeDtypeStruct((num_splits, num_tokens, num_q_heads), jnp.float32),
        ]
    kernel = functools.partial(
        _kernel,
        quantized=quantized,
        sm_scale=sm_scale,
        soft_cap=soft_cap,
        block_q=block_q,
        group=group,
        group_pad=next_pow2(group),
        block_kv=block_kv,
        num_splits=num_splits,
    )
    scales = (k_scales, v_scales) if quantized else ()
    outs = pl.pallas_call(
        kernel,
        out_shape=out_shape,
        grid=(num_blocks, kv_heads, num_splits),
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name=f"ragged_paged_attention_gpu_bq{block_q}_bkv{block_kv}_s{num_splits}",
    )(blk_seq, blk_tok0, cu_q_lens, kv_lens, page_indices, scalars, q, k_values, v_values, *scales)
    if len(outs) == 1:
        out = outs[0]
    else:  # several splits, or sinks: the kernel wrote each split's output and log-sum-exp
        out, lse = _combine_splits(*outs)
        if sinks is not None:
            out = out * jax.nn.sigmoid(lse - sinks[None, :])[..., None]
    valid = valid_token_mask(cu_q_lens, num_seqs, num_tokens)
    return jnp.where(valid[:, None, None], out, 0).astype(q.dtype)
