"""The C++ kernels of the CPU: one shared library built from this folder's sources and registered with XLA FFI
(``ffi.py``); the Python wrappers live with their families (``attention/cpu.py``, ``kv_write/cpu.py``,
``matmul/cpu.py``)."""
