"""Rotary position embeddings (rotate-half convention, as HF transformers): a layer kind's frequencies, with its
rope scaling, turned into cos / sin tables once per step and applied to q and k in every layer.

Scalings (``jaxserve.config.RopeScaling.rope_type``):
  "linear"    positions divided by ``factor``.
  "llama3"    Llama 3.1: low frequencies divided by ``factor``, high ones kept, blended in between.
  "yarn"      YaRN (Qwen2.5 / Qwen3 long context, DeepSeek): frequencies interpolated by ``factor`` below a
              band of dimensions and kept above it, with a linear ramp between ``beta_slow`` and ``beta_fast``
              rotations; cos / sin scaled by the attention factor (``0.1 ln(factor) + 1`` unless given).
  "longrope"  Phi-3 / Phi-4-mini: per-frequency divisors, ``short_factor`` for positions below
              ``original_max_position_embeddings`` and ``long_factor`` from there on (per position, so that a
              cached key's rotation never depends on later tokens), cos / sin scaled by
              ``sqrt(1 + ln(factor) / ln(original))``.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.config import ModelConfig, RopeScaling


@dataclasses.dataclass(frozen=True)
class Rope:
    """The rotary embedding of one kind of layer: how many leading dims of each head it rotates (``dim``: the
    config's ``rotary_dim``, the rest passing through), its base and its scaling (``None``: plain rope)."""

    dim: int
    theta: float
    scaling: RopeScaling | None = None

    @classmethod
    def of(cls, cfg: ModelConfig) -> Rope:
        """The rope of ``cfg``'s layers."""
        return cls(cfg.rotary_dim, cfg.rope_theta, cfg.rope_scaling)

    def inv_freq(self, long: bool = False) -> np.ndarray:
        """[R/2] float64 inverse frequencies, R the rotated dims (``long``: longrope's for positions past the
        original context)."""
        h = self.dim
        base = 1.0 / self.theta ** (np.arange(0, h, 2, dtype=np.float64) / h)
        rs = self.scaling
        if rs is None:
            return base
        if rs.rope_type == "linear":
            return base / rs.factor
        if rs.rope_type == "llama3":
            low_wavelen = rs.original_max_position_embeddings / rs.low_freq_factor
            high_wavelen = rs.original_max_position_embeddings / rs.high_freq_factor
            wavelen = 2 * math.pi / base
            smooth = (rs.original_max_position_embeddings / wavelen - rs.low_freq_factor) / (
                rs.high_freq_factor - rs.low_freq_factor
            )
            blended = (1 - smooth) * base / rs.factor + smooth * base
            scaled = np.where(wavelen > low_wavelen, base / rs.factor, base)
            mid = (wavelen <= low_wavelen) & (wavelen >= high_wavelen)
            return np.where(mid, blended, scaled)
        if rs.rope_type == "yarn":
            return self._yarn(base)
        if rs.rope_type == "longrope":
            return base / np.asarray(rs.long_factor if long else rs.short_factor, np.float64)
        raise ValueError(f"rope_type {rs.rope_type!r} has no frequencies here")  # RopeScaling refuses it first

    def _yarn(self, base: np.ndarray) -> np.ndarray:
        rs, h = self.scaling, self.dim

        def dim_of(rotations: float) -> float:  # the dimension that turns ``rotations`` times over the context
            return (
                h
                * math.log(rs.original_max_position_embeddings / (rotations * 2 * math.pi))
                / (2 * math.log(self.theta))
            )

        low, high = dim_of(rs.beta_fast), dim_of(rs.beta_slow)
        if rs.truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, h - 1)
        if low == high:
            high += 0.001
        ramp = np.clip((np.arange(h // 2, dtype=np.float64) - low) / (high - low), 0, 1)  # 0: keep, 1: interpolate
        return base / rs.factor * ramp + base * (1 - ramp)

    @property
    def attention_factor(self) -> float:
        """What cos / sin are scaled by (q . k by its square): 1 except under YaRN and longrope."""
        rs = self.scaling
        if rs is None or rs.rope_type not in ("yarn", "longrope"):
            return 1.0
        if rs.attention_factor is not None:
            return rs.attention_factor
        if rs.rope_type == "longrope":
            if rs.factor <= 1:
                return 1.0
            return math.sqrt(1 + math.log(rs.factor) / math.log(rs.original_max_position_embeddings))

        def mscale(scale: float, m: float = 1.0) -> float:
            return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

        if rs.mscale and rs.mscale_all_dim:
            return mscale(rs.factor, rs.mscale) / mscale(rs.factor, rs.mscale_all_dim)
        return mscale(rs.factor)

    def tables(self, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
        """(cos, sin), each [..., T, H/2] float32, for the tokens' absolute ``positions`` [..., T] (pipeline stages
        stack one step's per stage); computed once per step and shared by every layer of this kind."""
        pos = positions.astype(jnp.float32)[..., None]
        freqs = pos * jnp.asarray(self.inv_freq(), jnp.float32)[None, :]
        rs = self.scaling
        if rs is not None and rs.rope_type == "longrope":
            long = pos * jnp.asarray(self.inv_freq(long=True), jnp.float32)[None, :]
            freqs = jnp.where(pos >= rs.original_max_position_embeddings, long, freqs)
        scale = self.attention_factor
        return jnp.cos(freqs) * scale, jnp.sin(freqs) * scale


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotates x [T, heads, H] by the tables of :meth:`Rope.tables` ([T, R/2] each), rotate-half convention over
    the leading R dims of each head; the others pass through (partial rotary)."""
    r = 2 * cos.shape[-1]
    cos, sin = cos[:, None, :], sin[:, None, :]
    x1, x2 = jnp.split(x[..., :r].astype(jnp.float32), 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)
    return out if r == x.shape[-1] else jnp.concatenate([out, x[..., r:]], axis=-1)
