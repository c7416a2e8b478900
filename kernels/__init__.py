"""Attention and KV-cache kernels: Pallas for GPU (Triton) and TPU (Mosaic), jnp/lax for the CPU, and the reference.

Imported as ``jaxserve.kernels``. The entry points the model uses:

    ragged_paged_attention(q, k_cache, v_cache, layer, batch, *, sm_scale, sliding_window=0, soft_cap=None,
                           sinks=None, impl="auto", max_q_len=None) -> [T, num_q_heads, head_dim]
    write_kv(k_cache, v_cache, layer, new_k, new_v, batch, *, impl="auto") -> (k_cache, v_cache)
    moe(x, router_logits, w_gate, w_up, w_down, *, top_k, renormalize, activation, biases, impl="auto") -> [T, D]

``batch`` is the step's ``AttentionBatch`` (positions, slot_mapping, kv_lens, page_indices, cu_q_lens, num_seqs):
attention reads its kv_lens, page_indices, cu_q_lens and num_seqs, the K/V write its slot_mapping.
Layouts and semantics are defined once, in ``attention/reference.py``. A pool is an array, or an ``Int8Pages`` (int8
values and one float32 scale per token and KV head) that every implementation below reads and writes.

The package is organised by kernel family: ``attention/`` (reference, CPU jnp/lax blocks and C++ wrapper, Pallas
GPU and TPU, the ``AttentionBatch`` metadata), ``kv_write/`` (reference, Pallas, C++ wrapper), ``matmul/`` (the
CPU's C++ rows products and the ``QArray`` layout they read) and ``cpu/`` (the C++ sources, built into one shared
library and registered with XLA FFI by ``cpu/ffi.py``), and ``moe/`` (routing, the dense reference and the grouped
experts on ``lax.ragged_dot`` or megablox ``gmm``; :func:`moe` has its own ``impl`` values). The entry point
``moe`` shadows the subpackage as an attribute of this package: import the family's modules with ``from
jaxserve.kernels.moe.reference import ...``, not ``import jaxserve.kernels.moe as ...``.

``impl``:
  "auto"       Pallas kernel compiled for the platform on GPU / TPU; "xla" on anything else (the CPU).
  "pallas"     the Pallas kernel; on a platform it was not written for (the CPU) it runs in interpret
               mode. ``backend="gpu"|"tpu"`` picks which kernel (default: the platform's, GPU-style on CPU).
  "xla"        the CPU path. Attention and the K/V write go to C++ kernels called through XLA FFI
               (``cpu/*.cc``, built on first use by ``cpu/ffi.py``) when a C++ compiler is there (attention: for
               float32, bfloat16, fp8 or int8 caches); else attention runs in jnp/lax blocks
               (``attention/xla.py``) and K/V is written with the reference scatter.
  "reference"  the jnp reference, anywhere.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxserve.kernels._common import Int8Pages, is_fp8, is_int8_pages, settle_tpu_interpret
from jaxserve.kernels.attention import (
    AttentionBatch,
    ragged_paged_attention_gpu,
    ragged_paged_attention_ref,
    ragged_paged_attention_tpu,
    ragged_paged_attention_xla,
)
from jaxserve.kernels.attention.batch import POOL_LAYOUTS, validate_attention_inputs
from jaxserve.kernels.cpu import ffi
from jaxserve.kernels.kv_write import cpu as kv_write_cpu
from jaxserve.kernels.kv_write import write_kv_gpu, write_kv_ref, write_kv_tpu, write_latent
from jaxserve.kernels.matmul.qarray import QArray, dequantize
from jaxserve.kernels.moe import moe_blocked, moe_gathered, moe_grouped, moe_ref, route

__all__ = [
    "AttentionBatch",
    "Int8Pages",
    "ragged_paged_attention",
    "write_kv",
    "moe",
    "route",
    "moe_ref",
    "moe_grouped",
    "ragged_paged_attention_ref",
    "write_kv_ref",
    "ragged_paged_attention_gpu",
    "ragged_paged_attention_tpu",
    "ragged_paged_attention_xla",
    "write_kv_gpu",
    "write_kv_tpu",
]

_IMPLS = ("auto", "pallas", "xla", "reference")


def _platform() -> str:
    platform = jax.default_backend()
    return "gpu" if platform in ("gpu", "cuda", "rocm") else platform


def _choose(impl: str, backend: str | None, interpret: bool | None) -> tuple[str, bool]:
    """-> (kernel: "reference" | "xla" | "gpu" | "tpu", interpret)."""
    if impl not in _IMPLS:
        raise ValueError(f"impl must be one of {_IMPLS}, got {impl!r}")
    if backend not in (None, "gpu", "tpu"):
        raise ValueError(f"backend must be None, 'gpu' or 'tpu', got {backend!r}")
    platform = _platform()
    if impl == "reference":
        return "reference", False
    if impl == "xla" or (impl == "auto" and platform not in ("gpu", "tpu") and backend is None):
        return "xla", False
    kernel = backend or (platform if platform in ("gpu", "tpu") else "gpu")
    return kernel, (kernel != platform) if interpret is None else bool(interpret)


def ragged_paged_attention(
    q: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array,
    layer: jax.Array | int,
    batch: AttentionBatch,
    *,
    sm_scale: float,
    sliding_window: jax.Array | int = 0,
    soft_cap: float | None = None,
    sinks: jax.Array | None = None,
    impl: str = "auto",
    interpret: bool | None = None,
    backend: str | None = None,
    max_q_len: int | None = None,
    layout: str = "tokens_heads",
    **kernel_options,
) -> jax.Array:
    """Attention of a ragged batch of query chunks over the paged KV cache.

    Args:
      q: [T, num_q_heads, head_dim], the step's query tokens, sequences back to back.
      k_cache, v_cache: [L, num_pages, page_size, num_kv_heads, head_dim], the whole pool (or ``Int8Pages``); or
        a latent pool (multi-head latent attention, ``attention/mla.py``) k_cache [L, num_pages, page_size, width]
        whose rows are each token's key and value for every query head (v_cache is not read).
      layer: int32 scalar (may be traced), which layer of the pool to read.
      batch: the step's ``AttentionBatch``; attention reads
        kv_lens: [S] context length of each sequence including this step's tokens,
        page_indices: [S, pages_per_seq] page table,
        cu_q_lens: [S + 1] sequence i owns tokens cu_q_lens[i]:cu_q_lens[i + 1],
        num_seqs: int32 scalar; sequences past it (and their tokens) are padding.
      sm_scale: softmax scale (a Python float).
      sliding_window: 0 = off, else attend to the last ``sliding_window`` positions; may be traced.
      soft_cap: None or ``cap`` for ``cap * tanh(s / cap)`` on the scores.
      sinks: None, or [num_q_heads] float32 attention sinks (gpt-oss): each head's logit joins its softmax's
        denominator, with no value; may be traced (a layer's slice inside the layer scan).
      impl, backend, interpret: see the module docstring.
      max_q_len: optional static hint, the longest query chunk of any sequence in this step (1 for pure decode);
        "xla" picks its block size from it, the others ignore it. Any value gives the same result.
      layout: the pools', "tokens_heads" (the shape above) or "heads_tokens" ([L, num_pages, num_kv_heads,
        page_size, head_dim], the TPU's unpadded one): the TPU kernel reads it as it is, the others a transposed
        copy (for tests).
      **kernel_options: block sizes etc. for the chosen Pallas kernel or for "xla" (ignored by the reference).

    Returns:
      [T, num_q_heads, head_dim] in q.dtype; padding tokens are zeros.

    Raises:
      ValueError: bad impl/backend, inconsistent shapes, head counts that do not divide, or (when batch.kv_lens
        is concrete) a page table too short for the longest context.
    """
    kernel, interp = _choose(impl, backend, interpret)
    if k_cache.ndim == 4:  # a latent pool (MLA): keys and values alike; the TPU kernel and the CPU's (C++ and XLA)
        # read it as it is (a view between the pool's write and the CPU's reads copied the pool), the others as one
        # KV head
        k_cache = v_cache = k_cache if kernel in ("tpu", "xla") else k_cache[:, :, :, None, :]
    elif layout == "heads_tokens" and kernel != "tpu":
        k_cache, v_cache = jnp.swapaxes(k_cache, 2, 3), jnp.swapaxes(v_cache, 2, 3)
    elif kernel == "tpu":
        kernel_options["layout"] = layout
    elif layout != "tokens_heads":
        raise ValueError(f"layout must be one of {POOL_LAYOUTS}, got {layout!r}")
    if sinks is not None and jnp.shape(sinks) != (q.shape[1],):
        raise ValueError(f"sinks must be [num_q_heads] = [{q.shape[1]}], got shape {jnp.shape(sinks)}")
    args = (q, k_cache, v_cache, layer, batch)
    kw = dict(sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap, sinks=sinks)
    if kernel == "reference":
        validate_attention_inputs(q, k_cache, v_cache, batch, sm_scale=sm_scale, soft_cap=soft_cap)
        return ragged_paged_attention_ref(*args, **kw)
    if kernel == "xla":
        return ragged_paged_attention_xla(*args, **kw, max_q_len=max_q_len, **kernel_options)
    fn = ragged_paged_attention_gpu if kernel == "gpu" else ragged_paged_attention_tpu
    # The kernels' products take one element type: q in the cache's (as vLLM does); fp8 pages are widened to q's,
    # int8 pages (Int8Pages) dequantized to it.
    if q.dtype != k_cache.dtype and not is_fp8(k_cache.dtype) and not is_int8_pages(k_cache):
        out = fn(q.astype(k_cache.dtype), *args[1:], **kw, **kernel_options, interpret=interp)
        return out.astype(q.dtype)
    return fn(*args, **kw, **kernel_options, interpret=interp)


def write_kv(
    k_cache: jax.Array,
    v_cache: jax.Array,
    layer: jax.Array | int,
    new_k: jax.Array,
    new_v: jax.Array,
    batch: AttentionBatch,
    *,
    impl: str = "auto",
    interpret: bool | None = None,
    backend: str | None = None,
    layout: str = "tokens_heads",
) -> tuple[jax.Array, jax.Array]:
    """Writes the step's new K/V into one layer of the pool.

    Args:
      k_cache, v_cache: [L, num_pages, page_size, num_kv_heads, head_dim], the whole pool (or ``Int8Pages``).
      layer: int32 scalar (may be traced), the layer to write.
      new_k, new_v: [T, num_kv_heads, head_dim], cast to the cache dtype (``Int8Pages``: quantized per row). A
        latent pool k_cache [L, num_pages, page_size, width] takes new_k [T, width]; v_cache and new_v are unused.
      batch: the step's ``AttentionBatch``; the write reads its slot_mapping: [T] int32, ``page * page_size +
        offset`` of token t; negative slots (padding) write nothing.
      impl, backend, interpret: see the module docstring ("xla" on the CPU: the C++ in-place write when it is
        available, else the reference scatter).
      layout: the pools', as for ``ragged_paged_attention``; "heads_tokens" is written by XLA's scatter (in place
        on a donated pool), which Mosaic's row DMAs cannot do into a tiled (page_size, head_dim) page.

    Returns:
      The updated (k_cache, v_cache). Donate the caches to the enclosing jit so that the update happens in place
      (without donation XLA copies the pool).

    Raises:
      ValueError: bad impl/backend; the Pallas and C++ writes also refuse new rows that do not fit the caches.
    """
    kernel, interp = _choose(impl, backend, interpret)
    if k_cache.ndim == 4:  # a latent pool (MLA): new_k's rows [T, width] written, v_cache left as it is
        return write_latent(k_cache, layer, new_k, batch, kernel=kernel, interpret=interp), v_cache
    if layout not in POOL_LAYOUTS:
        raise ValueError(f"layout must be one of {POOL_LAYOUTS}, got {layout!r}")
    if layout == "heads_tokens":
        return write_kv_ref(k_cache, v_cache, layer, new_k, new_v, batch, layout=layout)
    if kernel == "xla" and jax.default_backend() == "cpu" and ffi.available():
        return kv_write_cpu.write_kv(k_cache, v_cache, layer, new_k, new_v, batch)  # in place, in C++
    if kernel in ("reference", "xla"):
        return write_kv_ref(k_cache, v_cache, layer, new_k, new_v, batch)
    fn = write_kv_gpu if kernel == "gpu" else write_kv_tpu
    return fn(k_cache, v_cache, layer, new_k, new_v, batch, interpret=interp)


_MOE_IMPLS = ("auto", "ragged", "megablox", "gather", "blocked", "reference")


def moe(
    x: jax.Array,
    router: jax.Array | tuple[jax.Array, jax.Array],
    w_gate: jax.Array,
    w_up: jax.Array,
    w_down: jax.Array,
    *,
    top_k: int | None = None,
    renormalize: bool = True,
    activation: str = "swiglu",
    router_bias: jax.Array | None = None,
    gate_bias: jax.Array | None = None,
    up_bias: jax.Array | None = None,
    down_bias: jax.Array | None = None,
    swiglu_alpha: float = 1.702,
    swiglu_limit: float = 7.0,
    impl: str = "auto",
    interpret: bool | None = None,
    tiling: tuple[int, int, int] | None = None,
) -> jax.Array:
    """A mixture-of-experts MLP over the step's tokens (layouts and semantics: ``moe/reference.py``).

    Args:
      x: [T, D] tokens.
      router: the router's logits [T, E] (routed here by ``route``: ``top_k``, ``renormalize``, ``router_bias``),
        or a routing already made, (expert ids [T, k] int, combine weights [T, k]).
      w_gate, w_up: [E, D, F] expert stacks; w_down: [E, F, D]; float, or quantized (``QArray`` grouped along D,
        F: dequantized inside the step to x's dtype; with fewer token slots than experts, as in decode, every
        implementation gathers the chosen experts and dequantizes only those).
      top_k: experts per token (with logits; taken from the ids' shape with a routing).
      renormalize: with logits, softmax over the chosen k (True) or the chosen k's softmax-over-all probabilities.
      activation: "swiglu" (silu(gate) * up) or "swiglu_clamped" (gpt-oss, with ``swiglu_alpha`` and
        ``swiglu_limit``).
      router_bias: [E] added to the logits (gpt-oss); gate_bias, up_bias: [E, F]; down_bias: [E, D].
      impl: "auto" (megablox on a TPU, ragged on a GPU; on the CPU gather for steps of fewer slots than experts,
        else blocked), "ragged" (``lax.ragged_dot``, any backend), "megablox" (Pallas TPU ``gmm``; off a TPU in
        interpret mode unless ``interpret`` says otherwise), "gather" (each slot's expert matrices gathered:
        ``moe_gathered``), "blocked" (a loop over experts and blocks of their rows: ``moe_blocked``), "reference"
        (every expert on every token: tests only).
      tiling: megablox's (tm, tk, tn) for its three products (default ``moe.megablox_tiling``).

    Returns:
      [T, D] in x.dtype.

    Raises:
      ValueError: a bad impl or activation, or inconsistent shapes (naming the argument).
    """
    if impl not in _MOE_IMPLS:
        raise ValueError(f"impl must be one of {_MOE_IMPLS}, got {impl!r}")
    if x.ndim != 2:
        raise ValueError(f"x must be [T, D], got shape {x.shape}")
    T, D = x.shape
    if any(len(w.shape) != 3 for w in (w_gate, w_up, w_down)):
        raise ValueError(
            f"w_gate, w_up must be [E, D, F] and w_down [E, F, D], got {w_gate.shape}, {w_up.shape}, {w_down.shape}"
        )
    E, _, F = w_gate.shape
    if w_gate.shape != (E, D, F):
        raise ValueError(f"w_gate must be [E, D, F] with D = x's hidden size {D}, got {w_gate.shape}")
    if w_up.shape != w_gate.shape:
        raise ValueError(f"w_up must match w_gate's [E, D, F] = {w_gate.shape}, got {w_up.shape}")
    if w_down.shape != (E, F, D):
        raise ValueError(f"w_down must be [E, F, D] = {(E, F, D)} (w_gate's experts and F), got {w_down.shape}")
    for name, b, shape in (
        ("gate_bias", gate_bias, (E, F)),
        ("up_bias", up_bias, (E, F)),
        ("down_bias", down_bias, (E, D)),
    ):
        if b is not None and jnp.shape(b) != shape:
            raise ValueError(f"{name} must be {list(shape)}, got shape {jnp.shape(b)}")
    if activation not in ("swiglu", "swiglu_clamped"):
        raise ValueError(f"activation must be 'swiglu' or 'swiglu_clamped', got {activation!r}")
    if isinstance(router, tuple):
        ids, weights = router
        if router_bias is not None:
            raise ValueError("router_bias applies to router logits, not to a routing (ids, weights) already made")
        if ids.ndim != 2 or ids.shape[0] != T or weights.shape != ids.shape:
            raise ValueError(f"router (ids, weights) must both be [T={T}, k], got {ids.shape} and {weights.shape}")
        if top_k is not None and top_k != ids.shape[1]:
            raise ValueError(f"top_k={top_k} differs from the routing's k={ids.shape[1]}")
    else:
        if router.shape != (T, E):
            raise ValueError(f"router_logits must be [T, E] = {[T, E]} (E from the expert stacks), got {router.shape}")
        if top_k is None or not 1 <= top_k <= E:
            raise ValueError(f"top_k must be in [1, num_experts={E}], got {top_k}")
        if router_bias is not None and jnp.shape(router_bias) != (E,):
            raise ValueError(f"router_bias must be [E] = [{E}], got shape {jnp.shape(router_bias)}")
        ids, weights = route(router, top_k, renormalize=renormalize, bias=router_bias)
    act = dict(activation=activation, alpha=swiglu_alpha, limit=swiglu_limit)
    biases = dict(b_gate=gate_bias, b_up=up_bias, b_down=down_bias)
    if impl == "reference":
        w_gate, w_up, w_down = (dequantize(w, x.dtype) if isinstance(w, QArray) else w for w in (w_gate, w_up, w_down))
        return moe_ref(x, ids, weights, w_gate, w_up, w_down, **act, **biases)
    if impl == "auto":
        # XLA:CPU's ragged_dot runs every expert over every row (as slow as the reference): on the CPU each
        # expert's rows run in blocks (bench/moe.py: 12x faster than ragged_dot at 512 tokens, D 1024, E 32, F 256,
        # top 4), or with fewer slots than experts the chosen experts' matrices are gathered.
        if _platform() == "cpu":
            impl = "gather" if x.shape[0] * ids.shape[1] < E else "blocked"
        else:
            impl = "megablox" if _platform() == "tpu" else "ragged"
    if impl in ("ragged", "megablox") and isinstance(w_gate, QArray) and x.shape[0] * ids.shape[1] < E:
        # a grouped product needs the layer's stacks as floats: with fewer slots than experts (decode) only the
        # chosen experts are dequantized, so a step reads k experts' bytes per token, not the whole stack
        impl = "gather"
    if impl == "gather":
        return moe_gathered(x, ids, weights, w_gate, w_up, w_down, **biases, **act)
    if impl == "blocked":
        return moe_blocked(x, ids, weights, w_gate, w_up, w_down, **biases, **act)
    interp = False
    if impl == "megablox":
        interp = (_platform() != "tpu") if interpret is None else bool(interpret)
    out = moe_grouped(
        x, ids, weights, w_gate, w_up, w_down, **biases, product=impl, **act, tiling=tiling, interpret=interp
    )
    return settle_tpu_interpret(out, interp)
