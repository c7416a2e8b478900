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
