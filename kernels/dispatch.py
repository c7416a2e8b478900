"""The choice every family's entry point makes: which implementation runs for an ``impl`` on this platform.

The ``impl`` values of attention and the K/V write (the MoE entry point has its own, ``moe/dispatch.py``):
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

IMPLS = ("auto", "pallas", "xla", "reference")


def platform() -> str:
    """jax's default backend, with every GPU runtime ("cuda", "rocm") named "gpu"."""
    name = jax.default_backend()
    return "gpu" if name in ("gpu", "cuda", "rocm") else name


def choose_kernel(impl: str, backend: str | None, interpret: bool | None) -> tuple[str, bool]:
    """-> (kernel: "reference" | "xla" | "gpu" | "tpu", interpret)."""
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    if backend not in (None, "gpu", "tpu"):
        raise ValueError(f"backend must be None, 'gpu' or 'tpu', got {backend!r}")
    here = platform()
    if impl == "reference":
        return "reference", False
    if impl == "xla" or (impl == "auto" and here not in ("gpu", "tpu") and backend is None):
        return "xla", False
    kernel = backend or (here if here in ("gpu", "tpu") else "gpu")
    return kernel, (kernel != here) if interpret is None else bool(interpret)
