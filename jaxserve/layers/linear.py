"""The linear layer's product, ``x @ w``, for every weight format: float, bfloat16 pairs (``pack_bf16``) and
quantized (``jaxserve.quant.QArray``), with an optional product for steps of few rows (``RowsFn``); and the
``MatmulPolicy`` that decides, per step, which weights and which product each matrix goes through."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from typing import Protocol

import jax
import jax.numpy as jnp

from jaxserve import quant

# Below this many rows XLA:CPU's bfloat16 products are slower than float32 ones (a [1, 576] x [576, 49152]
# product: 1 against 15 GFLOP/s), so such products keep the full-precision weights, or go to a ``RowsFn``.
MATMUL_WEIGHTS_MIN_ROWS = 8

# mul(x, name) -> x times one layer's matrix ``name`` (``MatmulPolicy.product`` bound to the layer): how the blocks of
# ``jaxserve.layers`` multiply by their weights, whatever their format and wherever they are read from. A tuple of
# names (q, k and v) gives a tuple of products of the same x, which a ``RowsFn`` with ``many`` runs at once.
Product = Callable[[jax.Array, "str | tuple[str, ...]"], "jax.Array | tuple[jax.Array, ...]"]


def product_of(one: Callable[[jax.Array, str], jax.Array]) -> Product:
    """A ``Product`` from a product by one named matrix: a tuple of names gives the tuple of its products."""
    return lambda x, name: tuple(one(x, n) for n in name) if isinstance(name, tuple) else one(x, name)


class RowsFn(Protocol):
    """A product for steps of few rows (on the CPU: ``kernels.matmul.cpu.ROWS``, C++), where XLA's own is slow."""

    def serves(self, w, rows: int) -> bool:
        """Whether it takes this weight for ``rows`` rows (bfloat16 and float32 layer stacks below
        ``MATMUL_WEIGHTS_MIN_ROWS``; quantized up to 8: XLA would dequantize whole matrices)."""

    def __call__(self, x: jax.Array, w, layer: jax.Array | None = None) -> jax.Array:
        """x [M, K] float32 times w ([K, N], or matrix ``layer`` of a stack [L, K, N]) -> [M, N] float32."""

    # Optionally, ``many(x, ws, layer) -> tuple``: x times several matrices it serves, at once (one kernel launch).


