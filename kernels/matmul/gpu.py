"""A decode step's products on a GPU, reading a layer's matrix in place in its stack (Triton-style Pallas).

Inside the layers' ``lax.scan`` XLA:GPU copies each layer's slice of every weight stack before a product reads it
(a ``dynamic_slice_fusion`` memcpy: at Llama-3-8B's shapes 14 GB written and read again per step, on a step whose
floor is the 16 GB of weights read once). ``matmul_rows`` takes the whole stack and the layer's index and reads
that matrix where it lies. ``ROWS`` serves the stacks of float weights for steps of up to ``MATMUL_MAX_ROWS`` rows
(decode batches); larger steps are bound by their arithmetic, not by the copy, and keep XLA's products.

Grid: (column block, row block, K split). A program multiplies its ``block_m`` rows by ``block_n`` columns of the
matrix over its share of K, ``block_k`` at a time, accumulating in float32; with several splits (a narrow matrix
gives too few column blocks to keep every SM streaming) each writes a float32 partial and XLA sums them.
Numerics: the tensor cores' bf16 / f16 products with float32 accumulation; float32 weights in full float32 (IEEE).
"""

from __future__ import annotations

import functools
import itertools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu
from jaxserve.kernels._common import cdiv, next_pow2

MATMUL_MAX_ROWS = 256  # a decode batch; above it the product is bound by its arithmetic, which XLA's GEMMs do better
# Programs to aim for: about one per SM of an H100 (132): more come from splitting K, whose float32 partials cost
# traffic of their own (written, then read by the sum).
_TARGET_PROGRAMS = 128
_DTYPES = (jnp.bfloat16, jnp.float16, jnp.float32)


def _kernel(
    layer_ref, x_ref, *refs, starts: tuple[int, ...], block_m: int, block_n: int, block_k: int, k_per_split: int
):
    """refs: the matrices' stacks, then their outputs. Column block j belongs to matrix i when
    starts[i] <= j < starts[i + 1]; each matrix's branch is its own code (a ref cannot be picked at run time)."""
    num = len(refs) // 2
    j, i, s = pl.program_id(0), pl.program_id(1), pl.program_id(2)  # read here: the interpreter has them only here
    for w_ref, o_ref, lo, hi in zip(refs[:num], refs[num:], starts[:-1], starts[1:]):

        @pl.when((j >= lo) & (j < hi))
        def _(w_ref=w_ref, o_ref=o_ref, lo=lo):
            _product(layer_ref, x_ref, w_ref, o_ref, (j - lo, i, s), block_m, block_n, block_k, k_per_split)


def _product(layer_ref, x_ref, w_ref, o_ref, ids, block_m: int, block_n: int, block_k: int, k_per_split: int):
    """Column block j of row block i of x times matrix ``layer`` of w, over split s of K (``ids``: (j, i, s))."""
    j, i, s = ids
    m, k_total = x_ref.shape
    n = w_ref.shape[2]
    layer = layer_ref[0]
    rows = i * block_m + jnp.arange(block_m, dtype=jnp.int32)
    cols = j * block_n + jnp.arange(block_n, dtype=jnp.int32)
    row_ok, col_ok = rows < m, cols < n
    rows_c, cols_c = jnp.minimum(rows, m - 1)[:, None], jnp.minimum(cols, n - 1)[None, :]
    k0 = s * k_per_split
    precision = lax.Precision.HIGHEST  # IEEE for float32 weights; no effect on bf16 / f16

    def body(t, acc):
        ks = k0 + t * block_k + jnp.arange(block_k, dtype=jnp.int32)
        k_ok = ks < k_total
        ks_c = jnp.minimum(ks, k_total - 1)
        xb = plgpu.load(x_ref.at[rows_c, ks_c[None, :]], mask=row_ok[:, None] & k_ok[None, :], other=0)
        wb = plgpu.load(w_ref.at[layer, ks_c[:, None], cols_c], mask=k_ok[:, None] & col_ok[None, :], other=0)
        return acc + lax.dot(xb.astype(wb.dtype), wb, precision=precision, preferred_element_type=jnp.float32)

    steps = cdiv(k_per_split, block_k)
    acc = lax.fori_loop(0, steps, body, jnp.zeros((block_m, block_n), jnp.float32))
    # masked rows and columns are stored one past the end, never onto a real one (see attention/gpu.py)
    rows_st, cols_st = jnp.where(row_ok, rows, m)[:, None], jnp.where(col_ok, cols, n)[None, :]
    plgpu.store(o_ref.at[s, rows_st, cols_st], acc, mask=row_ok[:, None] & col_ok[None, :])


def plan_blocks(m: int, k: int, n: int, itemsize: int) -> tuple[int, int, int, int]:
    """(block_m, block_n, block_k, splits) for an [m, k] x [k, n] product: all rows in one block (the weights are
    read once), 32 columns (64-byte rows of bf16 weights: two of the memory's 32-byte sectors; narrow blocks give
    more programs without splitting K), ``block_k`` rows of the matrix per load (8 KiB of bf16 weights, three loads
    in flight per program), and K split until the grid has about ``_TARGET_PROGRAMS`` programs. Chosen without a
    GPU to measure on (bench/RESULTS.md): a starting point."""
    block_m = min(max(next_pow2(m), 16), MATMUL_MAX_ROWS)
    block_n = 32
    block_k = (128 if block_m <= 64 else 64) * 2 // max(itemsize, 2)
    programs = cdiv(n, block_n) * cdiv(m, block_m)
    splits = 1
    while programs * splits < _TARGET_PROGRAMS and k // (2 * splits) >= 4 * block_k:
        splits *= 2
    return block_m, block_n, block_k, splits


