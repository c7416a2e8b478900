"""Ragged paged attention as a Mosaic TPU Pallas kernel: K/V stay in HBM, pages are DMA'd double-buffered.

Grid: (kv-head block, query block). Query blocks are ``block_q`` consecutive tokens of the flattened
batch, so a block may hold the tail of one sequence and the heads of the next ones (decode batches pack
``block_q`` sequences into one program). The program walks the sequences that overlap its block; for each
it streams the needed context, ``pages_per_block`` pages at a time, from HBM into a VMEM double buffer
with async copies (the next block's pages, possibly of the next sequence, are in flight while the current
one is computed), and runs an online softmax in float32 whose rows belong to exactly one sequence: the
other rows are masked to -inf, which leaves their running state untouched.

Everything data-dependent is scalar-prefetched into SMEM: layer, sliding window, kv_lens, the flattened
page table, cu_q_lens and the range of sequences that overlaps each query block. The cache operands are
the full [L, pages, page_size, kv_heads, head_dim] arrays with ``memory_space=pl.ANY``; the layer is just
the first index of each DMA source, so no layer is ever copied out. A latent pool (multi-head latent attention,
``kernels.attention.mla``) is one [L, pages, page_size, width] array whose rows are every query head's key and
value: one buffer of pages is DMA'd, and the page's minor dims (page_size, width) are the TPU tiles' own (no
padding of a one-head axis).

To keep every in-kernel value 2-D, the wrapper presents q (and takes the output) as
[kv_heads, T * group, head_dim] (row = token * group + head-in-group); that is one transpose of q and
one of the output, small next to the K/V traffic.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jaxserve.kernels._common import cdiv, is_fp8, is_int8_pages, settle_tpu_interpret, split_pool, widen_fp8
from jaxserve.kernels.attention.batch import AttentionBatch, int32_metadata, validate_attention_inputs

_LANES = 128


def _kernel(
    # scalar prefetch (SMEM)
    scalars_ref,  # [3]: layer, sliding_window, num_seqs
    kv_lens_ref,  # [S]
    page_indices_ref,  # [S * pages_per_seq] (flattened)
    cu_q_lens_ref,  # [S + 1]
    blk_seq_lo_ref,  # [num_q_blocks]: first sequence overlapping each query block
    blk_seq_hi_ref,  # [num_q_blocks]: one past the last
    # inputs
    q_ref,  # [kv_heads_per_block, block_q * group, head_dim] (VMEM block)
    *refs,
    # with sinks only: sink_ref [kv_heads_per_block, block_q * group, 128] f32, each row's sink, lane-replicated
    # k_hbm, v_hbm: [L, num_pages, page_size, num_kv_heads, head_dim] (HBM)
    # int8 pools only: k_scales_hbm, v_scales_hbm [L, num_pages, page_size, num_kv_heads] f32 (HBM)
    # output
    #   o_ref [kv_heads_per_block, block_q * group, head_dim]
    # scratch
    #   k_buf, v_buf [2, pages_per_block * page_size, kv_heads_per_block, head_dim]
    #   int8 pools only: ks_buf, vs_buf [2, pages_per_block * page_size, kv_heads_per_block] f32
    #   sems: DMA semaphores [2 or 4 (k, v, k scales, v scales), 2 (slot)]
    #   m_ref [kv_heads_per_block, block_q * group, 128] f32, lane-replicated running max
    #   l_ref [kv_heads_per_block, block_q * group, 128] f32, running denominator
    #   acc_ref [kv_heads_per_block, block_q * group, head_dim] f32
    quantized: bool,
    sm_scale: float,
    soft_cap: float | None,
    block_q: int,
    group: int,
    pages_per_seq: int,
    pages_per_block: int,
    has_sinks: bool,
    latent: bool = False,
    heads_tokens: bool = False,
):
    sink_ref, refs = (refs[0], refs[1:]) if has_sinks else (None, refs)
    if latent:  # one pool [L, num_pages, page_size, width] whose rows are keys and values alike (MLA's latents)
        k_hbm, o_ref, k_buf, sems, m_ref, l_ref, acc_ref = refs
        pools = ((k_hbm, k_buf),)
    elif quantized:
        k_hbm, v_hbm, ks_hbm, vs_hbm, o_ref, k_buf, v_buf, ks_buf, vs_buf, sems, m_ref, l_ref, acc_ref = refs
        pools = ((k_hbm, k_buf), (v_hbm, v_buf), (ks_hbm, ks_buf), (vs_hbm, vs_buf))
    else:
        k_hbm, v_hbm, o_ref, k_buf, v_buf, sems, m_ref, l_ref, acc_ref = refs
        pools = ((k_hbm, k_buf), (v_hbm, v_buf))
    head_blk, q_blk = pl.program_id(0), pl.program_id(1)
    kv_heads_blk, rows, head_dim = q_ref.shape
    num_pages, (page_size, num_kv_heads) = k_hbm.shape[1], _page_dims(k_hbm.shape, heads_tokens)
    blk_tokens = pages_per_block * page_size
    layer, window = scalars_ref[0], scalars_ref[1]
    tok_lo = q_blk * block_q
    tok_hi = tok_lo + block_q
    seq_lo, seq_hi = blk_seq_lo_ref[q_blk], blk_seq_hi_ref[q_blk]

    if has_sinks:  # each row starts as if it had seen one key of score its sink and value 0
        m_ref[...] = sink_ref[...]
        l_ref[...] = jnp.ones(l_ref.shape, jnp.float32)
    else:
        m_ref[...] = jnp.full(m_ref.shape, -jnp.inf, jnp.float32)
        l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
    acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

    def seq_info(s):
        """Scalars for the part of sequence s inside this query block."""
        q_start, q_end, kv_len = cu_q_lens_ref[s], cu_q_lens_ref[s + 1], kv_lens_ref[s]
        t0, t1 = jnp.maximum(q_start, tok_lo), jnp.minimum(q_end, tok_hi)
        first_pos = kv_len - (q_end - q_start)  # absolute position of the sequence's first query token
        hi = jnp.minimum(first_pos + (t1 - q_start), kv_len)  # context needed: [lo, hi)
        lo = jnp.where(window > 0, jnp.maximum(first_pos + (t0 - q_start) - window + 1, 0), 0)
        page_lo, page_hi = lo // page_size, cdiv(hi, page_size)
        num_blocks = jnp.where(t1 > t0, jnp.maximum(cdiv(page_hi - page_lo, pages_per_block), 0), 0)
        return dict(
            q_start=q_start,
            t0=t0,
            t1=t1,
            first_pos=first_pos,
            lo=lo,
            hi=hi,
            page_lo=page_lo,
            page_hi=page_hi,
            num_blocks=num_blocks,
        )

    def copies(s, info, j, slot):
        """The page DMAs of context block j of sequence s into buffer ``slot``, each guarded by a predicate."""
        out = []
        for i in range(pages_per_block):
            page = info["page_lo"] + j * pages_per_block + i
            page_id = page_indices_ref[s * pages_per_seq + jnp.minimum(page, pages_per_seq - 1)]
            page_id = jnp.clip(page_id, 0, num_pages - 1)  # entries past the sequence's pages may be junk
            for which, (hbm, buf) in enumerate(pools):
                src = hbm.at[layer, page_id]
                heads = pl.ds(head_blk * kv_heads_blk, kv_heads_blk)
                if heads_tokens:  # the page's [heads, page_size, D] into the buffer's [heads, tokens, D]
                    src = src if kv_heads_blk == num_kv_heads else src.at[heads]
                    dst = buf.at[slot, :, pl.ds(i * page_size, page_size)]
                else:
                    if kv_heads_blk != num_kv_heads and not latent:
                        src = src.at[:, heads]
                    dst = buf.at[slot, pl.ds(i * page_size, page_size)]
                out.append((page < info["page_hi"], pltpu.make_async_copy(src, dst, sems.at[which, slot])))
        return out

    def start(s, info, j, slot):
        for pred, c in copies(s, info, j, slot):
            pl.when(pred)(c.start)

    def wait(s, info, j, slot):
        for pred, c in copies(s, info, j, slot):
            pl.when(pred)(c.wait)

    def compute(info, j, slot):
        blk_tok0 = (info["page_lo"] + j * pages_per_block) * page_size
        kv_tok = blk_tok0 + lax.broadcasted_iota(jnp.int32, (1, blk_tokens), 1)  # [1, C]
        kv_ok = (kv_tok >= info["lo"]) & (kv_tok < info["hi"])
        kv_tok_col = blk_tok0 + lax.broadcasted_iota(jnp.int32, (blk_tokens, 1), 0)  # [C, 1]
        v_ok = (kv_tok_col >= info["lo"]) & (kv_tok_col < info["hi"])
        tok = tok_lo + lax.broadcasted_iota(jnp.int32, (rows, 1), 0) // group  # [R, 1]
        pos = info["first_pos"] + (tok - info["q_start"])
        ok = (tok >= info["t0"]) & (tok < info["t1"]) & kv_ok & (kv_tok <= pos)
        ok &= (window <= 0) | (kv_tok > pos - window)  # [R, C]
        # fp32 products only for f32 caches: Mosaic rejects a bf16 x bf16 matmul asking for fp32 contraction
        # ("Bad lhs type"), and the MXU's bf16 x bf16 -> f32 product is already exact.
        # fp8 pages are widened to the queries' dtype block by block (the pool stays fp8 in HBM and in the buffers);
        # int8 pages are multiplied by their per-row scales in float32, then cast to the queries' dtype.
        compute = q_ref.dtype if is_fp8(k_buf.dtype) or quantized else k_buf.dtype
        prec = lax.Precision.HIGHEST if compute == jnp.float32 else lax.Precision.DEFAULT
        for h in range(kv_heads_blk):
            q = q_ref[h]  # [R, D]
            if latent:  # the latent is the key, and the value too
                k = v = widen_fp8(k_buf[slot], compute)  # [C, D]
            elif quantized:
                k = (k_buf[slot, :, h, :].astype(jnp.float32) * ks_buf[slot][:, h : h + 1]).astype(compute)
                v = (v_buf[slot, :, h, :].astype(jnp.float32) * vs_buf[slot][:, h : h + 1]).astype(compute)
            else:
                head = (slot, h) if heads_tokens else (slot, slice(None), h)
                k = widen_fp8(k_buf[head], compute)  # [C, D]
                v = widen_fp8(v_buf[head], compute)
            # Rows of the buffer outside [lo, hi) are stale or never written: zero V so 0 * garbage can't leak.
            v = jnp.where(v_ok, v, jnp.zeros_like(v))
            s = (
                lax.dot_general(
                    q.astype(k.dtype), k, (((1,), (1,)), ((), ())), precision=prec, preferred_element_type=jnp.float32
                )
                * sm_scale
            )  # [R, C]
            if soft_cap is not None:
                s = soft_cap * jnp.tanh(s / soft_cap)
            s = jnp.where(ok, s, -jnp.inf)
            m_prev = m_ref[h][:, :1]  # [R, 1]
            m_next = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
            m_safe = jnp.where(m_next == -jnp.inf, 0.0, m_next)
            alpha = jnp.exp(m_prev - m_safe)
            p = jnp.exp(s - m_safe)
            l_next = alpha * l_ref[h][:, :1] + jnp.sum(p, axis=1, keepdims=True)
            pv = lax.dot_general(
                p.astype(v.dtype), v, (((1,), (0,)), ((), ())), precision=prec, preferred_element_type=jnp.float32
            )  # [R, D]
            acc_ref[h] = alpha * acc_ref[h] + pv
            m_ref[h] = jnp.broadcast_to(m_next, (rows, _LANES))
            l_ref[h] = jnp.broadcast_to(l_next, (rows, _LANES))

    def seq_body(s, carry):
        slot, started = carry
        info = seq_info(s)
        nxt = jnp.minimum(s + 1, seq_hi - 1)
        nxt_info = seq_info(nxt)
        has_next = (s + 1 < seq_hi) & (nxt_info["num_blocks"] > 0)

        @pl.when((info["num_blocks"] > 0) & (started == 0))
        def _():
            start(s, info, 0, slot)

        def kv_body(j, slot):
            @pl.when(j + 1 < info["num_blocks"])
            def _():
                start(s, info, j + 1, 1 - slot)

            @pl.when((j + 1 == info["num_blocks"]) & has_next)
            def _():
                start(nxt, nxt_info, 0, 1 - slot)

            wait(s, info, j, slot)
            compute(info, j, slot)
            return 1 - slot

        slot = lax.fori_loop(0, info["num_blocks"], kv_body, slot)
        return slot, ((info["num_blocks"] > 0) & has_next).astype(jnp.int32)

    # Carry: (buffer slot of the next block, whether this sequence's first block is already in flight).
    lax.fori_loop(seq_lo, seq_hi, seq_body, (jnp.int32(0), jnp.int32(0)))

    for h in range(kv_heads_blk):
        l = l_ref[h][:, :1]
        o_ref[h] = (acc_ref[h] / jnp.where(l > 0, l, 1.0)).astype(o_ref.dtype)


def _page_dims(shape: tuple[int, ...], heads_tokens: bool) -> tuple[int, int]:
    """(page_size, num_kv_heads) of a pool: [L, P, page_size, K, D] ("tokens_heads"), [L, P, K, page_size, D]
    ("heads_tokens") or a latent pool [L, P, page_size, width] (one head)."""
    if len(shape) == 4:
        return shape[2], 1
    return (shape[3], shape[2]) if heads_tokens else (shape[2], shape[3])


def default_block_sizes(num_tokens, num_seqs_padded, group, page_size, pages_per_seq, dtype):
    """(block_q, pages_per_block): query rows a multiple of the sublane tiling; ~256 context tokens a step."""
    sublanes = 8 * (4 // jnp.dtype(dtype).itemsize)  # 8 for f32, 16 for bf16
    unit = sublanes // math.gcd(group, sublanes)  # smallest block_q with block_q * group % sublanes == 0
    target_rows = 16 if num_tokens <= 2 * num_seqs_padded else 128
    block_q = unit * max(1, target_rows // (unit * group))
    pages_per_block = max(1, min(pages_per_seq, 256 // page_size))
    return block_q, pages_per_block


# Mosaic's default scoped-VMEM limit is 16 MiB on v4/v5e/v5p (32 MiB on v6e); keep the estimate below it with
# room for the kernel's [rows, context] temporaries.
_VMEM_BUDGET = 10 * 2**20


def _padded(n: int, m: int) -> int:
    return cdiv(n, m) * m


def vmem_bytes(
    kv_heads_per_block, rows, head_dim, blk_tokens, q_dtype, kv_dtype, quantized=False, sinks=False, heads_tokens=False
) -> int:
    """Estimated VMEM of one program: q/out blocks (double-buffered), K/V double buffers, softmax state, for
    int8 pools the scale buffers, and with attention sinks their input block (double-buffered, lane-replicated
    float32 rows like the running max).

    Arrays are tiled (sublanes, 128) on their last two dims; the K/V buffers' are (heads, head_dim), so
    their heads round up to 8 (f32) / 16 (bf16) / 32 (8-bit) sublanes; the scale buffers' (tokens, heads).
    """
    qb, kb = jnp.dtype(q_dtype).itemsize, jnp.dtype(kv_dtype).itemsize
    d = _padded(head_dim, _LANES)
    q_rows = _padded(rows, 8 * (4 // qb))
    q_out = 2 * 2 * kv_heads_per_block * q_rows * d * qb
    sublanes = 8 * (4 // kb)
    if heads_tokens:  # buffers [heads, tokens, head_dim]: the tokens fill the sublanes
        kv = 2 * 2 * kv_heads_per_block * _padded(blk_tokens, sublanes) * d * kb
    else:
        kv = 2 * 2 * blk_tokens * _padded(kv_heads_per_block, sublanes) * d * kb
    state = kv_heads_per_block * _padded(rows, 8) * (2 * _LANES + d) * 4
    scales = 2 * 2 * _padded(blk_tokens, 8) * _padded(kv_heads_per_block, _LANES) * 4 if quantized else 0
    sink_rows = 2 * kv_heads_per_block * _padded(rows, 8) * _LANES * 4 if sinks else 0
    return q_out + kv + state + scales + sink_rows


def default_kv_heads_per_block(
    num_kv_heads,
    rows,
    head_dim,
    blk_tokens,
    q_dtype,
    kv_dtype,
    budget=_VMEM_BUDGET,
    quantized=False,
    sinks=False,
    heads_tokens=False,
):
    """The most KV heads per program (a divisor of num_kv_heads) whose estimated VMEM fits ``budget``."""
    for h in range(num_kv_heads, 0, -1):
        need = vmem_bytes(h, rows, head_dim, blk_tokens, q_dtype, kv_dtype, quantized, sinks, heads_tokens)
        if num_kv_heads % h == 0 and need <= budget:
            return h
    return 1


def ragged_paged_attention_tpu(
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
    pages_per_block: int | None = None,
    kv_heads_per_block: int | None = None,
    vmem_limit_bytes: int | None = None,
    interpret: bool = False,
    layout: str = "tokens_heads",
) -> jax.Array:
    """Ragged paged attention on a TPU (Pallas Mosaic); same contract as ``ragged_paged_attention_ref``.

    Args:
      q, k_cache, v_cache, layer, batch, sm_scale, sliding_window, soft_cap, sinks: as in
        ``reference.ragged_paged_attention_ref``.
      block_q: query tokens per program; block_q * group should be a multiple of 8 (f32) / 16 (bf16).
      pages_per_block: pages fetched per DMA step (the double buffer holds two such blocks of K and of V).
      kv_heads_per_block: KV heads per program (a grid axis); None = as many as fit the VMEM budget.
      vmem_limit_bytes: passed to Mosaic (None: its default); the default head blocking fits 5/8 of it.
      interpret: run in Pallas' TPU interpret mode (on the CPU), which also simulates the DMAs.
      layout: the pools', "tokens_heads" or "heads_tokens" ([L, pages, kv_heads, page_size, head_dim]: each page's
        heads DMA'd as [heads, page_size, head_dim] tiles into buffers [heads, tokens, head_dim]).

    Returns:
      [T, num_q_heads, head_dim] in q.dtype; padding tokens are zeros.

    Raises:
      ValueError: inconsistent shapes or head counts, or a page table too short for a concrete kv_lens.
    """
    validate_attention_inputs(q, k_cache, v_cache, batch, sm_scale=sm_scale, soft_cap=soft_cap, layout=layout)
    num_tokens, num_q_heads, _ = q.shape
    page_size, num_kv_heads = _page_dims(k_cache.shape, layout == "heads_tokens")
    num_seqs_padded, pages_per_seq = batch.page_indices.shape
    group = num_q_heads // num_kv_heads
    dq, dp = default_block_sizes(num_tokens, num_seqs_padded, group, page_size, pages_per_seq, k_cache.dtype)
    block_q, pages_per_block = block_q or dq, pages_per_block or dp
    budget = _VMEM_BUDGET if vmem_limit_bytes is None else vmem_limit_bytes * 5 // 8  # same headroom
    kv_heads_per_block = kv_heads_per_block or default_kv_heads_per_block(
        num_kv_heads,
        block_q * group,
        q.shape[2],
        pages_per_block * page_size,
        q.dtype,
        k_cache.dtype,
        budget,
        is_int8_pages(k_cache),
        sinks is not None,
        layout == "heads_tokens",
    )
    if num_kv_heads % kv_heads_per_block:
        raise ValueError(f"kv_heads_per_block ({kv_heads_per_block}) must divide num_kv_heads ({num_kv_heads})")
    out = _rpa_tpu(
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
        pages_per_block=pages_per_block,
        kv_heads_per_block=kv_heads_per_block,
        vmem_limit_bytes=vmem_limit_bytes,
        interpret=interpret,
        layout=layout,
    )
    return settle_tpu_interpret(out, interpret)


@functools.partial(
    jax.jit,
    static_argnames=(
        "sm_scale",
        "soft_cap",
        "block_q",
        "pages_per_block",
        "kv_heads_per_block",
        "vmem_limit_bytes",
        "interpret",
        "layout",
    ),
)
def _rpa_tpu(
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
    pages_per_block,
    kv_heads_per_block,
    vmem_limit_bytes,
    interpret,
    layout,
):
    num_tokens, num_q_heads, head_dim = q.shape
    latent = k_cache.ndim == 4  # MLA: one pool of latents, each the key and the value of every query head
    heads_tokens = layout == "heads_tokens"
    page_size, num_kv_heads = _page_dims(k_cache.shape, heads_tokens)
    num_seqs_padded, pages_per_seq = page_indices.shape
    group = num_q_heads // num_kv_heads
    num_q_blocks = cdiv(num_tokens, block_q)
    padded_tokens = num_q_blocks * block_q

    # [T, K * G, D] -> [K, T_pad * G, D]: row t * G + g of head block k is token t, query head k * G + g.
    qt = jnp.pad(q, ((0, padded_tokens - num_tokens), (0, 0), (0, 0)))
    qt = qt.reshape(padded_tokens, num_kv_heads, group, head_dim).transpose(1, 0, 2, 3)
    qt = qt.reshape(num_kv_heads, padded_tokens * group, head_dim)

    # Sequences overlapping each query block; only the first num_seqs count.
    seq = jnp.arange(num_seqs_padded, dtype=jnp.int32)
    big = jnp.iinfo(jnp.int32).max
    starts = jnp.where(seq < num_seqs, cu_q_lens[:-1], big)
    ends = jnp.where(seq < num_seqs, cu_q_lens[1:], big)
    blk = jnp.arange(num_q_blocks, dtype=jnp.int32) * block_q
    blk_seq_lo = jnp.searchsorted(ends, blk, side="right", method="compare_all").astype(jnp.int32)
    blk_seq_hi = jnp.searchsorted(starts, blk + block_q, side="left", method="compare_all").astype(jnp.int32)
    blk_seq_hi = jnp.maximum(jnp.minimum(blk_seq_hi, num_seqs), blk_seq_lo)
    scalars = jnp.stack([layer.reshape(()), sliding_window.reshape(()), num_seqs.reshape(())])

    rows = block_q * group
    qo_spec = pl.BlockSpec((kv_heads_per_block, rows, head_dim), lambda hb, qb, *_: (hb, qb, 0))
    (k_values, k_scales), (v_values, v_scales) = split_pool(k_cache), split_pool(v_cache)
    quantized = k_scales is not None
    blk_tokens = pages_per_block * page_size
    shape = (kv_heads_per_block, blk_tokens) if heads_tokens else (blk_tokens, kv_heads_per_block)
    buf = pltpu.VMEM((2, *shape, head_dim), k_values.dtype)
    scale_bufs = [pltpu.VMEM((2, blk_tokens, kv_heads_per_block), jnp.float32)] * 2 if quantized else []
    pools = (k_values, v_values, k_scales, v_scales) if quantized else (k_values, v_values)
    bufs = [buf, buf, *scale_bufs]
    if latent:  # one buffer of pages, read as keys and as values
        pools, bufs = (k_values,), [pltpu.VMEM((2, blk_tokens, head_dim), k_values.dtype)]
    kernel = functools.partial(
        _kernel,
        quantized=quantized,
        sm_scale=sm_scale,
        soft_cap=soft_cap,
        block_q=block_q,
        group=group,
        pages_per_seq=pages_per_seq,
        pages_per_block=pages_per_block,
        has_sinks=sinks is not None,
        latent=latent,
        heads_tokens=heads_tokens,
    )
    # Each row's sink (row t * G + g of head block k: query head k * G + g), lane-replicated as the running max.
    sink_rows, sink_specs = (), []
    if sinks is not None:
        sink_rows = (
            jnp.broadcast_to(sinks.reshape(num_kv_heads, 1, group, 1), (num_kv_heads, block_q, group, _LANES)),
        )
        sink_rows = (sink_rows[0].reshape(num_kv_heads, rows, _LANES),)
        sink_specs = [pl.BlockSpec((kv_heads_per_block, rows, _LANES), lambda hb, qb, *_: (hb, 0, 0))]
    if interpret:
        interpret = pltpu.InterpretParams(uninitialized_memory="nan")  # unwritten VMEM reads as NaN
    out = pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct(qt.shape, q.dtype),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=6,
            grid=(num_kv_heads // kv_heads_per_block, num_q_blocks),
            in_specs=[qo_spec, *sink_specs] + [pl.BlockSpec(memory_space=pl.ANY)] * len(pools),
            out_specs=qo_spec,
            scratch_shapes=[
                *bufs,
                pltpu.SemaphoreType.DMA((len(pools), 2)),
                pltpu.VMEM((kv_heads_per_block, rows, _LANES), jnp.float32),
                pltpu.VMEM((kv_heads_per_block, rows, _LANES), jnp.float32),
                pltpu.VMEM((kv_heads_per_block, rows, head_dim), jnp.float32),
            ],
        ),
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel"), vmem_limit_bytes=vmem_limit_bytes
        ),
        interpret=interpret,
        name="ragged_paged_attention_tpu",
    )(scalars, kv_lens, page_indices.reshape(-1), cu_q_lens, blk_seq_lo, blk_seq_hi, qt, *sink_rows, *pools)
    out = out.reshape(num_kv_heads, padded_tokens, group, head_dim).transpose(1, 0, 2, 3)
    return out.reshape(padded_tokens, num_q_heads, head_dim)[:num_tokens]  # padding rows: l == 0 -> zeros
