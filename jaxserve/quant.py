"""Quantized weights: integer (or fp8) values with per-group scales, multiplied without a float copy in memory.

A ``QArray`` replaces a float weight in the model's parameters. Its values are grouped along one axis (the
contraction axis of the product it feeds, ``axis``): each run of ``group`` values along it shares a scale (and,
for asymmetric formats, an additive ``zero``):

    w = (q - offset) * scale + zero

The same form holds every format we serve, so pre-quantized checkpoints keep their own numbers:

===========================  ====  =====  ======  ====  ==========================================
format                       bits  group  offset  zero  from
===========================  ====  =====  ======  ====  ==========================================
int8 per output channel         8  in          0  no    ``quantization="int8"`` (and ``"w8a8"``)
int4 group-wise, coded scales   4  32 (16)     0  yes   ``quantization="int4"`` (min/max, 4.5 bits/weight)
fp8 e4m3 per channel            8  in          0  no    ``quantization="fp8"`` (GPUs and TPUs with fp8)
GGUF Q8_0                       8  32          0  no    d * q
GGUF Q4_0                       4  32          8  no    d * (q - 8)
GGUF Q4_1                       4  32          0  yes   d * q + m
===========================  ====  =====  ======  ====  ==========================================

int4 groups the vocabulary matrices (the embedding, and the output projection when it is tied) by 16 (5
bits/weight): their rounding goes straight into the logits. On the default model (already on its GGUF file's 4-bit
grid of 32-value groups, the embedding 8-bit) groups of 128 with float16 scales cost +54% perplexity, groups of 32
+0.0% for the layers, and a 4-bit embedding +5.8% in groups of 32, +2.8% in groups of 16.

int4's scale and zero of each group are 8-bit codes (``scale`` uint8, ``zero`` int8) times a float32 multiplier
per output channel (``scale_mul``, ``zero_mul``: the groups' axis of size 1): ``scale = code * scale_mul`` in
float32 (so 32-value groups cost 0.5 bit a weight, not the 1 of two float16 numbers). The zero is rounded down
and the scale up, so every group's values stay within 15 steps.

4-bit values are packed two per byte along ``axis`` (element 2i in the low nibble, 2i + 1 in the high one) and
stay packed in device memory; the product unpacks and scales them inside the jitted step (XLA fuses it into the
dot's operand on GPU and TPU; on one CPU device, steps of up to 8 tokens go to a C++ product that widens the values
in registers, ``jaxserve.kernels.matmul.cpu.matmul_quant_rows``). The dequantized values are computed exactly as the
checkpoint's own reference dequantizer does (one product, one sum, in float32), so a model served from its
pre-quantized file computes with the very weights HF transformers dequantizes from it.

``w8a8`` also quantizes the activations: per token (row), dynamically, to int8 (scale = max |x| / 127), and runs
an int8 x int8 -> int32 product, rescaled by both scales (TPU v5e/v6e and GPUs run these at twice the bf16 rate).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

# The layout and its dequantization live beside the kernels that read them; re-exported here.
from jaxserve.kernels.matmul.qarray import QArray, dequantize, dot_dequantized, group_scales, take  # noqa: F401
from jaxserve.kernels.matmul.qarray import expand as _expand
from jaxserve.kernels.matmul.qarray import merge_groups as _merge_groups
from jaxserve.kernels.matmul.qarray import split_groups as _split_groups
from jaxserve.kernels.matmul.qarray import unpack4 as _unpack4  # noqa: F401

QUANTIZATION_MODES = ("int8", "int4", "w8a8", "fp8")
INT4_GROUP = 32  # int4's group (the largest of 32, 16 that divides the contraction dim)
INT4_VOCAB_GROUP = 16  # the vocabulary matrices' (their rounding goes straight into the logits)
# The parameters that are quantized: every matrix product's weight, and the embedding (a lookup, and the output
# projection when tied). Norms and biases stay float.


def is_quantized(x) -> bool:
    return isinstance(x, QArray)


def pick_group(n: int, want: int) -> int:
    for g in (want, 128, 64, 32, 16):
        if g <= want and n % g == 0:
            return g
    raise ValueError(f"no quantization group of {want} or fewer values (128, 64, 32, 16) divides a dimension of {n}")


def int4_group(name: str) -> int:
    """int4's group for parameter ``name``: ``INT4_VOCAB_GROUP`` for the vocabulary matrices, else ``INT4_GROUP``."""
    return INT4_VOCAB_GROUP if name in ("embed", "lm_head") else INT4_GROUP