@functools.partial(jax.jit, static_argnames=("interpret",))
def matmul_rows(x: jax.Array, w: jax.Array, layer=None, *, interpret: bool = False) -> jax.Array:
    """x [M, K] (M <= ``MATMUL_MAX_ROWS``) times w [K, N], or times matrix ``layer`` of a stack w [L, K, N] read in
    place -> [M, N] float32, accumulated in float32.

    Raises:
        ValueError: shapes that do not match, too many rows, or weights that are not bf16 / f16 / f32.
    """
    return _matmuls(x, (w,), layer, interpret)[0]


@functools.partial(jax.jit, static_argnames=("interpret",))
def matmul_rows_many(x: jax.Array, ws: tuple[jax.Array, ...], layer=None, *, interpret: bool = False):
    """``matmul_rows`` of the same rows by several matrices (q, k and v; gate and up) in one kernel launch: their
    column blocks share one grid. The matrices share K and a dtype. -> a tuple of [M, N_i] float32."""
    return _matmuls(x, tuple(ws), layer, interpret)


def _matmuls(x: jax.Array, ws: tuple, layer, interpret: bool) -> tuple[jax.Array, ...]:
    for w in ws:
        if x.ndim != 2 or w.ndim not in (2, 3) or x.shape[1] != w.shape[-2] or x.shape[0] > MATMUL_MAX_ROWS:
            raise ValueError(
                f"matmul_rows (GPU): x must be [M <= {MATMUL_MAX_ROWS}, K] and w [K, N] or [L, K, N], got {x.shape} "
                f"and {w.shape}"
            )
        if w.dtype not in _DTYPES or w.dtype != ws[0].dtype:
            raise ValueError(
                f"matmul_rows (GPU): w must be bfloat16, float16 or float32 (one dtype for all), got "
                f"{', '.join(str(v.dtype) for v in ws)}"
            )
    ws = tuple(w if w.ndim == 3 else w[None] for w in ws)
    m, k = x.shape
    ns = [w.shape[2] for w in ws]
    block_m, block_n, block_k, splits = plan_blocks(m, k, sum(ns), jnp.dtype(ws[0].dtype).itemsize)
    starts = (0, *itertools.accumulate(cdiv(n, block_n) for n in ns))
    k_per_split = cdiv(cdiv(k, splits), block_k) * block_k
    kernel = functools.partial(
        _kernel, starts=starts, block_m=block_m, block_n=block_n, block_k=block_k, k_per_split=k_per_split
    )
    layer = jnp.asarray(0 if layer is None else layer, jnp.int32).reshape(1)
    outs = pl.pallas_call(
        kernel,
        out_shape=[jax.ShapeDtypeStruct((splits, m, n), jnp.float32) for n in ns],
        grid=(starts[-1], cdiv(m, block_m), splits),
        compiler_params=plgpu.CompilerParams(num_warps=4 if block_m <= 64 else 8, num_stages=3),
        interpret=interpret,
        name=f"matmul_rows_gpu_{len(ws)}_bm{block_m}_bn{block_n}_bk{block_k}_s{splits}",
    )(layer, x, *ws)
    return tuple(out[0] if splits == 1 else out.sum(0) for out in outs)


def reference(x: jax.Array, w: jax.Array, layer=None) -> jax.Array:
    """The plain-jnp product ``matmul_rows`` computes (float32 accumulation)."""
    if w.ndim == 3:
        w = w[0 if layer is None else layer]
    return jnp.dot(x.astype(w.dtype), w, preferred_element_type=jnp.float32, precision=lax.Precision.HIGHEST)


class RowsProduct:
    """The model's ``RowsFn`` on one GPU: the layers' stacks of float weights for steps of up to
    ``MATMUL_MAX_ROWS`` rows, each layer's matrix read in place (quantized weights keep XLA's products)."""

    def __init__(self, interpret: bool = False):
        self.interpret = interpret

    def serves(self, w, rows: int) -> bool:
        return (
            rows <= MATMUL_MAX_ROWS
            and isinstance(w, jax.Array | jax.ShapeDtypeStruct)
            and w.ndim == 3
            and w.dtype in _DTYPES
        )

    def __call__(self, x: jax.Array, w, layer=None) -> jax.Array:
        return matmul_rows(x, w, layer, interpret=self.interpret)

    def many(self, x: jax.Array, ws: tuple, layer=None) -> tuple[jax.Array, ...]:
        """x times several stacks it serves (one dtype, one K) in one launch: q, k and v; gate and up."""
        if len({(w.dtype, w.shape[-2]) for w in ws}) > 1:
            return tuple(self(x, w, layer) for w in ws)
        return matmul_rows_many(x, ws, layer, interpret=self.interpret)


ROWS = RowsProduct()
