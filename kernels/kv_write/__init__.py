"""Writing the step's new K/V rows into the page pool: the jnp reference, the Pallas kernels for GPU and TPU, the
CPU's C++ write (``cpu.py``), and ``write_kv`` (``dispatch.py``), the entry point that picks one of them."""

from jaxserve.kernels.kv_write.dispatch import write_kv
from jaxserve.kernels.kv_write.pallas import write_kv_gpu, write_kv_tpu, write_latent
from jaxserve.kernels.kv_write.reference import write_kv_ref, write_latent_ref

__all__ = ["write_kv", "write_kv_gpu", "write_kv_ref", "write_kv_tpu", "write_latent", "write_latent_ref"]
