"""Multi-head latent attention (DeepSeek-V2/V3, Kimi-K2) over a latent page pool, with the up-projections absorbed.

MLA caches one latent a token and layer: ``c`` [R] (``kv_lora_rank``, after ``kv_a_layernorm``) and the shared
rotary key ``k_pe`` [r] (``qk_rope_head_dim``, rotated), stored side by side as ``[c ; k_pe]`` in a pool

    latent_cache [L, num_pages, page_size, R + r]

Head h's key and value are up-projections of ``c``: ``k_h = [W_uk[h] c ; k_pe]`` and ``v_h = W_uv[h] c``, with
``W_uk`` [H, d_nope, R] and ``W_uv`` [H, d_v, R] the two halves of ``kv_b_proj``. Their products move onto the query
and the output instead (the absorption): ``q_h . k_h = (W_uk[h]^T q_nope_h) . c + q_pe_h . k_pe``, and the output
``sum_t p_t v_h(t) = W_uv[h] (sum_t p_t c_t)``. So attention reads only latents, and is GQA with one KV head of
R + r dims whose value is the same vector: ``mla_attention`` runs any of jaxserve's ragged paged attentions on it
(the value's last r dims, ``k_pe``'s, come out as well and are dropped). ``absorb_query`` and ``expand_output`` are
the two products around it. ``jaxserve.kernels.ragged_paged_attention`` takes the 4-D pool as it is: the Pallas TPU
kernel DMAs its pages once for keys and values (its minor dims (page_size, R + r) are the TPU's tiles, where a
one-head axis would be padded), the other implementations read it as one KV head ``[L, pages, page_size, 1, R + r]``
(a view: no copy on the CPU or a GPU).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxserve.kernels.attention.batch import AttentionBatch
from jaxserve.kernels.attention.reference import ragged_paged_attention_ref


def absorb_query(q_nope: jax.Array, w_uk: jax.Array) -> jax.Array:
    """q_nope [T, H, d_nope], W_uk [H, d_nope, R] -> the latent queries [T, H, R] (``W_uk[h]^T q_nope_h``)."""
    return jnp.einsum("thd,hdr->thr", q_nope, w_uk, preferred_element_type=jnp.float32).astype(q_nope.dtype)


def expand_output(context: jax.Array, w_uv: jax.Array) -> jax.Array:
    """The attention's latent output [T, H, R], W_uv [H, d_v, R] -> each head's values [T, H, d_v]."""
    return jnp.einsum("thr,hvr->thv", context, w_uv, preferred_element_type=jnp.float32).astype(context.dtype)


def mla_attention(
    q_latent: jax.Array,
    q_rope: jax.Array,
    latent_cache: jax.Array,
    layer: jax.Array | int,
    batch: AttentionBatch,
    *,
    sm_scale: float,
    attention=None,
    **kwargs,
) -> jax.Array:
    """Absorbed MLA over the latent pool -> [T, H, R], the softmax-weighted sum of each head's latents (padding
    tokens zeros).

    Args:
      q_latent: [T, H, R] (``absorb_query``); q_rope: [T, H, r], the rotated query part.
      latent_cache: [L, num_pages, page_size, R + r], each token's ``[c ; k_pe]``.
      layer, batch: as for ``ragged_paged_attention`` (``batch`` reads kv_lens, page_indices, cu_q_lens,
        num_seqs).
      sm_scale: the softmax scale of the full query head (1 / sqrt(d_nope + r), times YaRN's factor squared).
      attention: the ragged paged attention to run on (q, latent_cache, latent_cache, layer, batch) (default: the
        jnp reference; ``jaxserve.kernels.ragged_paged_attention`` for any other); ``kwargs`` go to it.
    """
    attention = attention or _reference
    rank = q_latent.shape[-1]
    if latent_cache.ndim != 4 or latent_cache.shape[-1] != rank + q_rope.shape[-1]:
        raise ValueError(
            f"latent_cache must be [layers, pages, page_size, {rank} + {q_rope.shape[-1]}] for q_latent "
            f"{q_latent.shape} and q_rope {q_rope.shape}, got {latent_cache.shape}"
        )
    q = jnp.concatenate([q_latent, q_rope.astype(q_latent.dtype)], axis=-1)
    return attention(q, latent_cache, latent_cache, layer, batch, sm_scale=sm_scale, **kwargs)[..., :rank]


def _reference(q, k_cache, v_cache, layer, batch, **kwargs):
    """The jnp reference over a latent pool, read as one KV head whose key and value are the latent."""
    pool = k_cache[:, :, :, None, :]
    return ragged_paged_attention_ref(q, pool, pool, layer, batch, **kwargs)
