"""Products of a few rows by a layer's weights on the CPU, in C++ (``cpu.py``): bfloat16 / float32, quantized and
W8A8 weights, and the dequantization of quantized ones; ``qarray.py`` defines the quantized-weight layout they read
(``jaxserve.quant`` builds and uses it)."""

from jaxserve.kernels.matmul.qarray import QArray

__all__ = ["QArray"]
