"""The quantized-weight layout (``QArray``) that the C++ rows products and the dequantization read, and the product
of rows by a dequantized weight; ``jaxserve.quant`` quantizes weights into it and computes with it."""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class QArray:
    """A quantized weight (a pytree: ``q``, ``scale``, ``zero`` are its leaves; the rest is static).

    Attributes:
        q: values: int8 (8 bits), uint8 holding two 4-bit values (4 bits; ``axis`` halved), or float8_e4m3fn.
        scale: [..., groups along ``axis``, ...] the scales; same rank as ``q``.
        zero: additive term of the same shape as ``scale``, or None (symmetric).
        scale_mul, zero_mul: coded scales (int4 quantized on load): ``scale`` holds uint8 codes and ``zero`` int8
            codes, each times these float32 multipliers (one per output channel: ``scale``'s shape with the
            groups' axis 1); None: ``scale`` and ``zero`` are the floats themselves.
        bits: 8 or 4.
        group: values per scale along ``axis``.
        offset: subtracted from ``q`` before scaling (8 for GGUF Q4_0's unsigned nibbles).
        axis: the grouped (contraction) axis, negative: -2 for a [.., in, out] weight, -1 for the [V, D]
            embedding.
        act_quant: W8A8: the product quantizes its activations to int8 per row.
        dot_dtype: None: products multiply the dequantized weights in the activations' dtype (exact); "bfloat16"
            (``matmul_dtype="bfloat16"``): products that dequantize whole matrices round them, and the activations,
            to bfloat16 and accumulate in float32 (about twice XLA:CPU's float32 rate).
    """

    q: jax.Array
    scale: jax.Array
    zero: jax.Array | None
    scale_mul: jax.Array | None = None
    zero_mul: jax.Array | None = None
    bits: int = dataclasses.field(metadata=dict(static=True), default=8)
    group: int = dataclasses.field(metadata=dict(static=True), default=1)
    offset: int = dataclasses.field(metadata=dict(static=True), default=0)
    axis: int = dataclasses.field(metadata=dict(static=True), default=-2)
    act_quant: bool = dataclasses.field(metadata=dict(static=True), default=False)
    dot_dtype: str | None = dataclasses.field(metadata=dict(static=True), default=None)

    @property
    def shape(self) -> tuple[int, ...]:
        """The float weight's shape."""
        s = list(self.q.shape)
        if self.bits == 4:
            s[self.axis] *= 2
        return tuple(s)

    @property
    def per_channel(self) -> bool:
        """int8 with one scale per output channel of a [.., in, out] weight, no zero or offset: the scale factors out
        of the sum, so a product only converts the values."""
        return (
            self.bits == 8
            and self.axis == -2
            and self.group == self.q.shape[-2]
            and self.zero is None
            and not self.offset
        )

    @property
    def nbytes(self) -> int:
        return sum(math.prod(x.shape) * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(self))


def dot_dequantized(x: jax.Array, dq: jax.Array, w: QArray) -> jax.Array:
    """``x`` times ``dq``, the dequantized values of ``w`` ([.., in, out], or [V, D], transposed), in ``w.dot_dtype``
    (default: x's), accumulated in x's dtype."""
    dq = dq.T if w.axis == -1 else dq
    dtype = w.dot_dtype or x.dtype
    return jnp.dot(x.astype(dtype), dq.astype(dtype), preferred_element_type=x.dtype)


def unpack4(q: jax.Array, axis: int) -> jax.Array:
    """Inverse of the packing (``jaxserve.quant``): uint8 [..., n / 2, ...] -> int32 [..., n, ...] in [0, 15]."""
    q = jnp.moveaxis(q, axis, -1).astype(jnp.int32)
    v = jnp.stack([q & 15, q >> 4], axis=-1).reshape(*q.shape[:-1], 2 * q.shape[-1])
    return jnp.moveaxis(v, -1, axis)


def expand(code: jax.Array, mul: jax.Array) -> jax.Array:
    """A coded scale or zero: ``code * mul`` in float32."""
    return code.astype(jnp.float32) * mul


def group_scales(a: QArray) -> tuple[jax.Array, jax.Array | None]:
    """``a``'s scales and zeros (None: none) as floats: the stored ones, or coded ones expanded (float32)."""
    if a.scale_mul is None:
        return a.scale, a.zero
    return expand(a.scale, a.scale_mul), None if a.zero is None else expand(a.zero, a.zero_mul)


def split_groups(x: jax.Array, axis: int, g: int) -> jax.Array:
    """[..., n, ...] -> [..., n / g, g, ...] (the new group axis right after ``axis``; ``axis`` negative)."""
    ax = x.ndim + axis
    return x.reshape(*x.shape[:ax], x.shape[ax] // g, g, *x.shape[ax + 1 :])


def merge_groups(x: jax.Array, axis: int) -> jax.Array:
    """Inverse of ``split_groups`` (``axis`` counted on the merged array)."""
    ax = x.ndim - 1 + axis
    return x.reshape(*x.shape[:ax], x.shape[ax] * x.shape[ax + 1], *x.shape[ax + 2 :])


def dequantize(a: QArray, dtype=jnp.float32) -> jax.Array:
    """The float weight: ``(q - offset) * scale (+ zero)`` computed in float32, then cast to ``dtype``."""
    v = unpack4(a.q, a.axis) if a.bits == 4 else a.q
    v = v.astype(jnp.float32)
    if a.offset:
        v = v - a.offset
    grouped = split_groups(v, a.axis, a.group)  # the values of a group along a.axis (< 0)
    scale, zero = group_scales(a)
    w = grouped * jnp.expand_dims(scale.astype(jnp.float32), a.axis)
    if zero is not None:
        w = w + jnp.expand_dims(zero.astype(jnp.float32), a.axis)
    return merge_groups(w, a.axis).astype(dtype)


def take(w: QArray, ids, dtype=jnp.float32) -> jax.Array:
    """``w[ids]`` along its leading axis, dequantized (every leaf has that axis): rows of a [V, D] embedding, or
    the experts ``ids`` of an [E, in, out] expert stack."""
    return dequantize(jax.tree.map(lambda x: x[ids], w), dtype)
