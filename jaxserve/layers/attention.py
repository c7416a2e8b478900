"""The attention blocks of a layer, from its normed hidden states to the output projection: grouped-query attention
(``gqa_attention``: every family but DeepSeek's) and multi-head latent attention (``mla_attention``: DeepSeek-V2/V3,
Kimi-K2), each writing the step's K/V (or latents) into the pool on the way.

Both take the same arguments, so the decoder picks one per model: the config, the normed hidden states h [T, D],
one layer's parameters ``p`` (declared by ``jaxserve.models.schema.attention_block`` / ``mla_block``), its products
``mul``, the pool's (k_cache, v_cache), and what the layer reads of the step. Attention and the K/V write are the
``attention_fn`` / ``write_kv_fn`` the decoder is given (any kernel of ``jaxserve.kernels``), never a kernel named
here.

Dimension letters: T tokens in the step, D hidden, N query heads, K kv heads, H head_dim.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.config import ModelConfig
from jaxserve.kernels import AttentionBatch
from jaxserve.kernels.attention import mla
from jaxserve.layers.linear import Product
from jaxserve.layers.norm import rms_norm
from jaxserve.layers.rope import apply_rope

# attention_fn(q, k_cache, v_cache, layer, batch, *, sm_scale, sliding_window, soft_cap) -> [T, N, H]
AttentionFn = Callable[..., jax.Array]
# write_kv_fn(k_cache, v_cache, layer, new_k, new_v, batch) -> (k_cache, v_cache)
WriteKVFn = Callable[..., tuple[jax.Array, jax.Array]]


def gqa_attention(
    cfg: ModelConfig,
    h: jax.Array,
    p: dict[str, jax.Array],
    mul: Product,
    caches: tuple[jax.Array, jax.Array],
    *,
    cache_idx: jax.Array,
    batch: AttentionBatch,
    rope: tuple[jax.Array, jax.Array],
    local_rope: tuple[jax.Array, jax.Array] | None,
    window: jax.Array,
    attention_fn: AttentionFn,
    write_kv_fn: WriteKVFn,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Grouped-query attention on the normed hidden states h [T, D] -> (output [T, D], k_cache, v_cache).

    q, k, v projections (with Qwen2's biases), per-head q / k norms (Qwen3, Gemma 3), rotary embeddings (``rope``'s
    cos / sin [T, H/2]; Gemma 3's sliding-window layers, ``window > 0``, take ``local_rope``'s), the new K/V written
    into the pool at entry ``cache_idx``, attention over it (sliding window, soft cap, gpt-oss's sinks) and the
    output projection (with gpt-oss's bias).
    """
    N, K, H = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    eps, off = cfg.rms_norm_eps, cfg.norm_weight_offset
    T = h.shape[0]
    (cos, sin), (k_cache, v_cache) = rope, caches
    q, k, v = mul(h, ("wq", "wk", "wv"))
    if cfg.attention_bias:
        q, k, v = q + p["bq"], k + p["bk"], v + p["bv"]
    q, k, v = q.reshape(T, N, H), k.reshape(T, K, H), v.reshape(T, K, H)
    if cfg.qk_norm:
        q, k = rms_norm(q, p["q_norm"], eps, off), rms_norm(k, p["k_norm"], eps, off)
    if cfg.local_rope_theta is None:
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    else:
        c, s = jnp.where(window > 0, local_rope[0], cos), jnp.where(window > 0, local_rope[1], sin)
        q, k = apply_rope(q, c, s), apply_rope(k, c, s)
    k_cache, v_cache = write_kv_fn(k_cache, v_cache, cache_idx, k, v, batch)
    sinks = {"sinks": p["sinks"]} if cfg.attention_sinks else {}
    attn = attention_fn(
        q,
        k_cache,
        v_cache,
        cache_idx,
        batch,
        sm_scale=cfg.attn_scale,
        sliding_window=window,
        soft_cap=cfg.attn_logit_softcap,
        **sinks,
    )  # [T, N, H]
    o = mul(attn.reshape(T, N * H), "wo")
    if cfg.o_bias:
        o = o + p["bo"]
    return o, k_cache, v_cache


def mla_attention(
    cfg: ModelConfig,
    h: jax.Array,
    p: dict[str, jax.Array],
    mul: Product,
    caches: tuple[jax.Array, jax.Array],
    *,
    cache_idx: jax.Array,
    batch: AttentionBatch,
    rope: tuple[jax.Array, jax.Array],
    local_rope: tuple[jax.Array, jax.Array] | None,
    window: jax.Array,
    attention_fn: AttentionFn,
    write_kv_fn: WriteKVFn,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Multi-head latent attention, absorbed (``jaxserve.kernels.attention.mla``), on the normed hidden states
    h [T, D] -> (output [T, D], k_cache, v_cache).

    The query (directly, or through the low-rank ``wq_a``, its norm and ``wq_b``), the latent ``[c ; k_pe]`` (c
    normed, k_pe the shared rotary key) written into the latent pool (k_cache; v_cache is passed through), the
    query's no-rope part absorbed into the latent space by ``wkv_b``'s key half, attention over the latents, and
    the output expanded by ``wkv_b``'s value half before ``wo``. ``local_rope`` is not read (MLA does not combine
    with sliding windows).
    """
    N, H = cfg.num_heads, cfg.head_dim
    eps, off = cfg.rms_norm_eps, cfg.norm_weight_offset
    T = h.shape[0]
    (cos, sin), (k_cache, v_cache) = rope, caches
    R, dn, dv = cfg.kv_lora_rank, cfg.qk_nope_head_dim, cfg.v_head_dim
    q = mul(h, "wq") if cfg.q_lora_rank is None else mul(rms_norm(mul(h, "wq_a"), p["q_a_norm"], eps, off), "wq_b")
    q = q.reshape(T, N, H)
    q_nope, q_pe = q[..., :dn], q[..., dn:]
    kv = mul(h, "wkv_a")  # [T, R + r]: the latent c before its norm, and the shared rotary key
    c, k_pe = rms_norm(kv[:, :R], p["kv_a_norm"], eps, off), kv[:, None, R:]
    if cfg.rope_interleave:  # pairs (x0, x1), (x2, x3) ...: rotated as halves, the same order in q and k
        r = cfg.rotary_dim
        deinterleave = np.concatenate([np.arange(0, r, 2), np.arange(1, r, 2)])
        q_pe, k_pe = q_pe[..., deinterleave], k_pe[..., deinterleave]
    q_pe, k_pe = apply_rope(q_pe, cos, sin), apply_rope(k_pe, cos, sin)
    latent = jnp.concatenate([c, k_pe[:, 0].astype(c.dtype)], axis=-1)  # [T, R + r]
    k_cache, v_cache = write_kv_fn(k_cache, v_cache, cache_idx, latent, latent, batch)  # the latent pool
    w = p["wkv_b"].reshape(R, N, dn + dv)  # each head's key (d_nope) and value (d_v) up-projections
    q_latent = mla.absorb_query(q_nope, w[..., :dn].transpose(1, 2, 0))  # [T, N, R]
    context = mla.mla_attention(  # over the latent pool: each latent is every head's key and value
        q_latent,
        q_pe,
        k_cache,
        cache_idx,
        batch,
        sm_scale=cfg.attn_scale,
        attention=attention_fn,
        sliding_window=window,
        soft_cap=None,
    )
    out = mla.expand_output(context, w[..., dn:].transpose(1, 2, 0))  # [T, N, d_v]
    return mul(out.reshape(T, N * dv), "wo"), k_cache, v_cache