def quantize_param(name: str, w: jax.Array, mode: str, group: int | None = None) -> QArray:
    """Parameter ``name`` of the model quantized: grouped along its contraction axis, int4 in its group (default
    ``int4_group(name)``)."""
    return quantize(w, mode, axis=weight_axis(name), group=group or int4_group(name))


def _pack4(v: jax.Array, axis: int) -> jax.Array:
    """[..., n, ...] values in [0, 15] -> [..., n / 2, ...] uint8 (pairs along ``axis``, first in the low nibble)."""
    v = jnp.moveaxis(v.astype(jnp.uint8), axis, -1)
    v = v.reshape(*v.shape[:-1], v.shape[-1] // 2, 2)
    return jnp.moveaxis(v[..., 0] | (v[..., 1] << 4), -1, axis)


def pack4_host(v: np.ndarray, axis: int) -> np.ndarray:
    """``_pack4`` in numpy, for checkpoints packed on the host."""
    v = np.moveaxis(np.asarray(v, np.uint8), axis, -1)
    v = v.reshape(*v.shape[:-1], v.shape[-1] // 2, 2)
    return np.ascontiguousarray(np.moveaxis(v[..., 0] | (v[..., 1] << 4), -1, axis))


def quantize(w: jax.Array, mode: str, *, axis: int = -2, group: int | None = None) -> QArray:
    """A float weight quantized (round to nearest) in ``mode`` ("int8", "w8a8", "int4", "fp8").

    Args:
        w: the weight, grouped along ``axis`` (its contraction axis).
        mode: see ``QUANTIZATION_MODES``.
        axis: -2 for [..., in, out] weights, -1 for the [V, D] embedding.
        group: int4's group size (default ``INT4_GROUP``; the largest of it, 128, 64, 32, 16 not above it that
            divides the axis). int8, w8a8 and fp8 are per channel (one scale for the whole axis).

    Raises:
        ValueError: an unknown mode, or no group size divides the axis.
    """
    if mode not in QUANTIZATION_MODES:
        raise ValueError(f"quantization must be one of {QUANTIZATION_MODES}, got {mode!r}")
    w = jnp.asarray(w, jnp.float32)
    n = w.shape[axis]
    if mode in ("int8", "w8a8", "fp8"):
        amax = jnp.max(jnp.abs(w), axis=axis, keepdims=True)
        top = 127.0 if mode != "fp8" else float(jnp.finfo(jnp.float8_e4m3fn).max)
        scale = jnp.where(amax > 0, amax / top, 1.0)
        if mode == "fp8":
            q = (w / scale).astype(jnp.float8_e4m3fn)
        else:
            q = jnp.clip(jnp.round(w / scale), -127, 127).astype(jnp.int8)
        return QArray(q, scale, None, bits=8, group=n, axis=axis, act_quant=mode == "w8a8")
    g = pick_group(n, group or INT4_GROUP)
    grouped = _split_groups(w, axis, g)  # [..., n / g, g, ...]: the values of a group along ``axis`` (< 0)
    lo = jnp.squeeze(jnp.min(grouped, axis=axis, keepdims=True), axis)  # [..., n / g, ...]
    hi = jnp.squeeze(jnp.max(grouped, axis=axis, keepdims=True), axis)
    # The zero's code rounded down and the scale's up, each against its largest over the groups of a channel.
    zero_mul = _multiplier(jnp.abs(lo), axis, 127)
    zero = jnp.clip(jnp.floor(lo / zero_mul), -127, 127).astype(jnp.int8)
    z = _expand(zero, zero_mul)
    need = jnp.maximum(hi - z, 0) / 15
    scale_mul = _multiplier(need, axis, 255)
    scale = jnp.clip(jnp.ceil(need / scale_mul), 0, 255).astype(jnp.uint8)
    s = _expand(scale, scale_mul)
    v = jnp.round((grouped - jnp.expand_dims(z, axis)) / jnp.expand_dims(jnp.where(s > 0, s, 1), axis))
    v = _merge_groups(jnp.clip(v, 0, 15), axis)
    return QArray(_pack4(v, axis), scale, zero, scale_mul, zero_mul, bits=4, group=g, axis=axis)


def _multiplier(x: jax.Array, axis: int, top: int) -> jax.Array:
    """Per channel: the largest of ``x`` over the groups (``axis``) / ``top`` (1 where all are 0), float32."""
    m = jnp.max(x, axis=axis, keepdims=True) / top
    return jnp.where(m > 0, m, 1.0).astype(jnp.float32)


def matmul(x: jax.Array, w: QArray) -> jax.Array:
    """``x @ W`` for a quantized [..., in, out] weight (``axis`` -2), or ``x @ W.T`` for the [V, D] embedding
    (``axis`` -1: the tied output projection). Accumulates in x's dtype (float32 on the CPU)."""
    if w.act_quant:
        return _matmul_w8a8(x, w)
    if w.per_channel:  # only the values are converted (exactly, to bfloat16 too)
        return dot_dequantized(x, w.q, w) * w.scale.reshape(w.scale.shape[-1]).astype(x.dtype)
    return dot_dequantized(x, dequantize(w, w.dot_dtype or x.dtype), w)


_INT_DOT_MIN_ROWS = 8


def quantize_rows(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """W8A8's activations: each row of ``x`` to int8, symmetric (scale = max |row| * float32(1 / 127), as XLA
    computes a division by a constant; 1 for a zero row), values rounded half to even and clipped to +-127 (the C++
    product quantizes its rows the same way, bit for bit). Returns (int8 values, float32 scales [..., 1])."""
    xf = x.astype(jnp.float32)
    amax = jnp.max(jnp.abs(xf), axis=-1, keepdims=True)
    xs = jnp.where(amax > 0, amax * np.float32(1 / 127), 1.0)
    return jnp.clip(jnp.round(xf / xs), -127, 127).astype(jnp.int8), xs


def _matmul_w8a8(x: jax.Array, w: QArray) -> jax.Array:
    xq, xs = quantize_rows(x)
    dims = (((xq.ndim - 1,), (w.q.ndim - 1 if w.axis == -1 else w.q.ndim - 2,)), ((), ()))
    if w.axis == -1 and math.prod(xq.shape[:-1]) < _INT_DOT_MIN_ROWS:
        # The [V, D] output projection with fewer than 8 rows: XLA:CPU's int8 dot contracting D of both took 34 ms
        # for SmolLM2's at one row (1.5 at eight; the layers' [in, out] ones are fine), a float product by the
        # transpose of the converted values 0.8. The sums are the integer ones while they stay below 2**24 (always
        # for up to 1,040 products of 127 x 127; past that, within float32's relative rounding, 6e-8).
        acc = xq.astype(jnp.float32) @ w.q.astype(jnp.float32).T
    else:
        acc = jax.lax.dot_general(xq, w.q, dims, preferred_element_type=jnp.int32)
    scale = w.scale.reshape(-1) if w.axis == -1 else w.scale.reshape(w.scale.shape[-1])
    return (acc.astype(jnp.float32) * xs * scale).astype(x.dtype)


def weight_axis(name: str) -> int:
    """The grouped axis of a parameter: the embedding is [V, D] (grouped along D), the others [.., in, out]."""
    return -1 if name == "embed" else -2


def check_backend(mode: str, platform: str | None = None) -> None:
    """Raises ValueError if this backend cannot run ``mode`` (fp8 needs H100/H200-class GPUs or TPU v6e+)."""
    if mode != "fp8":
        return
    platform = platform or jax.default_backend()
    kind = jax.devices()[0].device_kind.lower() if platform == jax.default_backend() else ""
    fp8_kinds = ("h100", "h200", "h800", "h20", "b100", "b200", "gb200", "l40", "rtx 40", "v6", "v7", "trillium")
    if platform == "cpu" or not any(k in kind for k in fp8_kinds):
        raise ValueError(
            f"quantization='fp8' needs a backend with fp8 arithmetic (NVIDIA H100/H200/L40-class GPUs, "
            f"TPU v6e/v7); this one is {platform} ({kind or 'unknown device'}): use 'int8' or 'int4'"
        )


def host_nbytes(params: dict) -> int:
    """Bytes of every array in ``params`` (quantized ones counted by their leaves)."""
    return sum(math.prod(x.shape) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(params))
