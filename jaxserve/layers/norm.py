"""RMSNorm, with the ``1 + w`` scale of the Gemma families as ``offset``."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def rms_norm(x: jax.Array, w: jax.Array, eps: float, offset: float) -> jax.Array:
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return (xf * (offset + w.astype(jnp.float32))).astype(x.dtype)
