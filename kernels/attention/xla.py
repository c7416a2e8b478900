"""Ragged paged attention in plain jnp/lax, fast enough to serve on the CPU.

Same contract as ``reference.ragged_paged_attention_ref``. The reference materializes every token's (or every
sequence's) whole context at once; on the CPU that is hundreds of MB of gathered K/V per layer, written to freshly
mapped memory and read back from DRAM. This version walks the batch instead:

    for each query block (B tokens of ONE sequence; the used blocks only, a traced trip count):
        for each context chunk the block can see (traced bounds: causal, sliding window, kv_len):
            gather the chunk's K/V rows straight from the cache   # [K, chunk, H], stays in L2
            scores [K, B*G, chunk] = q_block [K, B*G, H] . K^T     # GQA group folded into the rows
            online softmax in float32, exp computed once
        write the block's rows into the output

so the working set of one step stays in the caches (at most a few MB) and every matmul has the batch dim (kv head)
leading: K/V rows are gathered straight into [K, chunk, H], nothing is transposed. A decode token (a sequence with
one query token) is a block of 1: it reads only its own sequence's context, once, with the group's G query heads as
the rows of one [G, H] x [H, chunk] product.

Blocks never straddle sequences; they are packed on device from ``cu_q_lens``. Sequences with a single query
token (decode) get blocks of 1, chunks of 2..16 (17..64) tokens one block of 16 (64), and longer chunks blocks of
``block_q`` (from the ``max_q_len`` hint, up to 128), each class in its own loop: a mixed batch of decodes, short
chunks and a long prefill chunk pays neither the prefill's block size for every decode nor a context gather per
prefill token.
Static block counts are safe bounds for any batch: a wrong ``max_q_len`` hint can only cost speed.

Slots past a sequence's ``kv_len`` may hold anything (stale data, NaN): context indices are clamped to the last
valid slot before the gather, so every K/V row that reaches a matmul is real data and masked probabilities are
exact zeros. Rows of a block past its sequence's last token compute garbage that is never written.

The pool is gathered from as it is, by (layer, page, slot, kv head), never through a reshaped view: inside a model's
layer scan the pool is also written (the reference K/V scatter), and a reshape between that write and these loops
made XLA:CPU duplicate the write and copy the whole pool several times a layer (a decode step at 300 tokens of
context on a 512-page pool: 8 pool copies a layer, 8.6 s; gathered in place: none, 7 ms).

K/V are read in float32 whatever the pool holds: bfloat16 and fp8 rows are widened, and an ``Int8Pages`` pool's
rows are gathered with their scales (the same index) and multiplied, as ``reference.py`` dequantizes them.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jaxserve.kernels._common import cdiv, is_int8_pages, next_pow2
from jaxserve.kernels.attention import cpu as attention_cpu
from jaxserve.kernels.attention.batch import AttentionBatch, int32_metadata, valid_token_mask, validate_attention_inputs
from jaxserve.kernels.cpu import ffi

# Heuristics measured with bench/attention_cpu.py (an AVX-512 CPU). One block costs about one context
# gather plus a matmul that grows with its rows: decode is fastest at 1 token per block, long prefill at 128.
_MAX_BLOCK_Q = 128
_DEFAULT_BLOCK_Q = 32  # no hint
_CLASS_BLOCK_Q = (16, 64)  # chunks of 2..16 and 17..64 tokens get loops of their own: a loose hint wastes <= 4x
_DECODE_CHUNK = 128  # context tokens per inner step with 1-token blocks: only the used chunks are gathered
_PREFILL_CHUNK = 256  # otherwise (smaller chunks skip more of what the causal mask hides)


def default_blocking(num_tokens: int, max_ctx: int, max_q_len: int | None) -> tuple[int, int, int]:
    """(block_q, ctx_chunk, decode_chunk): block size and context chunks of multi-token and 1-token sequences."""
    if max_q_len is None or max_q_len <= 1:
        block_q = _DEFAULT_BLOCK_Q  # with the hint 1 the multi-token loop only runs if the hint was wrong
    else:
        block_q = min(next_pow2(max_q_len), _MAX_BLOCK_Q)
    block_q = min(block_q, next_pow2(num_tokens))  # no chunk is longer than the step
    return block_q, min(_PREFILL_CHUNK, max_ctx), min(_DECODE_CHUNK, max_ctx)


def ragged_paged_attention_xla(
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
    max_q_len: int | None = None,
    block_q: int | None = None,
    ctx_chunk: int | None = None,
    decode_chunk: int | None = None,
    impl: str = "auto",
) -> jax.Array:
    """Ragged paged attention in jnp/lax for the CPU; same contract as ``ragged_paged_attention_ref``.

    Args:
      q, k_cache, v_cache, layer, batch, sm_scale, sliding_window, soft_cap, sinks: as in
        ``reference.ragged_paged_attention_ref``
        (``layer``, ``sliding_window`` and ``sinks`` may be traced).
      max_q_len: optional static hint, the longest query chunk of any sequence in this step (1 for pure decode),
        bucketed. It only picks block sizes; every value gives the same result.
      block_q: query tokens per block for sequences with more than one query token (overrides the hint).
      ctx_chunk, decode_chunk: context tokens per online-softmax step for those blocks and for 1-token
        sequences (override the defaults).
      impl: who computes it: "ffi" the C++ kernel (``cpu.py``; float32, bfloat16 or fp8 caches, or
        ``Int8Pages``, on the CPU), "xla" the blocks here, "auto" the C++ kernel where it applies and could be built,
        else the blocks. (This is the lower-level choice; the public ``jaxserve.kernels.ragged_paged_attention``
        always passes "auto".)

    Returns:
      [T, num_q_heads, head_dim] in q.dtype; padding tokens are zeros.

    Raises:
      ValueError: inconsistent shapes or head counts, a bad hint, block size or ``impl``, ``impl="ffi"`` on caches
        it cannot read, an int8 pool that is not ``Int8Pages`` (or only one of the two caches is), or a page table
        too short for a concrete kv_lens.
      RuntimeError: ``impl="ffi"`` and the C++ kernel could not be built (naming why).
    """
    validate_attention_inputs(q, k_cache, v_cache, batch, sm_scale=sm_scale, soft_cap=soft_cap)
    if max_q_len is not None and (not isinstance(max_q_len, int) or max_q_len < 0):
        raise ValueError(f"max_q_len must be None or a static int >= 0, got {max_q_len!r}")
    max_ctx = batch.page_indices.shape[1] * k_cache.shape[2]
    d_block_q, d_chunk, d_decode_chunk = default_blocking(q.shape[0], max_ctx, max_q_len)
    sizes = dict(
        block_q=block_q or d_block_q,
        ctx_chunk=min(ctx_chunk or d_chunk, max_ctx),
        decode_chunk=min(decode_chunk or d_decode_chunk, max_ctx),
    )
    for name, val in sizes.items():
        if not isinstance(val, int) or val < 1:
            raise ValueError(f"{name} must be a positive int, got {val!r}")
    no_window = isinstance(sliding_window, int) and sliding_window <= 0  # statically off: no window mask at all
    if impl not in ("auto", "ffi", "xla"):
        raise ValueError(f"impl must be 'auto', 'ffi' or 'xla', got {impl!r}")
    fits = k_cache.dtype == v_cache.dtype and attention_cpu.serves(k_cache.dtype)
    if impl == "ffi":
        if not fits:
            raise ValueError(
                "impl='ffi' needs float32, bfloat16 or fp8 caches (or Int8Pages) on the CPU backend, got "
                f"{k_cache.dtype} on {jax.default_backend()}"
            )
        if not ffi.available():
            raise RuntimeError(f"impl='ffi': the C++ paged attention is unavailable: {ffi.unavailable_reason()}")
    if impl == "ffi" or (impl == "auto" and fits and ffi.available()):
        out = attention_cpu.paged_attention(
            q,
            k_cache,
            v_cache,
            layer,
            batch,
            sliding_window=0 if no_window else sliding_window,
            sm_scale=sm_scale,
            soft_cap=soft_cap,
            sinks=sinks,
        )
        return out.astype(q.dtype)
    return _rpa_xla(
        q,
        k_cache,
        v_cache,
        jnp.asarray(layer, jnp.int32),
        *int32_metadata(batch),
        jnp.asarray(sliding_window, jnp.int32),
        None if sinks is None else jnp.asarray(sinks, jnp.float32),
        sm_scale=float(sm_scale),
        soft_cap=None if soft_cap is None else float(soft_cap),
        has_window=not no_window,
        **sizes,
    )


def _pack_blocks(q_lens, cu_q_lens, kv_lens, take, block_q: int, num_blocks: int):
    """Blocks of ``block_q`` tokens over the sequences with ``take``, in sequence order.

    Returns (seq, tok0, pos0, rows, count): [num_blocks] owner, first token, that token's position in the context,
    real tokens of each block, and the traced number of blocks in use (the first ``count``; the rest are junk).
    ``num_blocks`` must bound the count.
    """
    per_seq = jnp.where(take, cdiv(q_lens, block_q), 0)  # [S]
    ends = jnp.cumsum(per_seq)
    b = jnp.arange(num_blocks, dtype=jnp.int32)
    owner = jnp.searchsorted(ends, b, side="right", method="compare_all")  # not a loop of tiny ops per layer
    seq = jnp.minimum(owner, q_lens.shape[0] - 1).astype(jnp.int32)
    first = (b - (ends[seq] - per_seq[seq])) * block_q  # block's first token within its sequence
    pos0 = kv_lens[seq] - q_lens[seq] + first
    return seq, cu_q_lens[seq] + first, pos0, jnp.clip(q_lens[seq] - first, 0, block_q), ends[-1]


@functools.partial(
    jax.jit, static_argnames=("sm_scale", "soft_cap", "has_window", "block_q", "ctx_chunk", "decode_chunk")
)
def _rpa_xla(
    q,
    k_cache,
    v_cache,
    layer,
    kv_lens,
    page_indices,
    cu_q_lens,
    num_seqs,
    window,
    sinks,
    *,
    sm_scale,
    soft_cap,
    has_window,
    block_q,
    ctx_chunk,
    decode_chunk,
):
    num_tokens, num_q_heads, head_dim = q.shape
    kv_heads = k_cache.shape[3] if k_cache.ndim == 5 else 1  # a latent pool: one KV head
    num_seqs_padded = page_indices.shape[0]
    group = num_q_heads // kv_heads
    seq_ids = jnp.arange(num_seqs_padded, dtype=jnp.int32)
    q_lens = jnp.where(seq_ids < num_seqs, jnp.maximum(cu_q_lens[1:] - cu_q_lens[:-1], 0), 0)  # [S]

    # [T + B, K, G, H]: scaled once; padded so a block's slice never runs off the end.
    qs = (q.astype(jnp.float32) * sm_scale).reshape(num_tokens, kv_heads, group, head_dim)
    qs = jnp.pad(qs, ((0, block_q), (0, 0), (0, 0), (0, 0)))
    out = jnp.zeros((num_tokens + block_q, kv_heads, group, head_dim), jnp.float32)
    attend = functools.partial(
        _attend_blocks,
        qs,
        k_cache,
        v_cache,
        layer,
        kv_lens,
        page_indices,
        window,
        sinks,
        soft_cap=soft_cap,
        has_window=has_window,
    )

    # Classes of sequences by query length (lo, hi, block size), each in its own loop: decode tokens one per block;
    # chunks up to 16 (64) tokens one block of 16 (64), when block_q is larger; the longest blocks of block_q.
    classes, lo = [(1, 1, 1)], 2
    for size in [b for b in _CLASS_BLOCK_Q if b < block_q]:
        classes.append((lo, size, size))
        lo = size + 1
    classes.append((lo, None, block_q))
    for lo, hi, size in classes:
        if num_tokens < lo:
            continue
        seqs = min(num_seqs_padded, num_tokens // lo)  # static bounds: sequences, then blocks, of the class
        blocks = seqs if hi is not None and hi <= size else min(num_tokens, num_tokens // size + seqs)
        take = (q_lens >= lo) if hi is None else (q_lens >= lo) & (q_lens <= hi)
        out = attend(
            out,
            *_pack_blocks(q_lens, cu_q_lens, kv_lens, take, size, blocks),
            block_q=size,
            ctx_chunk=decode_chunk if size == 1 else ctx_chunk,
        )

    out = out[:num_tokens].reshape(num_tokens, num_q_heads, head_dim)
    valid = valid_token_mask(cu_q_lens, num_seqs, num_tokens)
    return jnp.where(valid[:, None, None], out, 0.0).astype(q.dtype)


def _attend_blocks(
    qs,
    k_cache,
    v_cache,
    layer,
    kv_lens,
    page_indices,
    window,
    sinks,
    out,
    blk_seq,
    blk_tok0,
    blk_pos0,
    blk_rows,
    count,
    *,
    soft_cap,
    has_window,
    block_q,
    ctx_chunk,
):
    """Attention of the first ``count`` blocks; writes their real rows into ``out`` [T + pad, K, G, H]."""
    _, kv_heads, group, head_dim = qs.shape
    page_size = k_cache.shape[2]
    rows = block_q * group  # matmul rows per kv head: [block_q tokens x group heads], token-major
    num_chunks = cdiv(page_indices.shape[1] * page_size, ctx_chunk)
    k_rows, v_rows = _rows(k_cache), _rows(v_cache)
    # The KV head index [K, 1]; none for a latent pool [L, pages, page_size, width] (one head, no head axis)
    kv_head = (jnp.arange(kv_heads, dtype=jnp.int32)[:, None],) if k_cache.ndim == 5 else ()
    row_tok = jnp.arange(rows, dtype=jnp.int32) // group  # [R] token offset of each matmul row
    if sinks is not None:  # [K, R, 1]: row r of KV head k is query head k * group + r % group
        row_sinks = sinks.reshape(kv_heads, group)[:, jnp.arange(rows) % group, None]

    def block(i, out):
        tok0, pos0, n_rows = blk_tok0[i], blk_pos0[i], blk_rows[i]
        kv_len = kv_lens[blk_seq[i]]
        pages = page_indices[blk_seq[i]]  # [P]
        qb = lax.dynamic_slice_in_dim(qs, tok0, block_q).transpose(1, 0, 2, 3).reshape(kv_heads, rows, head_dim)
        pos = pos0 + row_tok  # [R] position of each row's token in its context

        def chunk(j, carry):
            m, denom, acc = carry  # [K, R, 1] running max, [K, R, 1] running sum, [K, R, H]
            ctx = j * ctx_chunk + jnp.arange(ctx_chunk, dtype=jnp.int32)  # [C']
            c = jnp.clip(ctx, 0, jnp.maximum(kv_len - 1, 0))  # past kv_len: re-read the last real slot
            idx = (layer, pages[c // page_size][None, :], (c % page_size)[None, :], *kv_head)  # [K, C'] each
            k = _gather_rows(k_rows, idx)  # [K, C', H] float32
            v = _gather_rows(v_rows, idx)
            s = jnp.einsum("krh,kch->krc", qb, k)  # [K, R, C']
            if soft_cap is not None:
                s = soft_cap * jnp.tanh(s / soft_cap)
            allowed = ctx[None, :] <= pos[:, None]  # [R, C']
            if has_window:
                allowed &= (window <= 0) | (ctx[None, :] > pos[:, None] - window)
            s = jnp.where(allowed[None], s, -jnp.inf)
            m_new = jnp.maximum(m, jnp.max(s, axis=-1, keepdims=True))
            m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)  # a row that saw nothing yet stays all-zero
            e = jnp.exp(s - m_safe)
            alpha = jnp.exp(m - m_safe)
            denom = alpha * denom + jnp.sum(e, axis=-1, keepdims=True)
            acc = alpha * acc + jnp.einsum("krc,kch->krh", e, v)
            return m_new, denom, acc

        init = (
            jnp.full((kv_heads, rows, 1), -jnp.inf, jnp.float32),
            jnp.zeros((kv_heads, rows, 1), jnp.float32),
            jnp.zeros((kv_heads, rows, head_dim), jnp.float32),
        )
        if sinks is not None:  # each row starts as if it had seen one key of score its sink and value 0
            init = (row_sinks, jnp.ones_like(init[1]), init[2])
        if num_chunks == 1:
            _, denom, acc = chunk(0, init)
        else:  # only the chunks some real row can see
            last = jnp.minimum(pos0 + n_rows, kv_len)  # one past the last visible position
            first = jnp.where(window > 0, jnp.maximum(pos0 - window + 1, 0), 0) if has_window else 0
            _, denom, acc = lax.fori_loop(first // ctx_chunk, cdiv(last, ctx_chunk), chunk, init)
        o = acc / jnp.where(denom > 0, denom, 1.0)  # [K, R, H]; rows that saw nothing: 0
        o = o.reshape(kv_heads, block_q, group, head_dim).transpose(1, 0, 2, 3)  # [B, K, G, H]
        if block_q > 1:  # rows past the sequence's end keep what is there (another sequence's tokens)
            keep = jnp.arange(block_q) >= n_rows
            o = jnp.where(keep[:, None, None, None], lax.dynamic_slice_in_dim(out, tok0, block_q), o)
        return lax.dynamic_update_slice_in_dim(out, o, tok0, 0)

    return lax.fori_loop(0, count, block, out)


def _rows(cache):
    """(values [L, P, S, K, H], scales [L, P, S, K] or None): a pool, an ``Int8Pages`` with its scales."""
    if is_int8_pages(cache):
        return cache.values, cache.scales
    return cache, None


def _gather_rows(pool, idx):
    """float32 rows [..., H] at ``idx`` (layer, page, slot, kv head; broadcast together) of ``_rows``' pool:
    widened, or int8 times each row's scale."""
    rows, scales = pool
    out = rows.at[idx].get(mode="promise_in_bounds").astype(jnp.float32)
    if scales is None:
        return out
    return out * scales.at[idx].get(mode="promise_in_bounds")[..., None]
