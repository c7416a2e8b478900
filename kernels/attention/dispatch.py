"""The attention entry point: checks a call's pools and options, then runs the implementation ``impl`` picks
(``kernels/dispatch.py``) on this platform."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxserve.kernels._common import is_fp8, is_int8_pages
from jaxserve.kernels.attention.batch import POOL_LAYOUTS, AttentionBatch, validate_attention_inputs
from jaxserve.kernels.attention.gpu import ragged_paged_attention_gpu
from jaxserve.kernels.attention.reference import ragged_paged_attention_ref
from jaxserve.kernels.attention.tpu import ragged_paged_attention_tpu
from jaxserve.kernels.attention.xla import ragged_paged_attention_xla
from jaxserve.kernels.dispatch import choose_kernel


def ragged_paged_attention(
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
    impl: str = "auto",
    interpret: bool | None = None,
    backend: str | None = None,
    max_q_len: int | None = None,
    layout: str = "tokens_heads",
    **kernel_options,
) -> jax.Array:
    """Attention of a ragged batch of query chunks over the paged KV cache.

    Args:
      q: [T, num_q_heads, head_dim], the step's query tokens, sequences back to back.
      k_cache, v_cache: [L, num_pages, page_size, num_kv_heads, head_dim], the whole pool (or ``Int8Pages``); or
        a latent pool (multi-head latent attention, ``attention/mla.py``) k_cache [L, num_pages, page_size, width]
        whose rows are each token's key and value for every query head (v_cache is not read).
      layer: int32 scalar (may be traced), which layer of the pool to read.
      batch: the step's ``AttentionBatch``; attention reads
        kv_lens: [S] context length of each sequence including this step's tokens,
        page_indices: [S, pages_per_seq] page table,
        cu_q_lens: [S + 1] sequence i owns tokens cu_q_lens[i]:cu_q_lens[i + 1],
        num_seqs: int32 scalar; sequences past it (and their tokens) are padding.
      sm_scale: softmax scale (a Python float).
      sliding_window: 0 = off, else attend to the last ``sliding_window`` positions; may be traced.
      soft_cap: None or ``cap`` for ``cap * tanh(s / cap)`` on the scores.
      sinks: None, or [num_q_heads] float32 attention sinks (gpt-oss): each head's logit joins its softmax's
        denominator, with no value; may be traced (a layer's slice inside the layer scan).
      impl, backend, interpret: see ``kernels/dispatch.py``.
      max_q_len: optional static hint, the longest query chunk of any sequence in this step (1 for pure decode);
        "xla" picks its block size from it, the others ignore it. Any value gives the same result.
      layout: the pools', "tokens_heads" (the shape above) or "heads_tokens" ([L, num_pages, num_kv_heads,
        page_size, head_dim], the TPU's unpadded one): the TPU kernel reads it as it is, the others a transposed
        copy (for tests).
      **kernel_options: block sizes etc. for the chosen Pallas kernel or for "xla" (ignored by the reference).

    Returns:
      [T, num_q_heads, head_dim] in q.dtype; padding tokens are zeros.

    Raises:
      ValueError: bad impl/backend, inconsistent shapes, head counts that do not divide, or (when batch.kv_lens
        is concrete) a page table too short for the longest context.
    """
    kernel, interp = choose_kernel(impl, backend, interpret)
    if k_cache.ndim == 4:  # a latent pool (MLA): keys and values alike; the TPU kernel and the CPU's (C++ and XLA)
        # read it as it is (a view between the pool's write and the CPU's reads copied the pool), the others as one
        # KV head
        k_cache = v_cache = k_cache if kernel in ("tpu", "xla") else k_cache[:, :, :, None, :]
    elif layout == "heads_tokens" and kernel != "tpu":
        k_cache, v_cache = jnp.swapaxes(k_cache, 2, 3), jnp.swapaxes(v_cache, 2, 3)
    elif kernel == "tpu":
        kernel_options["layout"] = layout
    elif layout != "tokens_heads":
        raise ValueError(f"layout must be one of {POOL_LAYOUTS}, got {layout!r}")
    if sinks is not None and jnp.shape(sinks) != (q.shape[1],):
        raise ValueError(f"sinks must be [num_q_heads] = [{q.shape[1]}], got shape {jnp.shape(sinks)}")
    args = (q, k_cache, v_cache, layer, batch)
    kw = dict(sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap, sinks=sinks)
    if kernel == "reference":
        validate_attention_inputs(q, k_cache, v_cache, batch, sm_scale=sm_scale, soft_cap=soft_cap)
        return ragged_paged_attention_ref(*args, **kw)
    if kernel == "xla":
        return ragged_paged_attention_xla(*args, **kw, max_q_len=max_q_len, **kernel_options)
    fn = ragged_paged_attention_gpu if kernel == "gpu" else ragged_paged_attention_tpu
    # The kernels' products take one element type: q in the cache's (as vLLM does); fp8 pages are widened to q's,
    # int8 pages (Int8Pages) dequantized to it.
    if q.dtype != k_cache.dtype and not is_fp8(k_cache.dtype) and not is_int8_pages(k_cache):
        out = fn(q.astype(k_cache.dtype), *args[1:], **kw, **kernel_options, interpret=interp)
        return out.astype(q.dtype)
    return fn(*args, **kw, **kernel_options, interpret=interp)
