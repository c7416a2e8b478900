"""Rotary position embeddings: the inverse frequencies of a config (with its rope scaling) and their rotation."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from jaxserve.config import ModelConfig


def rope_inv_freq(cfg: ModelConfig) -> jax.Array:
    """[H/2] inverse frequencies, with Llama-3 or linear scaling applied."""
    h = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (jnp.arange(0, h, 2, dtype=jnp.float32) / h))
    rs = cfg.rope_scaling
    if rs is None:
        return inv_freq
    if rs.rope_type == "linear":
        return inv_freq / rs.factor
    # Llama 3.1: keep high frequencies, divide low ones by `factor`, blend in between.
    low_wavelen = rs.original_max_position_embeddings / rs.low_freq_factor
    high_wavelen = rs.original_max_position_embeddings / rs.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    smooth = (rs.original_max_position_embeddings / wavelen - rs.low_freq_factor) / (
        rs.high_freq_factor - rs.low_freq_factor
    )
    blended = (1 - smooth) * inv_freq / rs.factor + smooth * inv_freq
    scaled = jnp.where(wavelen > low_wavelen, inv_freq / rs.factor, inv_freq)
    mid = (wavelen <= low_wavelen) & (wavelen >= high_wavelen)
    return jnp.where(mid, blended, scaled)


def apply_rope(x: jax.Array, positions: jax.Array, inv_freq: jax.Array) -> jax.Array:
    """Rotary embedding in the rotate-half convention (HF). x: [T, heads, H], positions: [T]."""
    freqs = positions.astype(jnp.float32)[:, None] * inv_freq[None, :]  # [T, H/2]
    cos = jnp.cos(freqs)[:, None, :]
    sin = jnp.sin(freqs)[:, None, :]
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)
