"""Attention and KV-cache kernels: Pallas for GPU (Triton) and TPU (Mosaic), jnp/lax for the CPU, and the reference.

Imported as ``jaxserve.kernels``. The entry points the model uses:

    ragged_paged_attention(q, k_cache, v_cache, layer, batch, *, sm_scale, sliding_window=0, soft_cap=None,
                           sinks=None, impl="auto", max_q_len=None) -> [T, num_q_heads, head_dim]
    write_kv(k_cache, v_cache, layer, new_k, new_v, batch, *, impl="auto") -> (k_cache, v_cache)
    moe_experts(x, router_logits, w_gate, w_up, w_down, *, top_k, renormalize, activation, biases, impl="auto")
        -> [T, D]

``batch`` is the step's ``AttentionBatch`` (positions, slot_mapping, kv_lens, page_indices, cu_q_lens, num_seqs):
attention reads its kv_lens, page_indices, cu_q_lens and num_seqs, the K/V write its slot_mapping.
Layouts and semantics are defined once, in ``attention/reference.py``. A pool is an array, or an ``Int8Pages`` (int8
values and one float32 scale per token and KV head) that every implementation below reads and writes.

The package is organised by kernel family: ``attention/`` (reference, CPU jnp/lax blocks and C++ wrapper, Pallas
GPU and TPU, the ``AttentionBatch`` metadata), ``kv_write/`` (reference, Pallas, C++ wrapper), ``matmul/`` (the
CPU's C++ rows products and the ``QArray`` layout they read) and ``cpu/`` (the C++ sources, built into one shared
library and registered with XLA FFI by ``cpu/ffi.py``), and ``moe/`` (routing, the dense reference and the grouped
experts on ``lax.ragged_dot`` or megablox ``gmm``). Each family's entry point and its choice of implementation are
in the family's ``dispatch.py`` (``attention/dispatch.py``, ``kv_write/dispatch.py``, ``moe/dispatch.py``, with its
own ``impl`` values); the choice attention and the K/V write share is ``dispatch.py``. This module re-exports the
public names.

``impl`` (attention and the K/V write): "auto" (the Pallas kernel compiled for a GPU / TPU, else "xla"), "pallas",
"xla" (the CPU's C++ kernels, or jnp/lax blocks without a C++ compiler) or "reference"; ``dispatch.py`` says what each
runs.
"""

from jaxserve.kernels._common import Int8Pages
from jaxserve.kernels.attention import (
    AttentionBatch,
    ragged_paged_attention,
    ragged_paged_attention_gpu,
    ragged_paged_attention_ref,
    ragged_paged_attention_tpu,
    ragged_paged_attention_xla,
)
from jaxserve.kernels.attention.batch import POOL_LAYOUTS
from jaxserve.kernels.kv_write import write_kv, write_kv_gpu, write_kv_ref, write_kv_tpu, write_latent
from jaxserve.kernels.moe import moe_experts, moe_grouped, moe_ref, route

__all__ = [
    "AttentionBatch",
    "Int8Pages",
    "POOL_LAYOUTS",
    "ragged_paged_attention",
    "write_kv",
    "write_latent",
    "moe_experts",
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
