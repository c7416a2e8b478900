"""Pre-quantized HF directories (compressed-tensors, AutoAWQ), served quantized (never dequantized to floats); gpt-oss's
MXFP4 experts are ``jaxserve.loading.mxfp4``'s, served as int8.

llm-compressor writes this format (its W4A16, W8A16, W8A8 and FP8 schemes, and GPTQ / AWQ runs saved through it),
vLLM serves it, and ``config.json`` names it: ``"quantization_config": {"quant_method": "compressed-tensors"}``.
A quantized linear layer ``x`` is stored as

===============  ==================================================================  =========================
format           tensors                                                             dequantized
===============  ==================================================================  =========================
pack-quantized   ``x.weight_packed`` int32 [out, in * b / 32] (b-bit values + 2^(b-1),  ``(q - zp) * scale``
                 first in the low bits), ``x.weight_scale`` [out, in / group],
                 ``x.weight_shape``; asymmetric: ``x.weight_zero_point`` packed the
                 same way along out
int-quantized    ``x.weight`` int8 [out, in], ``x.weight_scale`` (+ ``weight_zero_point``)  ``(q - zp) * scale``
float-quantized  ``x.weight`` float8_e4m3fn [out, in], ``x.weight_scale``                ``q * scale``
===============  ==================================================================  =========================

with one scale per group of ``in`` (group), per output channel (``[out, 1]``) or per tensor (``[1]``). Each becomes
a ``jaxserve.quant.QArray`` in the form ``(v - offset) * scale + zero``: 4-bit values stay 4-bit (two per byte),
8-bit ones int8, fp8 ones fp8. int8 weights with dynamic per-token int8 activations run as ``w8a8``; other
activation schemes (static input scales, fp8 activations) are served weight-only, with a warning saying so.

AutoAWQ directories (``quant_method: awq``, its 4-bit GEMM layout) come the same way: ``qweight`` int32 [in, out / 8]
and ``qzeros`` [in / group, out / 8] (eight 4-bit values a word, columns in AutoAWQ's order) and ``scales``
[in / group, out], dequantized ``(q - z) * scale``.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Iterator
from pathlib import Path

import ml_dtypes
import numpy as np

from jaxserve.loading.gguf import GGUFQuantized

logger = logging.getLogger(__name__)

# Per-module tensors that make up one quantized weight (buffered until the module is complete).
_PARTS = ("weight_packed", "weight_scale", "weight_shape", "weight_zero_point")
# Activation quantization parameters: not applied (the activations stay float; see the module docstring).
_ACTIVATION_PARTS = ("input_scale", "input_zero_point", "input_global_scale")


def quantization_config(model_dir: str | Path) -> dict | None:
    """The compressed-tensors ``quantization_config`` of an HF directory; None when it has none.

    Raises:
        ValueError: another quantization method (AWQ / GPTQ / bitsandbytes ... in their own formats), or a
            compressed-tensors format this loader does not read; the message names it.
    """
    hf = json.loads((Path(model_dir) / "config.json").read_text())
    q = hf.get("quantization_config") or hf.get("compression_config")
    if not q:
        return None
    method = q.get("quant_method", "compressed-tensors")
    if method == "mxfp4":  # gpt-oss's expert stacks (jaxserve.loading.mxfp4)
        return q
    if method == "awq":
        if q.get("bits", 4) != 4 or str(q.get("version", "gemm")).lower() != "gemm":
            raise ValueError(
                f"{model_dir}: AWQ checkpoints are read in their 4-bit GEMM layout; this one has bits="
                f"{q.get('bits')}, version={q.get('version')!r}"
            )
        return q
    if method != "compressed-tensors":
        raise ValueError(
            f"{model_dir}: quantization_config.quant_method {method!r} is not supported; jaxserve reads "
            "compressed-tensors, AutoAWQ (GEMM) and gpt-oss's MXFP4 checkpoints, and GGUF files (convert GPTQ ones to "
            "compressed-tensors with llm-compressor)"
        )
    formats = {q.get("format")} | {g.get("format") for g in (q.get("config_groups") or {}).values()}
    unknown = sorted(
        str(f)
        for f in formats - {None, "pack-quantized", "int-quantized", "float-quantized", "naive-quantized", "dense"}
    )
    if unknown:
        raise ValueError(
            f"{model_dir}: compressed-tensors format {', '.join(unknown)} is not supported "
            "(pack-quantized, int-quantized, float-quantized and naive-quantized are)"
        )
    return q


def _dynamic_int8_activations(qcfg: dict) -> bool:
    """True if every group quantizes its activations to int8 dynamically per token (our ``w8a8``)."""
    groups = [g for g in (qcfg.get("config_groups") or {}).values() if g.get("input_activations")]
    if not groups:
        return False
    ok = all(
        g["input_activations"].get("type", "int") == "int"
        and g["input_activations"].get("num_bits") == 8
        and g["input_activations"].get("dynamic") is True
        and g["input_activations"].get("strategy") in ("token", None)
        for g in groups
    )
    if not ok:
        logger.warning(
            "this checkpoint also quantizes activations (%s); jaxserve serves its weights quantized and "
            "its activations in float",
            [g["input_activations"] for g in groups],
        )
    return ok


def _unpack(packed: np.ndarray, bits: int, count: int) -> np.ndarray:
    """int32 [rows, words] -> uint8 [rows, count]: the stored (offset) b-bit values, first in the low bits."""
    rows = packed.shape[0]
    data = np.ascontiguousarray(packed).astype("<i4", copy=False).view(np.uint8).reshape(rows, -1)
    if bits == 8:
        return data[:, :count]
    return np.stack([data & 15, data >> 4], axis=-1).reshape(rows, -1)[:, :count]


def _packed_bits(name: str, words: int, count: int) -> int:
    for bits in (4, 8):
        if words == -(-count * bits // 32):
            return bits
    raise ValueError(
        f"{name}: {words} int32 words per row hold {count} values, which is neither 4-bit nor 8-bit "
        "packing (the only ones supported)"
    )


def _group_scale(name: str, scale: np.ndarray, out: int, cols: int) -> tuple[np.ndarray, int]:
    """The scale as float32 [out, groups] and its group size along ``in``."""
    scale = np.asarray(scale, np.float32)
    if scale.size == 1:  # per tensor
        scale = np.full((out, 1), scale.reshape(()), np.float32)
    scale = scale.reshape(out, -1) if scale.ndim == 1 else scale
    groups = scale.shape[-1]
    if scale.shape[0] != out or cols % groups:
        raise ValueError(f"{name}.weight_scale has shape {scale.shape}, which does not group a [{out}, {cols}] weight")
    return scale, cols // groups


def _module(name: str, parts: dict) -> GGUFQuantized:
    """One module's parts -> its quantized weight ([out, in] values grouped along in)."""
    zp = parts.get("weight_zero_point")
    if "weight_packed" in parts:
        packed = np.asarray(parts["weight_packed"])
        if packed.dtype != np.int32 or packed.ndim != 2 or "weight_scale" not in parts:
            raise ValueError(f"{name}: weight_packed must be a 2-D int32 tensor with a weight_scale")
        if "weight_shape" not in parts:
            raise ValueError(f"{name}: a packed weight needs its weight_shape")
        out, cols = (int(x) for x in np.asarray(parts["weight_shape"]).reshape(-1))
        bits = _packed_bits(name, packed.shape[1], cols)
        stored = _unpack(packed, bits, cols)  # q + 2^(bits-1)
        scale, group = _group_scale(name, parts["weight_scale"], out, cols)
        if zp is not None:  # asymmetric: zp packed along out, stored + 2^(bits-1) too
            zp = np.asarray(zp)
            zp_stored = _unpack(np.ascontiguousarray(zp.T), bits, out).T.astype(np.float32)  # [out, groups]
            zero = -zp_stored * scale  # (q - zp) * s = stored * s - zp_stored * s
            offset = 0
        else:
            zero, offset = None, 1 << (bits - 1)
        if bits == 8:  # 8-bit values are held as int8: stored - 128
            values = (stored.astype(np.int16) - 128).astype(np.int8)
            if zero is not None:
                zero = zero + 128 * scale
            offset = 0
        else:
            values = stored
        return GGUFQuantized(values, scale, zero, bits=bits, offset=offset, group=group)
    weight = np.asarray(parts.get("weight"))
    if "weight_scale" not in parts or weight.ndim != 2:
        raise ValueError(f"{name}: a quantized weight needs a 2-D weight and its weight_scale")
    out, cols = weight.shape
    scale, group = _group_scale(name, parts["weight_scale"], out, cols)
    zero = None
    if zp is not None and np.any(np.asarray(zp) != 0):
        zero = -np.asarray(zp, np.float32).reshape(out, -1) * scale
    if weight.dtype not in (np.int8, ml_dtypes.float8_e4m3fn):
        raise ValueError(f"{name}.weight has dtype {weight.dtype}; a quantized weight is int8 or float8_e4m3fn")
    return GGUFQuantized(weight, scale, zero, bits=8, offset=0, group=group)


