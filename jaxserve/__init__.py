"""jaxserve: a JAX/XLA compiled LLM inference engine for TPUs, GPUs and CPUs.

The public names are imported lazily, so the host-side modules (scheduler, block manager, request) can be
used and tested without importing jax.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

_EXPORTS = {
    "LLM": "jaxserve.llm",
    "LLMEngine": "jaxserve.engine.llm_engine",
    "SamplingParams": "jaxserve.core.sampling_params",
    "RequestOutput": "jaxserve.core.outputs",
    "CompletionOutput": "jaxserve.core.outputs",
    "Logprob": "jaxserve.core.outputs",
}
__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'jaxserve' has no attribute {name!r}")
