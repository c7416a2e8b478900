"""Products of a few rows by a layer's weights, reading the layer's matrix in place in its stack: on the CPU in C++
(``cpu.py``: bfloat16 / float32, quantized and W8A8 weights, and the dequantization of quantized ones), on a GPU in
Pallas (``gpu.py``: decode batches by float weights, where XLA:GPU copies each layer's slice first); ``qarray.py``
defines the quantized-weight layout they read (``jaxserve.quant`` builds and uses it)."""

from jaxserve.kernels.matmul.qarray import QArray

__all__ = ["QArray"]
