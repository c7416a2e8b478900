"""gpt-oss's MXFP4 expert weights (``"quantization_config": {"quant_method": "mxfp4"}``), read from an HF directory.

OpenAI's checkpoints store each expert stack as two tensors:

  ``x_blocks`` uint8 [E, out, in / 32, 16]  FP4 (e2m1) values, two a byte, the first in the low nibble;
  ``x_scales`` uint8 [E, out, in / 32]      one power-of-two scale per 32 values (e8m0: ``2 ** (s - 127)``),

for ``x`` in ``mlp.experts.gate_up_proj`` and ``mlp.experts.down_proj``; the value of an FP4 code is
``FP4_VALUES[code]``. Dequantized and transposed to ``[E, in, out]`` it is the bfloat16 checkpoints' ``x`` (what
``transformers.integrations.mxfp4.convert_moe_packed_tensors`` computes).

jaxserve serves the stacks quantized, as int8 values in groups of 32 (``mxfp4_as_int8``): twice an FP4 value is an
integer in [-12, 12], so ``2 * FP4_VALUES[code]`` with the scale ``2 ** (s - 128)`` is the same weight exactly, at
one byte a weight plus a bfloat16 scale per 32 (the file's 4.25 bits a weight take 8.5; bfloat16 would take 16),
dequantized inside the MoE products as any quantized stack is.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator

import ml_dtypes
import numpy as np

logger = logging.getLogger(__name__)

# e2m1: sign, two exponent bits, one mantissa bit.
FP4_VALUES = np.array(
    [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], np.float32
)


def dequantize_mxfp4(blocks: np.ndarray, scales: np.ndarray, name: str = "tensor") -> np.ndarray:
    """``blocks`` uint8 [..., out, groups, 16] and ``scales`` uint8 [..., out, groups] -> float32
    [..., groups * 32, out] (the stack's last two axes swapped: [in, out])."""
    blocks, scales = _checked(blocks, scales, name)
    values = np.stack([FP4_VALUES[blocks & 0x0F], FP4_VALUES[blocks >> 4]], axis=-1)  # [..., groups, B, 2]
    exponent = scales.astype(np.int32) - 127
    w = np.ldexp(values, exponent[..., None, None]).reshape(*scales.shape[:-1], -1)  # [..., out, in]
    return np.ascontiguousarray(np.swapaxes(w, -1, -2))


def mxfp4_as_int8(blocks: np.ndarray, scales: np.ndarray, name: str = "tensor"):
    """``blocks`` [..., out, groups, 16] and ``scales`` [..., out, groups] (uint8) -> a ``GGUFQuantized`` of int8
    values [..., out, groups * 32] (twice the FP4 values) and bfloat16 scales [..., out, groups] (``2 ** (s - 128)``,
    exact: bfloat16 has float32's exponent range),
    grouped by 32 along the input: exactly the dequantized weight."""
    from jaxserve.loading.gguf import GGUFQuantized

    blocks, scales = _checked(blocks, scales, name)
    codes = np.stack([blocks & 0x0F, blocks >> 4], axis=-1).reshape(*scales.shape[:-1], -1)  # [..., out, in]
    values = (2 * FP4_VALUES).astype(np.int8)[codes]
    scale = np.ldexp(np.float32(1), scales.astype(np.int32) - 128).astype(ml_dtypes.bfloat16)  # powers of 2: exact
    return GGUFQuantized(values, scale, None, bits=8, offset=0, group=32)


def _checked(blocks, scales, name):
    blocks, scales = np.asarray(blocks), np.asarray(scales)
    if blocks.dtype != np.uint8 or scales.dtype != np.uint8:
        raise ValueError(f"{name}: MXFP4 blocks and scales are uint8, got {blocks.dtype} and {scales.dtype}")
    if blocks.ndim < 2 or blocks.shape[:-1] != scales.shape or blocks.shape[-1] != 16:
        raise ValueError(
            f"{name}: MXFP4 blocks of shape {blocks.shape} do not match scales of shape {scales.shape} "
            "(blocks [..., groups, 16], scales [..., groups])"
        )
    return blocks, scales


def mxfp4_tensors(tensors: Iterable[tuple[str, np.ndarray]]) -> Iterator[tuple[str, np.ndarray]]:
    """The directory's tensors with each ``x_blocks`` / ``x_scales`` pair joined into ``x`` (``mxfp4_as_int8``:
    [E, out, in], logged once); other tensors as they are. A pair missing its other half is an error naming it."""
    pending: dict[str, dict[str, np.ndarray]] = {}
    warned = False  # logged once
    for name, array in tensors:
        base, _, part = name.rpartition("_")
        if part not in ("blocks", "scales") or not base:
            yield name, array
            continue
        parts = pending.setdefault(base, {})
        parts[part] = array
        if len(parts) < 2:
            continue
        del pending[base]
        if not warned:
            logger.info(
                "MXFP4 expert weights are served as int8 in groups of 32: their FP4 values exactly, 1 byte a weight "
                "(%s first)",
                base,
            )
            warned = True
        yield base, mxfp4_as_int8(parts["blocks"], parts["scales"], base)
    for base, parts in pending.items():
        missing = "scales" if "blocks" in parts else "blocks"
        raise ValueError(f"MXFP4 tensor {base}_{missing} is missing (the checkpoint has {base}_{next(iter(parts))})")
