"""Products of a few float32 rows by a layer's weights for the CPU, in C++ (``cpu/rows_*.cc``, ``cpu/w8a8.cc``,
``cpu/dequantize.cc``, built and registered by ``cpu/ffi.py``).

They take a few float32 rows (steps of up to 8 tokens: a few requests decoding) and read a layer's matrix in place
in its stack (``layer``), where XLA would copy the scan's slice of it first: ``matmul_rows`` by bfloat16 or float32
weights (XLA:CPU's own bfloat16 product is pathologically slow there), ``matmul_quant_rows`` by quantized ones
(``QArray``: int8 and 4-bit values widened in registers, never dequantized to a float copy), ``matmul_w8a8_rows`` by
W8A8 ones, and ``dequantize`` for larger steps. ``ROWS`` is all of them, as the model's ``RowsFn``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jaxserve.kernels.cpu import ffi
from jaxserve.kernels.matmul.qarray import QArray, dot_dequantized

MATMUL_MAX_ROWS = 8  # the C++ product's limit (kMaxRows)


def _layer(layer) -> jax.Array:
    return jnp.asarray(0 if layer is None else layer, jnp.int32)


def matmul_rows(x: jax.Array, w: jax.Array, layer=None) -> jax.Array:
    """x [M, K] (M <= 8) times a bfloat16 matrix w [K, N] (or [K, N / 2] uint32 pairs of bfloat16, as
    ``layers.linear.pack_bf16`` stores it, or float32), or times matrix ``layer`` of a stack [L, K, N] -> [M, N]
    float32, accumulated in float32 (C++: XLA:CPU's own bfloat16 products with fewer than 8 rows read the weights at
    a fifteenth of the float32 rate, and its float32 ones copy the scan's slice of a stack first)."""
    ffi.require("the C++ rows product")
    if x.ndim != 2 or w.ndim not in (2, 3) or x.shape[1] != w.shape[-2] or x.shape[0] > MATMUL_MAX_ROWS:
        raise ValueError(
            f"matmul_rows: x must be [M <= {MATMUL_MAX_ROWS}, K] and w [K, N] or [L, K, N], got {x.shape} and {w.shape}"
        )
    if w.dtype not in (jnp.bfloat16, jnp.uint32, jnp.float32):
        raise ValueError(f"matmul_rows: w must be bfloat16 or uint32 pairs of it (or float32), got {w.dtype}")
    n = w.shape[-1] * (2 if w.dtype == jnp.uint32 else 1)
    call = jax.ffi.ffi_call(
        ffi.MATMUL_TARGET, jax.ShapeDtypeStruct((x.shape[0], n), jnp.float32), vmap_method="sequential"
    )
    return call(x.astype(jnp.float32), w, _layer(layer))


def quant_rows_serves(w) -> bool:
    """Whether ``matmul_quant_rows`` takes this ``QArray``: int8 or 4-bit values, float32 or float16 scales (or
    uint8 codes with their multipliers), not W8A8 (whose products quantize their activations); the transposed
    [V, D] embedding needs groups of a multiple of 16 bytes, or of 8 in rows of a multiple of 16."""
    if not isinstance(w, QArray) or w.act_quant:
        return False
    if w.scale.dtype not in ((jnp.uint8,) if w.scale_mul is not None else (jnp.float32, jnp.float16)):
        return False
    if (w.bits, w.q.dtype) not in ((8, jnp.int8), (4, jnp.uint8)) or w.q.ndim not in (2, 3):
        return False
    group_bytes, row_bytes = w.group * w.bits // 8, w.q.shape[-1]
    return w.axis == -2 or (w.axis == -1 and (group_bytes % 16 == 0 or (group_bytes == 8 and row_bytes % 16 == 0)))


def matmul_quant_rows(x: jax.Array, w, layer=None) -> jax.Array:
    """x [M, K] (M <= 8) times a quantized weight (a ``QArray``: [K, N] grouped along K, or the
    [N, K] embedding grouped along K, which gives ``x @ W.T`` as ``quant.matmul`` does), or times matrix ``layer``
    of a stack of them [L, ...] -> [M, N] float32. The values are widened to float32 in registers; per group,
    ``scale * sum(x * q) + (zero - scale * offset) * sum(x)``, the dequantized weights' product up to float32
    rounding."""
    out = _rows_out("matmul_quant_rows", x, w)
    return _quantized_call("matmul_quant_rows", ffi.QUANT_TARGET, out, w, layer, x.astype(jnp.float32))


def _rows_out(name: str, x: jax.Array, w) -> jax.ShapeDtypeStruct:
    """The [M, N] float32 result of x [M <= 8, K] times a quantized weight ([K, N], or the transposed [N, K]
    embedding: ``axis`` -1); raises ValueError naming ``name`` for another x."""
    transposed = getattr(w, "axis", -2) == -1  # not a QArray: each caller refuses it
    k, n = (w.shape[-1], w.shape[-2]) if transposed else (w.shape[-2], w.shape[-1])
    if x.ndim != 2 or x.shape[1] != k or not 1 <= x.shape[0] <= MATMUL_MAX_ROWS:
        raise ValueError(f"{name}: x must be [M <= {MATMUL_MAX_ROWS}, {k}], got {x.shape}")
    return jax.ShapeDtypeStruct((x.shape[0], n), jnp.float32)


def _quantized_call(name: str, target: str, out: jax.ShapeDtypeStruct, w, layer, *lead: jax.Array) -> jax.Array:
    """``target`` on (*lead, w's values, scales, zeros (empty: none), layer), w's format as its attributes."""
    ffi.require(f"{name}: the C++ library")
    if not quant_rows_serves(w):
        raise ValueError(
            f"{name}: not a QArray it serves (int8 or 4-bit values, float16 / float32 scales or uint8 "
            f"codes with multipliers, no activation quantization): {w!r:.200}"
        )
    empty = jnp.zeros((0,), jnp.float32)
    zero = w.zero if w.zero is not None else jnp.zeros((0,), w.scale.dtype)
    if w.scale_mul is None:  # float scales: zeros in their dtype, no multipliers
        zero, smul, zmul = zero.astype(w.scale.dtype), empty, empty
    else:  # codes: int8 zero codes, float32 multipliers
        smul, zmul = w.scale_mul, w.zero_mul if w.zero_mul is not None else empty
    call = jax.ffi.ffi_call(target, out, vmap_method="sequential")
    return call(
        *lead,
        w.q,
        w.scale,
        zero,
        smul,
        zmul,
        _layer(layer),
        bits=np.int64(w.bits),
        group=np.int64(w.group),
        offset=np.int64(w.offset),
        transposed=w.axis == -1,
    )


def dequantize(w, layer=None, dtype=jnp.float32) -> jax.Array:
    """The float weight of a quantized matrix (a ``QArray`` that ``matmul_quant_rows`` serves), or of
    matrix ``layer`` of a stack of them, in ``dtype`` (float32, or bfloat16 rounded to nearest even): [K, N], or
    [N, K] for the embedding grouped along its last axis. Computed as ``quant.dequantize`` does (one product and one
    sum in float32), the stack read in place, on both cores."""
    if jnp.dtype(dtype) not in (jnp.float32, jnp.bfloat16):
        raise ValueError(f"dequantize: dtype must be float32 or bfloat16, got {dtype}")
    return _quantized_call("dequantize", ffi.DEQUANT_TARGET, jax.ShapeDtypeStruct(w.shape[-2:], dtype), w, layer)


def w8a8_rows_serves(w) -> bool:
    """Whether ``matmul_w8a8_rows`` takes this ``QArray``: W8A8's int8 values with a float32 scale per output
    channel (the layers' [K, N] stacks and the [V, D] embedding)."""
    if not isinstance(w, QArray) or not w.act_quant or w.q.dtype != jnp.int8 or w.scale.dtype != jnp.float32:
        return False
    k = w.q.shape[-1] if w.axis == -1 else w.q.shape[-2]
    return w.group == k and w.zero is None and not w.offset and w.q.ndim in (2, 3)


def matmul_w8a8_rows(x: jax.Array, w, layer=None) -> jax.Array:
    """x [M, K] (M <= 8) times a W8A8 weight (or matrix ``layer`` of a stack), as ``quant.matmul`` computes it: x
    quantized to int8 per row (in C++, bit for bit as ``quant.quantize_rows``: a fused op fewer per product, ~1 ms
    per token of SmolLM2), the int8 x int8 sums exact in int32 (AVX-512 VNNI where the build has it), then
    ``sums * x_scale * w_scale`` in float32."""
    ffi.require("the C++ W8A8 product")
    if not w8a8_rows_serves(w):
        raise ValueError(
            f"matmul_w8a8_rows: not a W8A8 QArray (int8 values, a float32 scale per output channel): {w!r:.200}"
        )
    call = jax.ffi.ffi_call(ffi.W8A8_TARGET, _rows_out("matmul_w8a8_rows", x, w), vmap_method="sequential")
    return call(x.astype(jnp.float32), w.q, w.scale, _layer(layer), transposed=w.axis == -1)


class RowsProduct:
    """The model's ``RowsFn`` on one CPU device: the C++ products for steps of few rows, and the C++ dequantization
    of grouped quantized weights for larger ones.

    bfloat16 weights and float32 layer stacks below 8 rows (from 8, XLA's products are the faster); quantized ones
    up to 8 (XLA dequantizes whole 4-bit or grouped matrices each step: the whole model's 8-row products took 65 ms
    in XLA against 13.5 here for int4), except int8 per output channel at 8 rows, whose conversion XLA fuses into its
    product (14.3 against 15.7 ms). From 9 rows, grouped quantized weights (not int8 per output channel, which XLA
    converts in its product) are dequantized here, each layer in place, and multiplied by XLA in ``w.dot_dtype``
    (int4 in groups of 32, the whole model's products at 64 rows: 85 ms with XLA's dequantizing fusion)."""

    @staticmethod
    def serves(w, rows: int) -> bool:
        if w8a8_rows_serves(w):
            return rows <= MATMUL_MAX_ROWS
        if quant_rows_serves(w):
            return rows < MATMUL_MAX_ROWS or not w.per_channel
        if rows >= MATMUL_MAX_ROWS or not isinstance(w, jax.Array | np.ndarray | jax.ShapeDtypeStruct):
            return False
        # float32: the layers' stacks only (read in place: XLA copies the scan's slice of each first); a lone float32
        # matrix, such as the tied [V, D] embedding's transpose, XLA streams as fast and the call would copy it
        return w.dtype in (jnp.bfloat16, jnp.uint32) or (w.dtype == jnp.float32 and w.ndim == 3)

    def __call__(self, x: jax.Array, w, layer=None) -> jax.Array:
        if w8a8_rows_serves(w):
            return matmul_w8a8_rows(x, w, layer)
        if not quant_rows_serves(w):
            return matmul_rows(x, w, layer)
        if x.shape[0] <= MATMUL_MAX_ROWS:
            return matmul_quant_rows(x, w, layer)
        if w.axis == -1 and layer is None and (blocks := _vocab_blocks(w.q.shape[0])) > 1:
            return _output_by_blocks(x, w, blocks)
        return dot_dequantized(x, dequantize(w, layer, w.dot_dtype or x.dtype), w)


_VOCAB_BLOCK = 4096  # rows of the [V, D] embedding dequantized at a time for the output projection


def _vocab_blocks(v: int) -> int:
    """Blocks of at most ``_VOCAB_BLOCK`` (and at least 1,024) rows that split ``v`` evenly; 1 if none do."""
    for n in range(-(-v // _VOCAB_BLOCK), v // 1024 + 1):
        if v % n == 0:
            return n
    return 1


def _output_by_blocks(x: jax.Array, w, blocks: int) -> jax.Array:
    """``x @ W.T`` for the quantized [V, D] embedding, ``blocks`` runs of its rows dequantized at a time (float32,
    whatever ``w.dot_dtype``: XLA:CPU's bfloat16 product with a [V, D] matrix transposed ran at a sixth of its rate).
    One block's buffer is reused: a whole float copy (113 MB for SmolLM2) was a fresh allocation each step, and
    touching its pages took longer than the product (26 ms at 64 rows)."""
    wb = jax.tree.map(lambda a: a.reshape(blocks, a.shape[0] // blocks, a.shape[1]), w)  # every leaf is [V, .]

    def block(_, b):
        return None, x.astype(jnp.float32) @ dequantize(wb, b, jnp.float32).T

    _, out = jax.lax.scan(block, None, jnp.arange(blocks, dtype=jnp.int32))  # [blocks, M, V / blocks]
    return jnp.moveaxis(out, 0, 1).reshape(x.shape[0], w.q.shape[0]).astype(x.dtype)


ROWS = RowsProduct()