def pack_bf16(w: jax.Array) -> jax.Array:
    """[..., N] -> [..., N / 2] uint32 holding bfloat16 pairs (N odd: plain bfloat16).

    Inside the layer scan XLA:CPU copies each layer's slice of a bfloat16 array through a slow elementwise loop
    (a 64-row MLP ran at a third of its unrolled speed); a uint32 slice is a plain copy, and the bitcast back to
    bfloat16 in :func:`matmul` is free.
    """
    w = w.astype(jnp.bfloat16)
    if w.shape[-1] % 2:
        return w
    return jax.lax.bitcast_convert_type(w.reshape(*w.shape[:-1], w.shape[-1] // 2, 2), jnp.uint32)


def matmul(
    x: jax.Array, w: jax.Array | quant.QArray, rows_fn: RowsFn | None = None, layer: jax.Array | None = None
) -> jax.Array:
    """x @ w in w's dtype (uint32: bfloat16 pairs from :func:`pack_bf16`; a ``QArray``: quantized, see
    ``jaxserve.quant.matmul``), accumulated in x's dtype.

    With float32 activations and bfloat16 weights (``matmul_dtype="bfloat16"`` on the CPU) the product runs
    on bfloat16 inputs with float32 accumulation, about twice XLA:CPU's float32 rate for 8 rows or more. With few
    rows, ``rows_fn`` when given and it serves ``w`` for that many (on the CPU the C++ products of float32 rows by
    bfloat16 or quantized weights); only it takes a stack of matrices [L, ...] with ``layer``.
    """
    if rows_fn is not None and x.ndim == 2 and rows_fn.serves(w, x.shape[0]):
        return rows_fn(x, w, layer).astype(x.dtype)
    if layer is not None:
        raise ValueError("matmul: a stack of matrices with a layer index needs a rows_fn that serves it")
    if isinstance(w, quant.QArray):
        return quant.matmul(x, w)
    if w.dtype == jnp.uint32:
        w = jax.lax.bitcast_convert_type(w, jnp.bfloat16).reshape(*w.shape[:-1], 2 * w.shape[-1])
    if w.dtype == x.dtype:
        return x @ w
    return jnp.dot(x.astype(w.dtype), w, preferred_element_type=x.dtype)


@dataclasses.dataclass(frozen=True)
class MatmulPolicy:
    """How a step's matrix products run. The runner builds it once for its platform and settings; the model asks it
    for every product and knows nothing of the platform.

    - bfloat16 copies (``matmul_dtype="bfloat16"``): the step receives them (``copies``, from
      ``Decoder.matmul_weights``) and uses them for steps of at least ``MATMUL_WEIGHTS_MIN_ROWS`` rows, where
      XLA:CPU's bfloat16 products beat its float32 ones, or always when ``rows`` serves the step.
    - ``rows``: a product for steps of few rows (on one CPU device the C++ ``kernels.matmul.cpu.ROWS``), or one per
      matrix name (under tensor parallelism each knows how its matrix is split: ``jaxserve.parallel.sharding.
      ShardedRows``). The matrices it serves stay out of the layer scan's slices, whole: it reads layer ``i``'s
      matrix in place in the stack (a custom call's operand is a buffer: slicing the stack copied each layer's
      weights every step).
    """

    rows: RowsFn | Mapping[str, RowsFn] | None = None
    # Products whose outputs keep the row-major layout they are computed in (an optimization barrier): on a TPU,
    # with few query heads per chip, XLA lays q out heads-major for the rotary embedding and produced it by copying
    # each layer's wq transposed, every step (runner: ("wq",) on TPUs).
    pinned: tuple[str, ...] = ()

    def rows_for(self, name: str) -> RowsFn | None:
        """The few-rows product of matrix ``name`` (None: XLA's)."""
        return self.rows.get(name) if isinstance(self.rows, Mapping) else self.rows

    def uses_copies(self, copies: dict | None, rows: int) -> bool:
        return copies is not None and (rows >= MATMUL_WEIGHTS_MIN_ROWS or self.rows is not None)

    def layer_weights(
        self, params: dict, matrices: tuple[str, ...], copies: dict | None, rows: int
    ) -> tuple[dict, dict]:
        """A step's per-layer weights (``matrices`` are the products' names) -> (the ones the layer scan slices,
        the matrices ``rows`` reads whole)."""
        if self.uses_copies(copies, rows):
            params = params | {n: copies[n] for n in matrices}
        if self.rows is None:
            return params, {}
        whole = {n: params[n] for n in matrices if (f := self.rows_for(n)) is not None and f.serves(params[n], rows)}
        return {n: w for n, w in params.items() if n not in whole}, whole

    def product(self, x: jax.Array, name, sliced: dict, whole: dict, layer: jax.Array):
        """x times layer ``layer``'s matrix ``name``, from the scan's slice or read whole from its stack; for a tuple
        of names, the tuple of products (at once where ``rows`` has ``many`` and reads them all whole)."""
        names = name if isinstance(name, tuple) else (name,)
        fns = {self.rows_for(n) for n in names}  # one product for all (under TP: matrices split alike)
        many = getattr(next(iter(fns)), "many", None) if len(fns) == 1 else None
        if len(names) > 1 and many is not None and all(n in whole for n in names) and x.ndim == 2:
            outs = tuple(o.astype(x.dtype) for o in many(x, tuple(whole[n] for n in names), layer))
        else:
            outs = tuple(
                matmul(x, whole[n], self.rows_for(n), layer) if n in whole else matmul(x, sliced[n]) for n in names
            )
        outs = tuple(jax.lax.optimization_barrier(o) if n in self.pinned else o for o, n in zip(outs, names))
        return outs if isinstance(name, tuple) else outs[0]

    def output(self, x: jax.Array, w, copies: dict | None) -> jax.Array:
        """x [..., D] times the output projection ``w`` (the model's own, or the copies' "output")."""
        if self.uses_copies(copies, math.prod(x.shape[:-1])):
            w = copies["output"]
        return matmul(x, w, self.rows_for("output"))


PLAIN = MatmulPolicy()  # XLA's products on the model's own weights
