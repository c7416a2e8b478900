"""Ragged paged attention: the jnp reference (the contract), the CPU's jnp/lax blocks and C++ kernel, and the Pallas
kernels for GPU (Triton) and TPU (Mosaic); ``AttentionBatch`` is the step's metadata they read, and
``ragged_paged_attention`` (``dispatch.py``) the entry point that picks one of them."""

from jaxserve.kernels.attention.batch import AttentionBatch
from jaxserve.kernels.attention.dispatch import ragged_paged_attention
from jaxserve.kernels.attention.gpu import ragged_paged_attention_gpu
from jaxserve.kernels.attention.reference import ragged_paged_attention_ref
from jaxserve.kernels.attention.tpu import ragged_paged_attention_tpu
from jaxserve.kernels.attention.xla import ragged_paged_attention_xla

__all__ = [
    "AttentionBatch",
    "ragged_paged_attention",
    "ragged_paged_attention_gpu",
    "ragged_paged_attention_ref",
    "ragged_paged_attention_tpu",
    "ragged_paged_attention_xla",
]
