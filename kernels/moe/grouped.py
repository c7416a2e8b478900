"""The grouped MoE: each token-slot (a token and one of its k experts) sorted by expert, the experts' products
as grouped matrix products over the sorted rows, then unsorted and combined with the routing weights.

Fixed shapes: the ``T * k`` slots are all computed, in an order that depends on the routing but in arrays whose
shapes do not (no capacity factor, no token dropped). ``group_sizes [E]`` tells the grouped product which rows
belong to which expert.

Expert stacks may be quantized (``QArray``, grouped along their contraction axis): the grouped products dequantize
a layer's stacks to the activations' dtype inside the step; the CPU's gathered and blocked forms dequantize only the
experts they read.

Two grouped products, one contract (``lhs [M, K]`` rows grouped by ``group_sizes``, ``rhs [E, K, N]``):
  ``jax.lax.ragged_dot``  portable (CPU, GPU; XLA lowers it on every backend).
  megablox ``gmm``        the Pallas TPU kernel (``jax.experimental.pallas.ops.tpu.megablox``); interpret mode
                          runs it anywhere, slowly. Its constraints (see :func:`megablox_tiling`):
                          - the row count must be a multiple of the row tile ``tm``: the slots are padded with
                            zero rows up to it, and the padding joins the last expert's group so that every row
                            of the output is written (rows outside every group are left uninitialized);
                          - Mosaic blocks: ``tk`` / ``tn`` a multiple of 128 or the whole dimension; ``tm`` a
                            multiple of 8 (16 for bfloat16 rows, which pack two to a sublane);
                          - the row tile is the unit of work per expert: a group starting inside a tile costs a
                            second visit of it, so tiles much larger than the average group waste the MXU.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jaxserve.kernels._common import cdiv
from jaxserve.kernels.matmul.qarray import QArray, dequantize, take
from jaxserve.kernels.moe.reference import GPT_OSS_ALPHA, GPT_OSS_LIMIT, activate


def sort_by_expert(ids: jax.Array, num_experts: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """ids [T, k] -> (order [T * k], sorted expert ids [T * k], group_sizes [E] int32).

    ``order`` is the stable argsort of the flat slot ids (slot ``s`` is token ``s // k``'s ``s % k``-th expert):
    row ``i`` of the sorted rows is slot ``order[i]``; slots of one expert keep their token order.
    """
    flat = ids.reshape(-1).astype(jnp.int32)
    order = jnp.argsort(flat, stable=True).astype(jnp.int32)
    group_sizes = jnp.bincount(flat, length=num_experts).astype(jnp.int32)
    return order, flat[order], group_sizes


def _float(w, dtype):
    """An expert stack as floats: a quantized one dequantized to ``dtype`` (the activations'), else as it is."""
    return dequantize(w, dtype) if isinstance(w, QArray) else w


def _experts(w, ids, dtype):
    """The expert matrices ``w[ids]`` as floats (a quantized stack: only those experts dequantized)."""
    return take(w, ids, dtype) if isinstance(w, QArray) else w[ids]


def _ragged(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array) -> jax.Array:
    return jax.lax.ragged_dot(lhs, rhs, group_sizes, preferred_element_type=jnp.float32)


_TILES = (512, 256, 128)


def _tile(dim: int, preferred: tuple[int, ...]) -> int:
    """The largest of ``preferred`` (multiples of 128) that divides ``dim``; else the whole dimension up to the
    largest tile (a block may span a whole dimension of any size), and past it the largest tile, the last block
    irregular (megablox masks the contraction's remainder and clips the output's). Gpt-oss's 2880 takes 512: a
    whole-dimension block of 2880 x 2880 overflows a v5e core's 16 MiB of scoped VMEM."""
    for t in preferred:
        if dim % t == 0:
            return t
    return dim if dim <= preferred[0] else preferred[0]


def megablox_tiling(rows: int, k: int, n: int, dtype) -> tuple[int, int, int]:
    """(tm, tk, tn) for a gmm of ``rows`` slot rows, ``[k] -> [n]``.

    ``tm``: 128 rows, or fewer for small steps (decode: ``T * top_k`` rows), rounded up to the sublane multiple
    (8 rows, 16 for 2-byte types). ``tk`` / ``tn``: 512, 256 or 128 when one divides the dimension, else the whole
    dimension up to 512, else 512 with an irregular last block.
    """
    sub = 16 if jnp.dtype(dtype).itemsize == 2 else 8
    tm = min(128, cdiv(rows, sub) * sub)
    return tm, _tile(k, _TILES), _tile(n, _TILES)


def _gmm(lhs, rhs, group_sizes, *, tiling, interpret):
    from jax.experimental.pallas.ops.tpu.megablox import gmm

    tm, tk, tn = tiling or megablox_tiling(lhs.shape[0], lhs.shape[1], rhs.shape[2], lhs.dtype)
    return gmm(lhs, rhs, group_sizes, preferred_element_type=jnp.float32, tiling=(tm, tk, tn), interpret=interpret)


@functools.partial(jax.jit, static_argnames=("product", "activation", "alpha", "limit", "tiling", "interpret"))
def moe_grouped(
    x: jax.Array,
    ids: jax.Array,
    weights: jax.Array,
    w_gate: jax.Array,
    w_up: jax.Array,
    w_down: jax.Array,
    b_gate: jax.Array | None = None,
    b_up: jax.Array | None = None,
    b_down: jax.Array | None = None,
    *,
    product: str = "ragged",
    activation: str = "swiglu",
    alpha: float = GPT_OSS_ALPHA,
    limit: float = GPT_OSS_LIMIT,
    tiling: tuple[int, int, int] | None = None,
    interpret: bool = False,
) -> jax.Array:
    """The MoE of ``kernels/moe/reference.py``'s contract with grouped products: ``product="ragged"``
    (``lax.ragged_dot``) or ``"megablox"`` (Pallas TPU ``gmm``; ``tiling`` (tm, tk, tn) overrides
    :func:`megablox_tiling` for all three products, ``interpret`` runs it in the Pallas interpreter).

    The products take the weights' dtype (x is cast to it) and accumulate in float32; the activation runs in
    float32 and is cast back to the weights' dtype for the down product. Returns [T, D] in x.dtype.
    """
    T, D = x.shape
    E, _, F = w_gate.shape
    k = ids.shape[1]
    w_gate, w_up, w_down = (_float(w, x.dtype) for w in (w_gate, w_up, w_down))
    # An id outside [0, E) is an expert held elsewhere (expert parallelism: this device's stacks are a slice of the
    # experts): its slots sort last, join no group and contribute nothing.
    ids = jnp.where((ids >= 0) & (ids < E), ids, E)
    order, sorted_ids, group_sizes = sort_by_expert(ids, E)
    wdt = w_gate.dtype
    rows = x.astype(wdt)[order // k]  # [T * k, D], sorted by expert
    M = T * k
    if product == "megablox":
        tm = (tiling or megablox_tiling(M, D, F, wdt))[0]
        pad = cdiv(M, tm) * tm - M
        rows = jnp.pad(rows, ((0, pad), (0, 0)))
        # Padding rows (and slots of experts held elsewhere) join the last group: every row is written.
        group_sizes = group_sizes.at[E - 1].add(M + pad - group_sizes.sum())
        sorted_ids = jnp.pad(sorted_ids, (0, pad), constant_values=E)

        def mm(lhs, rhs):
            return _gmm(lhs, rhs, group_sizes, tiling=tiling, interpret=interpret)
    elif product == "ragged":

        def mm(lhs, rhs):
            return _ragged(lhs, rhs, group_sizes)
    else:
        raise ValueError(f"product must be 'ragged' or 'megablox', got {product!r}")

    gate, up = mm(rows, w_gate), mm(rows, w_up)  # [M', F] float32
    if b_gate is not None:
        gate = gate + b_gate.astype(jnp.float32)[sorted_ids]
    if b_up is not None:
        up = up + b_up.astype(jnp.float32)[sorted_ids]
    h = activate(gate, up, activation, alpha=alpha, limit=limit).astype(w_down.dtype)
    out = mm(h, w_down)  # [M', D] float32
    if b_down is not None:
        out = out + b_down.astype(jnp.float32)[sorted_ids]
    out = jnp.where((sorted_ids < E)[:, None], out, 0.0)  # rows of no expert here
    # Unsort: slot order[i] is sorted row i; the padding rows (megablox) fall off the end.
    slots = jnp.zeros((M, D), jnp.float32).at[order].set(out[:M], unique_indices=True)
    y = (slots.reshape(T, k, D) * weights.astype(jnp.float32)[:, :, None]).sum(axis=1)
    return y.astype(x.dtype)


@functools.partial(jax.jit, static_argnames=("activation", "alpha", "limit"))
def moe_gathered(
    x: jax.Array,
    ids: jax.Array,
    weights: jax.Array,
    w_gate: jax.Array,
    w_up: jax.Array,
    w_down: jax.Array,
    b_gate: jax.Array | None = None,
    b_up: jax.Array | None = None,
    b_down: jax.Array | None = None,
    *,
    activation: str = "swiglu",
    alpha: float = GPT_OSS_ALPHA,
    limit: float = GPT_OSS_LIMIT,
) -> jax.Array:
    """The same contract by gathering each slot's expert matrices: ``T * k`` products of one row by one expert.

    For steps with fewer slots than experts (decode) on the CPU, where XLA's ``ragged_dot`` runs every expert over
    every row (it measured as slow as the dense reference): this reads only the chosen experts. Ids outside
    ``[0, E)`` contribute nothing, as in :func:`moe_grouped`.
    """
    E = w_gate.shape[0]
    here = (ids >= 0) & (ids < E)
    idx = jnp.where(here, ids, 0)
    wg, wu, wd = (_experts(w, idx, x.dtype) for w in (w_gate, w_up, w_down))  # [T, k, ...]
    xs = x.astype(wg.dtype)
    gate = jnp.einsum("td,tkdf->tkf", xs, wg, preferred_element_type=jnp.float32)
    up = jnp.einsum("td,tkdf->tkf", xs, wu, preferred_element_type=jnp.float32)
    if b_gate is not None:
        gate = gate + b_gate.astype(jnp.float32)[idx]
    if b_up is not None:
        up = up + b_up.astype(jnp.float32)[idx]
    h = activate(gate, up, activation, alpha=alpha, limit=limit).astype(wd.dtype)
    out = jnp.einsum("tkf,tkfd->tkd", h, wd, preferred_element_type=jnp.float32)
    if b_down is not None:
        out = out + b_down.astype(jnp.float32)[idx]
    w = jnp.where(here, weights.astype(jnp.float32), 0.0)
    return jnp.einsum("tkd,tk->td", jnp.where(here[..., None], out, 0.0), w).astype(x.dtype)


@functools.partial(jax.jit, static_argnames=("activation", "alpha", "limit", "block"))
def moe_blocked(
    x: jax.Array,
    ids: jax.Array,
    weights: jax.Array,
    w_gate: jax.Array,
    w_up: jax.Array,
    w_down: jax.Array,
    b_gate: jax.Array | None = None,
    b_up: jax.Array | None = None,
    b_down: jax.Array | None = None,
    *,
    activation: str = "swiglu",
    alpha: float = GPT_OSS_ALPHA,
    limit: float = GPT_OSS_LIMIT,
    block: int = 16,
) -> jax.Array:
    """The same contract as a loop: the slots sorted by expert, then for each expert its rows in blocks of
    ``block``, each block through the expert's whole MLP (gate, up, activation, down).

    For the CPU, where XLA's ``ragged_dot`` runs every expert over every row: this runs about
    ``T * k / block + E`` blocks of ``block`` rows (every expert's matrices read once, rows past its group
    computed and discarded). Ids outside ``[0, E)`` contribute nothing, as in :func:`moe_grouped`.
    """
    T, D = x.shape
    E = w_gate.shape[0]
    k = ids.shape[1]
    M = T * k
    ids = jnp.where((ids >= 0) & (ids < E), ids, E)
    order, _, group_sizes = sort_by_expert(ids, E)  # slots of no expert here sort last, in no group: rows stay 0
    wdt = x.dtype if isinstance(w_gate, QArray) else w_gate.dtype
    rows = jnp.pad(x.astype(wdt)[order // k], ((0, block), (0, 0)))  # a block may run past the last row
    starts = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(group_sizes)[:-1].astype(jnp.int32)])
    zero_b = jnp.zeros((E, 1), wdt)

    def expert(out, e):
        wg, wu, wd = (_experts(w, e, wdt) for w in (w_gate, w_up, w_down))
        bg = (b_gate if b_gate is not None else zero_b)[e].astype(jnp.float32)
        bu = (b_up if b_up is not None else zero_b)[e].astype(jnp.float32)
        bd = (b_down if b_down is not None else zero_b)[e].astype(jnp.float32)
        start, end = starts[e], starts[e] + group_sizes[e]

        def one_block(i, out):
            r0 = start + i * block
            h = jax.lax.dynamic_slice_in_dim(rows, r0, block)
            gate = jnp.dot(h, wg, preferred_element_type=jnp.float32) + bg
            up = jnp.dot(h, wu, preferred_element_type=jnp.float32) + bu
            a = activate(gate, up, activation, alpha=alpha, limit=limit).astype(wd.dtype)
            y = jnp.dot(a, wd, preferred_element_type=jnp.float32) + bd
            mine = (r0 + jnp.arange(block) < end)[:, None]
            old = jax.lax.dynamic_slice_in_dim(out, r0, block)
            return jax.lax.dynamic_update_slice_in_dim(out, jnp.where(mine, y, old), r0, 0)

        return jax.lax.fori_loop(0, cdiv(group_sizes[e], block), one_block, out), None

    out, _ = jax.lax.scan(expert, jnp.zeros((M + block, D), jnp.float32), jnp.arange(E))
    slots = jnp.zeros((M, D), jnp.float32).at[order].set(out[:M], unique_indices=True)
    y = (slots.reshape(T, k, D) * weights.astype(jnp.float32)[:, :, None]).sum(axis=1)
    return y.astype(x.dtype)
