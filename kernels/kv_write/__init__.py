"""Writing the step's new K/V rows into the page pool: the jnp reference, the Pallas kernels for GPU and TPU, and the
CPU's C++ write (``cpu.py``)."""

from jaxserve.kernels.kv_write.pallas import write_kv_gpu, write_kv_tpu, write_latent
from jaxserve.kernels.kv_write.reference import write_kv_ref, write_latent_ref

__all__ = ["write_kv_gpu", "write_kv_ref", "write_kv_tpu", "write_latent", "write_latent_ref"]
