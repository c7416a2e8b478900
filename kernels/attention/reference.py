"""Plain-jnp reference for ragged paged attention (``kv_write/reference.py`` has the K/V write's).

This is the ground truth every other implementation (the Pallas kernels, the XLA blocks, the C++ kernel) is
tested against. The engine attends with it only under ``attention_impl="reference"``; on the CPU it attends with
the C++ kernel or the XLA blocks, and writes K/V with ``write_kv_ref`` only when the C++ kernel is unavailable.
Layout conventions shared by every implementation:

    q            [T, num_q_heads, head_dim]         the step's query tokens, sequences back to back
    k_cache      [L, num_pages, page_size, num_kv_heads, head_dim]   (v_cache the same), or an ``Int8Pages``:
                 int8 values of that shape and float32 scales [L, num_pages, page_size, num_kv_heads]
    layer        int32 scalar                       which layer of the cache to read
    batch        an ``AttentionBatch`` (``batch.py``) of the step's metadata; the kernels read:
    kv_lens      [S] int32   context length of each sequence INCLUDING this step's tokens
    page_indices [S, pages_per_seq] int32           page table of each sequence
    cu_q_lens    [S + 1] int32                      sequence i owns tokens cu_q_lens[i]:cu_q_lens[i+1]
    num_seqs     int32 scalar                       sequences past it are padding
    slot_mapping [T] int32   ``page * page_size + offset`` each token's K/V is written to (-1: padding)

The query tokens of sequence i sit at the last q_len_i positions of its context, so token j of the
chunk (0-based) has absolute position kv_lens[i] - q_len_i + j and attends causally to positions
<= that. ``sliding_window`` (0 = off) restricts it to the last ``sliding_window`` positions;
``soft_cap`` applies ``cap * tanh(s / cap)`` to the scores (Gemma-2). Tokens past
cu_q_lens[num_seqs] are padding and get zeros.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxserve.kernels._common import dequantize_rows, is_int8_pages
from jaxserve.kernels.attention.batch import AttentionBatch

# Below this many sequences in a step, attend densely over every sequence's gathered context and mask;
# above it, gather each token's own context. Both are exact; the switch is only about cost on the CPU.
_DENSE_MAX_SEQS = 8


def _token_seq_ids(cu_q_lens: jax.Array, num_tokens: int) -> jax.Array:
    """[T] index of the sequence that owns each token (padding tokens get an index >= num_seqs)."""
    return jnp.searchsorted(cu_q_lens[1:], jnp.arange(num_tokens, dtype=cu_q_lens.dtype), side="right")


def ragged_paged_attention_ref(
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
) -> jax.Array:
    """Attention of a ragged batch of query chunks over paged K/V, as the module docstring defines it.

    Args:
      q, k_cache, v_cache, layer, batch: the layouts above.
      sm_scale: softmax scale applied to q (a Python float).
      sliding_window: 0 = off, else attend to the last ``sliding_window`` positions; may be traced.
      soft_cap: None or ``cap`` for ``cap * tanh(s / cap)`` on the scores.
      sinks: None, or [num_q_heads] float32 attention sinks (gpt-oss): head h's logit joins its softmax's
        denominator as one more score, neither scaled nor capped, with no value: out = sum_j e^(s_j - m) v_j /
        (sum_j e^(s_j - m) + e^(sink_h - m)), m the max over the scores and the sink. May be traced.

    Returns:
      [T, num_q_heads, head_dim] in q.dtype (computed in float32); padding tokens are zeros.

    It validates nothing (``jaxserve.kernels.ragged_paged_attention`` does before calling it).
    """
    kv_lens, page_indices, cu_q_lens, num_seqs = batch.kv_lens, batch.page_indices, batch.cu_q_lens, batch.num_seqs
    num_tokens, num_q_heads, head_dim = q.shape
    _, _, page_size, num_kv_heads, _ = k_cache.shape
    num_seqs_padded, pages_per_seq = page_indices.shape
    group = num_q_heads // num_kv_heads
    max_ctx = pages_per_seq * page_size

    seq = _token_seq_ids(cu_q_lens, num_tokens)  # [T]
    valid_tok = seq < num_seqs
    seq_c = jnp.minimum(seq, num_seqs_padded - 1)
    q_len = cu_q_lens[seq_c + 1] - cu_q_lens[seq_c]
    kv_len = kv_lens[seq_c]
    pos = kv_len - q_len + (jnp.arange(num_tokens) - cu_q_lens[seq_c])  # [T] absolute position
    ctx = jnp.arange(max_ctx)
    allowed = ctx[None, :] <= pos[:, None]  # [T, C]
    window = jnp.asarray(sliding_window)
    allowed &= (window <= 0) | (ctx[None, :] > pos[:, None] - window)
    allowed &= valid_tok[:, None]

    qg = q.astype(jnp.float32).reshape(num_tokens, num_kv_heads, group, head_dim) * sm_scale
    if num_seqs_padded <= _DENSE_MAX_SEQS:
        # [S, C, K, H]: each sequence's context once; scores for every (token, sequence) pair, then keep own.
        k = _gather(k_cache, layer, page_indices).reshape(num_seqs_padded, max_ctx, num_kv_heads, head_dim)
        v = _gather(v_cache, layer, page_indices).reshape(num_seqs_padded, max_ctx, num_kv_heads, head_dim)
        # Slots past a sequence's length may hold anything (stale or NaN): 0 * NaN would leak through.
        v = jnp.where((ctx[None, :] < kv_lens[:, None])[:, :, None, None], v, 0)
        scores = jnp.einsum("tkgh,sckh->tkgsc", qg, k.astype(jnp.float32))
        own = jax.nn.one_hot(seq_c, num_seqs_padded, dtype=jnp.bool_)  # [T, S]
        mask = own[:, None, None, :, None] & allowed[:, None, None, None, :]
        scores = _cap(scores, soft_cap)
        scores = jnp.where(mask, scores, -jnp.inf)
        scores = scores.reshape(num_tokens, num_kv_heads, group, num_seqs_padded * max_ctx)
        probs = _safe_softmax(scores, sinks).reshape(num_tokens, num_kv_heads, group, num_seqs_padded, max_ctx)
        out = jnp.einsum("tkgsc,sckh->tkgh", probs, v.astype(jnp.float32))
    else:
        # [T, C, K, H]: each token's own context.
        pages = page_indices[seq_c]  # [T, P]
        k = _gather(k_cache, layer, pages).reshape(num_tokens, max_ctx, num_kv_heads, head_dim)
        v = _gather(v_cache, layer, pages).reshape(num_tokens, max_ctx, num_kv_heads, head_dim)
        v = jnp.where(allowed[:, :, None, None], v, 0)
        scores = jnp.einsum("tkgh,tckh->tkgc", qg, k.astype(jnp.float32))
        scores = _cap(scores, soft_cap)
        scores = jnp.where(allowed[:, None, None, :], scores, -jnp.inf)
        out = jnp.einsum("tkgc,tckh->tkgh", _safe_softmax(scores, sinks), v.astype(jnp.float32))
    out = jnp.where(valid_tok[:, None, None, None], out, 0.0)
    return out.reshape(num_tokens, num_q_heads, head_dim).astype(q.dtype)


def _gather(cache, layer, pages: jax.Array) -> jax.Array:
    """Rows of ``pages`` (any index shape) of one layer; an ``Int8Pages`` pool dequantized to float32."""
    if is_int8_pages(cache):
        return dequantize_rows(cache.values[layer, pages], cache.scales[layer, pages])
    return cache[layer, pages]


def _cap(scores: jax.Array, soft_cap: float | None) -> jax.Array:
    return scores if soft_cap is None else soft_cap * jnp.tanh(scores / soft_cap)


def _safe_softmax(scores: jax.Array, sinks: jax.Array | None = None) -> jax.Array:
    """Softmax over the last axis of [T, K, G, C] scores that gives zeros (not NaN) for a fully masked row; with
    ``sinks`` ([K * G] logits) each head's sink joins the denominator."""
    m = jnp.max(scores, axis=-1, keepdims=True)
    if sinks is not None:
        sink = jnp.asarray(sinks, jnp.float32).reshape(1, *scores.shape[1:3], 1)
        m = jnp.maximum(m, sink)
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    e = jnp.exp(scores - m)
    s = jnp.sum(e, axis=-1, keepdims=True)
    if sinks is not None:
        s = s + jnp.exp(sink - m)
    return e / jnp.where(s > 0, s, 1.0)