def _split(hf_name: str) -> tuple[str, str]:
    module, _, leaf = hf_name.rpartition(".")
    return module, leaf


_AWQ_PARTS = ("qweight", "qzeros", "scales")
_AWQ_NIBBLE_COLUMN = np.array([0, 2, 4, 6, 1, 3, 5, 7])  # AutoAWQ: nibble i of a word holds its column this[i]


def _awq_unpack(packed: np.ndarray) -> np.ndarray:
    """AutoAWQ GEMM int32 [rows, cols / 8] -> uint8 [rows, cols] (the 4-bit values in column order)."""
    nibbles = (np.asarray(packed).astype("<u4")[:, :, None] >> (4 * np.arange(8, dtype=np.uint32))) & 15
    return nibbles[:, :, np.argsort(_AWQ_NIBBLE_COLUMN)].reshape(packed.shape[0], -1).astype(np.uint8)


def _awq_module(name: str, parts: dict, qcfg: dict) -> GGUFQuantized:
    """An AutoAWQ GEMM module (qweight [in, out / 8], qzeros [groups, out / 8], scales [groups, out]):
    ``w = (q - z) * scale`` per group of ``group_size`` inputs (without zero points: ``(q - 8) * scale``)."""
    if "qweight" not in parts or "scales" not in parts:
        raise ValueError(f"{name}: an AWQ module needs qweight and scales, got {sorted(parts)}")
    q = _awq_unpack(parts["qweight"]).T  # [out, in]
    scale = np.ascontiguousarray(np.asarray(parts["scales"], np.float32).T)  # [out, groups]
    out, cols = q.shape
    if scale.shape[0] != out or cols % scale.shape[1]:
        raise ValueError(
            f"{name}.scales has shape {parts['scales'].shape}, which does not group a [{cols}, {out}] qweight"
        )
    if "qzeros" in parts and qcfg.get("zero_point", True):
        zero = -_awq_unpack(parts["qzeros"]).T.astype(np.float32) * scale
        return GGUFQuantized(np.ascontiguousarray(q), scale, zero, bits=4, offset=0, group=cols // scale.shape[1])
    return GGUFQuantized(np.ascontiguousarray(q), scale, None, bits=4, offset=8, group=cols // scale.shape[1])


def quantized_tensors(tensors: Iterable[tuple[str, np.ndarray]], qcfg: dict) -> Iterator[tuple[str, object]]:
    """HF-named tensors of a compressed-tensors (or AutoAWQ) directory, each quantized module's parts joined into
    one ``x.weight`` (a ``GGUFQuantized``; ``act_quant`` set for dynamic int8 activations); other tensors as they
    are."""
    if qcfg.get("quant_method") == "awq":
        yield from _awq_tensors(tensors, qcfg)
        return
    if qcfg.get("quant_method") == "mxfp4":
        from jaxserve.loading.mxfp4 import mxfp4_tensors

        yield from mxfp4_tensors(tensors)
        return
    act_quant = _dynamic_int8_activations(qcfg)
    modules: dict[str, dict] = {}
    for hf_name, array in tensors:
        module, leaf = _split(hf_name)
        quantized_weight = leaf == "weight" and array.dtype in (np.int8, ml_dtypes.float8_e4m3fn)
        if leaf in _PARTS or quantized_weight:
            modules.setdefault(module, {})[leaf] = array
        elif leaf in _ACTIVATION_PARTS:
            continue
        else:
            yield hf_name, array
    for module, parts in modules.items():
        if "weight_packed" not in parts and "weight" not in parts:
            raise ValueError(f"{module}: quantization parameters {sorted(parts)} without a weight")
        q = _module(module, parts)
        q.act_quant = act_quant and q.values.dtype == np.int8 and q.zero is None and q.group == q.values.shape[1]
        yield f"{module}.weight", q


def _awq_tensors(tensors: Iterable[tuple[str, np.ndarray]], qcfg: dict) -> Iterator[tuple[str, object]]:
    modules: dict[str, dict] = {}
    for hf_name, array in tensors:
        module, leaf = _split(hf_name)
        if leaf in _AWQ_PARTS:
            modules.setdefault(module, {})[leaf] = array
        else:
            yield hf_name, array
    for module, parts in modules.items():
        yield f"{module}.weight", _awq_module(module, parts, qcfg)
