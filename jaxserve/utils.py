"""Integer helpers shared by the host side and the kernels. Plain Python: importing this imports no jax."""

from __future__ import annotations


def cdiv(a, b):
    """Ceiling division ``ceil(a / b)`` for ``b > 0``: Python ints, or integer numpy / jax arrays (elementwise)."""
    return -(-a // b)


def next_pow2(n: int) -> int:
    """The smallest power of two >= ``n`` (1 for ``n <= 1``)."""
    return 1 << max(int(n) - 1, 0).bit_length()
