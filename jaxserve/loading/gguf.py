"""GGUF files: metadata, tensors, dequantization, and the mapping to Hugging Face names.

A GGUF file is a header (magic, version, counts), key/value metadata, tensor descriptors (name, ggml shape,
type, offset), then the aligned tensor data. :class:`GGUFCheckpoint` parses the header itself (the ``gguf``
package's reader builds a numpy array per token string, about 2 s for a 49k vocab) and memory-maps the data.

Shapes here are numpy order (outermost first): ggml's ``ne = [in, out]`` is our ``(out, in)``, which is already
the HF layout of a linear weight.

Dequantizers follow the block layouts of ggml (``ggml-common.h``): every type packs ``block_size`` values into
``type_size`` bytes, with one or more float16 scales. Each is vectorized over blocks and run in chunks so the
temporaries stay in cache.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
import mmap
import struct
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from jaxserve.config import ModelConfig, RopeScaling
from jaxserve.models import registry
from jaxserve.models.schema import ParamSpec, param_schema
from jaxserve.utils import cdiv

_Q = GGMLQuantizationType
logger = logging.getLogger(__name__)


def _field_value(field) -> Any:
    value = field.contents()
    if isinstance(value, np.generic):
        value = value.item()
    return value


def read_metadata(path: str | Path) -> dict[str, Any]:
    """Returns the key/value metadata of a GGUF file as plain Python values (str, int, float, bool, list).

    Raises:
        FileNotFoundError: ``path`` does not exist.
        ValueError: the file is not a readable GGUF file (bad magic, truncated).
    """
    import gguf

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file not found: {path}")
    try:
        reader = gguf.GGUFReader(str(path))
    except Exception as e:  # gguf raises assorted errors (struct, index, value) on damaged files
        raise ValueError(f"{path} is not a readable GGUF file ({type(e).__name__}: {e})") from e
    return {name: _field_value(field) for name, field in reader.fields.items()}


# ---------------------------------------------------------------------------------------------- dequantization
def _f16(blocks: np.ndarray, start: int) -> np.ndarray:
    """The float16 at byte ``start`` of every block, as float32. [n, 1]"""
    return blocks[:, start : start + 2].view(np.float16).astype(np.float32)


def _nibbles(qs: np.ndarray, group: int) -> np.ndarray:
    """[n, k] bytes -> [n, 2k] 4-bit values: per ``group`` bytes, their low nibbles then their high nibbles."""
    n = qs.shape[0]
    qs = qs.reshape(n, -1, 1, group)
    out = np.empty((n, qs.shape[1], 2, group), np.uint8)
    np.bitwise_and(qs[:, :, 0], 0x0F, out=out[:, :, 0])
    np.right_shift(qs[:, :, 0], 4, out=out[:, :, 1])
    return out.reshape(n, -1)


def _crumbs(qs: np.ndarray, group: int) -> np.ndarray:
    """[n, k] bytes -> [n, 4k] 2-bit values: per ``group`` bytes, bits 0-1 of each, then bits 2-3, 4-5, 6-7."""
    n = qs.shape[0]
    shifts = np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 4, 1)
    return ((qs.reshape(n, -1, 1, group) >> shifts) & 3).reshape(n, -1)


def _bit_planes(bits: np.ndarray) -> np.ndarray:
    """[n, 32] bytes -> [n, 256] bits, element ``b * 32 + l`` being bit ``b`` of byte ``l`` (K-quant high bits)."""
    n = bits.shape[0]
    planes = np.unpackbits(bits, axis=1, bitorder="little").reshape(n, 32, 8)  # [n, byte, bit]
    return planes.transpose(0, 2, 1).reshape(n, 256)


def _k_scales_mins(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K: 8 six-bit scales and 8 six-bit mins packed in 12 bytes. [n, 12] -> ([n, 8], [n, 8]) float32.

    Bytes 0-3 hold scales 0-3 in their low 6 bits, bytes 4-7 mins 0-3; bytes 8-11 hold the low 4 bits of
    scales 4-7 (low nibble) and mins 4-7 (high nibble), whose top 2 bits sit in the top bits of bytes 0-3 / 4-7.
    """
    lo_s, lo_m, hi = packed[:, 0:4], packed[:, 4:8], packed[:, 8:12]
    scales = np.concatenate([lo_s & 0x3F, (hi & 0x0F) | ((lo_s >> 6) << 4)], axis=1)
    mins = np.concatenate([lo_m & 0x3F, (hi >> 4) | ((lo_m >> 6) << 4)], axis=1)
    return scales.astype(np.float32), mins.astype(np.float32)


def _q4_0(b):  # d: f16 | qs: 16 bytes; x = d * (q - 8)
    return _f16(b, 0) * (_nibbles(b[:, 2:18], 16).astype(np.int8) - np.int8(8)).astype(np.float32)


def _q4_1(b):  # d, m: f16 | qs: 16 bytes; x = d * q + m
    return _f16(b, 0) * _nibbles(b[:, 4:20], 16).astype(np.float32) + _f16(b, 2)


def _q5(b, qh_at):  # 5-bit values: a nibble plus bit j of the little-endian uint32 qh
    high = np.unpackbits(b[:, qh_at : qh_at + 4], axis=1, bitorder="little") << 4
    return _nibbles(b[:, qh_at + 4 : qh_at + 20], 16) | high


def _q5_0(b):  # d: f16 | qh: 4 bytes | qs: 16 bytes; x = d * (q - 16)
    return _f16(b, 0) * (_q5(b, 2).astype(np.int8) - np.int8(16)).astype(np.float32)


def _q5_1(b):  # d, m: f16 | qh | qs; x = d * q + m
    return _f16(b, 0) * _q5(b, 4).astype(np.float32) + _f16(b, 2)


def _q8_0(b):  # d: f16 | qs: 32 int8
    return _f16(b, 0) * b[:, 2:34].view(np.int8).astype(np.float32)


def _q2_k(b):  # scales: 16 bytes (scale | min << 4) | qs: 64 bytes | d, dmin: f16; per 16 values
    n = b.shape[0]
    sc = b[:, 0:16]
    dl = (_f16(b, 80) * (sc & 0x0F).astype(np.float32))[:, :, None]  # [n, 16, 1]
    ml = (_f16(b, 82) * (sc >> 4).astype(np.float32))[:, :, None]
    q = _crumbs(b[:, 16:80], 32).reshape(n, 16, 16).astype(np.float32)
    return (dl * q - ml).reshape(n, 256)


def _q3_k(b):  # hmask: 32 bytes | qs: 64 bytes | scales: 12 bytes (16 six-bit) | d: f16
    n = b.shape[0]
    packed = b[:, 96:108]
    low = np.concatenate([packed[:, 0:8] & 0x0F, packed[:, 0:8] >> 4], axis=1)  # scale i: low 4 bits
    high = (packed[:, 8:12].reshape(n, 1, 4) >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 4, 1)) & 3
    scales = (low | (high.reshape(n, 16) << 4)).astype(np.int8) - np.int8(32)
    dl = (_f16(b, 108) * scales.astype(np.float32))[:, :, None]  # [n, 16, 1]
    # a cleared hmask bit means the 2-bit value is offset by -4
    q = _crumbs(b[:, 32:96], 32).astype(np.int8) - ((_bit_planes(b[:, 0:32]) ^ 1) << 2).astype(np.int8)
    return (dl * q.reshape(n, 16, 16).astype(np.float32)).reshape(n, 256)


def _q4_k(b):  # d, dmin: f16 | scales/mins: 12 bytes | qs: 128 bytes; per 32 values
    n = b.shape[0]
    sc, mn = _k_scales_mins(b[:, 4:16])
    dl, ml = (_f16(b, 0) * sc)[:, :, None], (_f16(b, 2) * mn)[:, :, None]  # [n, 8, 1]
    q = _nibbles(b[:, 16:144], 32).reshape(n, 8, 32).astype(np.float32)
    return (dl * q - ml).reshape(n, 256)


def _q5_k(b):  # d, dmin: f16 | scales/mins: 12 bytes | qh: 32 bytes | qs: 128 bytes
    n = b.shape[0]
    sc, mn = _k_scales_mins(b[:, 4:16])
    dl, ml = (_f16(b, 0) * sc)[:, :, None], (_f16(b, 2) * mn)[:, :, None]
    q = _nibbles(b[:, 48:176], 32) | (_bit_planes(b[:, 16:48]) << 4)
    return (dl * q.reshape(n, 8, 32).astype(np.float32) - ml).reshape(n, 256)


def _q6_k(b):  # ql: 128 bytes | qh: 64 bytes | scales: 16 int8 | d: f16; x = d * scale * (q - 32)
    n = b.shape[0]
    q = _nibbles(b[:, 0:128], 64) | (_crumbs(b[:, 128:192], 32) << 4)
    q = (q.astype(np.int8) - np.int8(32)).reshape(n, 16, 16).astype(np.float32)
    dl = (_f16(b, 208) * b[:, 192:208].view(np.int8).astype(np.float32))[:, :, None]
    return (dl * q).reshape(n, 256)


def _q8_k(b):  # d: f32 | qs: 256 int8 | bsums: 16 int16 (only used by dot products)
    return b[:, 0:4].view(np.float32) * b[:, 4:260].view(np.int8).astype(np.float32)


_BLOCK_DEQUANT: dict[GGMLQuantizationType, Callable[[np.ndarray], np.ndarray]] = {
    _Q.Q4_0: _q4_0,
    _Q.Q4_1: _q4_1,
    _Q.Q5_0: _q5_0,
    _Q.Q5_1: _q5_1,
    _Q.Q8_0: _q8_0,
    _Q.Q2_K: _q2_k,
    _Q.Q3_K: _q3_k,
    _Q.Q4_K: _q4_k,
    _Q.Q5_K: _q5_k,
    _Q.Q6_K: _q6_k,
    _Q.Q8_K: _q8_k,
}
SUPPORTED_TYPES: tuple[GGMLQuantizationType, ...] = (_Q.F32, _Q.F16, _Q.BF16, *_BLOCK_DEQUANT)
_CHUNK_VALUES = 1 << 18  # values per dequantization chunk: temporaries of ~1 MiB stay in cache


def dequantize(
    raw: np.ndarray, qtype: GGMLQuantizationType | int, shape: tuple[int, ...], *, name: str | None = None
) -> np.ndarray:
    """Dequantizes the raw bytes of one ggml tensor to float32.

    Args:
        raw: the tensor's bytes (any dtype and shape; its buffer is read as bytes in order).
        qtype: the ggml type, a ``gguf.GGMLQuantizationType`` (or its int value).
        shape: numpy shape of the result, outermost first (ggml ``ne`` reversed); the last dimension must be
            a whole number of blocks.
        name: tensor name, used in error messages.

    Returns:
        A new, writable float32 array of ``shape``.

    Raises:
        ValueError: the type is unsupported, or the byte count does not match ``shape``.
    """
    what = f" for tensor {name!r}" if name else ""
    label = f"tensor {name!r}" if name else "tensor"
    try:
        qtype = GGMLQuantizationType(qtype)
    except ValueError:
        raise ValueError(f"unknown ggml type {qtype!r}{what}") from None
    if qtype not in SUPPORTED_TYPES:
        raise ValueError(
            f"unsupported ggml type {qtype.name}{what}; supported: {', '.join(t.name for t in SUPPORTED_TYPES)}"
        )
    shape = tuple(int(s) for s in shape)
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    count = int(np.prod(shape, dtype=np.int64))
    if shape and shape[-1] % block_size:
        raise ValueError(
            f"{qtype.name} {label}: last dimension {shape[-1]} is not a multiple of the block size {block_size}"
        )
    buf = np.ascontiguousarray(raw).reshape(-1).view(np.uint8)
    if buf.size != count // block_size * type_size:
        raise ValueError(
            f"{qtype.name} {label} of shape {shape} needs {count // block_size * type_size} bytes, got {buf.size}"
        )
    if qtype == _Q.F32:
        return buf.view(np.float32).reshape(shape).copy()
    if qtype == _Q.F16:
        return buf.view(np.float16).astype(np.float32).reshape(shape)
    if qtype == _Q.BF16:
        return (buf.view(np.uint16).astype(np.uint32) << 16).view(np.float32).reshape(shape)
    blocks = buf.reshape(-1, type_size)
    out = np.empty((blocks.shape[0], block_size), np.float32)
    fn, step = _BLOCK_DEQUANT[qtype], max(1, _CHUNK_VALUES // block_size)
    for start in range(0, blocks.shape[0], step):
        out[start : start + step] = fn(blocks[start : start + step])
    return out.reshape(shape)


# ---------------------------------------------------------------------------------------------- served quantized
@dataclasses.dataclass
class GGUFQuantized:
    """One tensor's blocks repacked, not dequantized: ``values`` [out, in] (int8, or 4-bit values in uint8, one
    per byte), ``scale`` (and ``zero``) [out, in / group]: the block's own d (and m) in float16, or for the
    K-quants the float32 products of the super-block's d and each sub-block's scale. Dequantized:
    ``(values - offset) * scale (+ zero)``, exactly as ``dequantize`` computes it."""

    values: np.ndarray
    scale: np.ndarray
    zero: np.ndarray | None
    bits: int
    offset: int
    group: int = 32
    act_quant: bool = False  # W8A8: the product quantizes its activations per token (compressed-tensors dirs)

    def map_rows(self, fn) -> GGUFQuantized:
        """The same tensor with ``fn`` applied to the rows (output channels) of every part."""
        return dataclasses.replace(
            self, values=fn(self.values), scale=fn(self.scale), zero=None if self.zero is None else fn(self.zero)
        )


def _d16(b: np.ndarray, start: int) -> np.ndarray:
    return b[:, start : start + 2].view(np.float16)


def _k_repack(b: np.ndarray, values: np.ndarray):
    """Q4_K / Q5_K: per 32 values, scale d * sc and zero -(dmin * m) in float32 (the products the dequantizer
    forms: ``(d * sc) * q - dmin * m`` is ``q * scale + zero`` exactly)."""
    sc, mn = _k_scales_mins(b[:, 4:16])
    return values, _f16(b, 0) * sc, -(_f16(b, 2) * mn)


# ggml type -> (bits, offset, group, blocks -> (values, scale, zero or None)): w = (values - offset) * scale + zero
_REPACK = {
    _Q.Q8_0: (8, 0, 32, lambda b: (b[:, 2:34].view(np.int8), _d16(b, 0), None)),
    _Q.Q4_0: (4, 8, 32, lambda b: (_nibbles(b[:, 2:18], 16), _d16(b, 0), None)),
    _Q.Q4_1: (4, 0, 32, lambda b: (_nibbles(b[:, 4:20], 16), _d16(b, 0), _d16(b, 2))),
    _Q.Q4_K: (4, 0, 32, lambda b: _k_repack(b, _nibbles(b[:, 16:144], 32))),
    _Q.Q5_K: (
        8,
        0,
        32,
        lambda b: _k_repack(b, (_nibbles(b[:, 48:176], 32) | (_bit_planes(b[:, 16:48]) << 4)).view(np.int8)),
    ),
    _Q.Q6_K: (
        8,
        32,
        16,
        lambda b: (
            (_nibbles(b[:, 0:128], 64) | (_crumbs(b[:, 128:192], 32) << 4)).view(np.int8),
            _f16(b, 208) * b[:, 192:208].view(np.int8).astype(np.float32),
            None,
        ),
    ),
}
REPACKABLE_TYPES = tuple(_REPACK)


def repack(
    raw: np.ndarray, qtype: GGMLQuantizationType | int, shape: tuple[int, ...], *, name: str | None = None
) -> GGUFQuantized:
    """A Q8_0 / Q4_0 / Q4_1 / Q4_K / Q5_K / Q6_K matrix's blocks as values and scales (see ``GGUFQuantized``);
    ``shape`` [..., out, in]: an expert stack [E, out, in] keeps its leading axis.

    Raises:
        ValueError: another type (see ``REPACKABLE_TYPES``), or a byte count that does not match ``shape``.
    """
    qtype = GGMLQuantizationType(qtype)
    if qtype not in _REPACK:
        raise ValueError(
            f"{qtype.name} tensor {name!r} cannot be served quantized (served as is: "
            f"{', '.join(t.name for t in REPACKABLE_TYPES)})"
        )
    shape = tuple(int(x) for x in shape)
    in_dim, out_dim = shape[-1], math.prod(shape[:-1])
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    buf = np.ascontiguousarray(raw).reshape(-1).view(np.uint8)
    if in_dim % block_size or buf.size != out_dim * in_dim // block_size * type_size:
        raise ValueError(f"{qtype.name} tensor {name!r} of shape {shape} does not match its {buf.size} bytes")
    bits, offset, group, fn = _REPACK[qtype]
    values, scale, zero = fn(buf.reshape(-1, type_size))
    return GGUFQuantized(
        values.reshape(shape).copy(),
        scale.reshape(*shape[:-1], -1).copy(),
        None if zero is None else zero.reshape(*shape[:-1], -1).copy(),
        bits,
        offset,
        group,
    )


# ---------------------------------------------------------------------------------------------- file parsing
@dataclasses.dataclass(frozen=True)
class GGUFTensorInfo:
    """One tensor descriptor. ``shape`` is numpy order (ggml ``ne`` reversed); ``offset`` is absolute."""

    name: str
    shape: tuple[int, ...]
    qtype: GGMLQuantizationType
    offset: int
    nbytes: int


class _Truncated(Exception):
    pass


class _Corrupt(Exception):
    pass


_GGUF_MAGIC = b"GGUF"
_U32, _U64 = struct.Struct("<I"), struct.Struct("<Q")
# GGUF value type id -> (struct format, numpy dtype) for scalars; 8 = string, 9 = array.
_SCALARS = {
    0: ("<B", np.uint8),
    1: ("<b", np.int8),
    2: ("<H", np.uint16),
    3: ("<h", np.int16),
    4: ("<I", np.uint32),
    5: ("<i", np.int32),
    6: ("<f", np.float32),
    7: ("<?", np.bool_),
    10: ("<Q", np.uint64),
    11: ("<q", np.int64),
    12: ("<d", np.float64),
}
_STRUCTS = {t: struct.Struct(fmt) for t, (fmt, _) in _SCALARS.items()}
_MAX_DIMS = 4  # GGML_MAX_DIMS


class _Cursor:
    """Bounds-checked little-endian reads from the mapped file; reading past the end raises _Truncated."""

    def __init__(self, buf, size: int):
        self.buf, self.size, self.pos = buf, size, 0

    def take(self, n: int) -> int:
        start = self.pos
        if n < 0 or start + n > self.size:
            raise _Truncated(f"needs {n} bytes at offset {start}, file has {self.size}")
        self.pos = start + n
        return start

    def u32(self) -> int:
        return _U32.unpack_from(self.buf, self.take(4))[0]

    def u64(self) -> int:
        return _U64.unpack_from(self.buf, self.take(8))[0]

    def string(self) -> str:
        n = self.u64()
        start = self.take(n)
        try:
            return self.buf[start : start + n].decode("utf-8")
        except UnicodeDecodeError as e:
            raise _Corrupt(f"string at offset {start} is not UTF-8") from e

    def strings(self, count: int) -> list[str]:
        # The hot loop of header parsing (token lists, BPE merges): locals only.
        buf, size, pos, unpack, out = self.buf, self.size, self.pos, _U64.unpack_from, []
        try:
            for _ in range(count):
                if pos + 8 > size:
                    raise _Truncated(f"string at offset {pos} runs past the end ({size} bytes)")
                (n,) = unpack(buf, pos)
                pos += 8
                if pos + n > size:
                    raise _Truncated(f"string at offset {pos} runs past the end ({size} bytes)")
                out.append(buf[pos : pos + n].decode("utf-8"))
                pos += n
        except UnicodeDecodeError as e:
            raise _Corrupt(f"string at offset {pos} is not UTF-8") from e
        self.pos = pos
        return out

    def value(self, vtype: int) -> Any:
        if vtype in _STRUCTS:
            st = _STRUCTS[vtype]
            return st.unpack_from(self.buf, self.take(st.size))[0]
        if vtype == 8:
            return self.string()
        if vtype == 9:
            item_type, count = self.u32(), self.u64()
            if count > self.size - self.pos:  # every item takes at least one byte
                raise _Truncated(f"array of {count} items at offset {self.pos} runs past the end")
            if item_type in _SCALARS:
                dtype = np.dtype(_SCALARS[item_type][1]).newbyteorder("<")
                start = self.take(count * dtype.itemsize)
                return np.frombuffer(self.buf, dtype, count, start).tolist()
            if item_type == 8:
                return self.strings(count)
            return [self.value(item_type) for _ in range(count)] if item_type == 9 else self.value(item_type)
        raise _Corrupt(f"unknown metadata value type {vtype} at offset {self.pos}")


def _parse(buf, size: int) -> tuple[dict[str, Any], dict[str, GGUFTensorInfo]]:
    cur = _Cursor(buf, size)
    magic = bytes(buf[0:4]) if size >= 4 else bytes(buf[0:size])
    if magic != _GGUF_MAGIC:
        raise _Corrupt(f"bad magic {magic!r}, expected {_GGUF_MAGIC!r}")
    cur.take(4)
    version = cur.u32()
    if version not in (2, 3):
        swapped = int.from_bytes(version.to_bytes(4, "little"), "big")
        kind = "big-endian GGUF is not supported" if swapped in (2, 3) else "unsupported GGUF version"
        raise _Corrupt(f"{kind} (version field {version})")
    n_tensors, n_kv = cur.u64(), cur.u64()
    if n_tensors > size or n_kv > size:
        raise _Corrupt(f"implausible counts: {n_tensors} tensors, {n_kv} metadata keys in {size} bytes")
    metadata: dict[str, Any] = {"GGUF.version": version, "GGUF.tensor_count": n_tensors, "GGUF.kv_count": n_kv}
    for _ in range(n_kv):
        key = cur.string()
        if key in metadata:
            raise _Corrupt(f"duplicate metadata key {key!r}")
        metadata[key] = cur.value(cur.u32())
    infos = []
    for _ in range(n_tensors):
        name = cur.string()
        n_dims = cur.u32()
        if not 0 < n_dims <= _MAX_DIMS:
            raise _Corrupt(f"tensor {name!r} has {n_dims} dimensions")
        ne = [cur.u64() for _ in range(n_dims)]
        type_id, offset = cur.u32(), cur.u64()
        try:
            qtype = GGMLQuantizationType(type_id)
        except ValueError:
            raise _Corrupt(f"tensor {name!r} has unknown ggml type {type_id}") from None
        block_size, type_size = GGML_QUANT_SIZES[qtype]
        if ne[0] % block_size:
            raise _Corrupt(f"tensor {name!r} ({qtype.name}) row length {ne[0]} is not a multiple of {block_size}")
        count = int(np.prod(ne, dtype=object))
        infos.append((name, tuple(reversed(ne)), qtype, offset, count // block_size * type_size))
    alignment = metadata.get("general.alignment", 32)
    if not isinstance(alignment, int) or alignment <= 0:
        raise _Corrupt(f"bad general.alignment {alignment!r}")
    data_start = cdiv(cur.pos, alignment) * alignment
    tensors: dict[str, GGUFTensorInfo] = {}
    for name, shape, qtype, offset, nbytes in infos:
        if name in tensors:
            raise _Corrupt(f"duplicate tensor {name!r}")
        start = data_start + offset
        if start + nbytes > size:
            raise _Truncated(f"tensor {name!r} needs bytes {start}..{start + nbytes}, file has {size}")
        tensors[name] = GGUFTensorInfo(name, shape, qtype, start, nbytes)
    return metadata, tensors


# ---------------------------------------------------------------------------------------------- architectures
# Tensor names come from the parameter schema (``ParamSpec.gguf`` / ``.hf``); these are the file's other tensors.
_CONSUMED = (
    "rope_freqs.weight",
    "rope_factors_long.weight",
    "rope_factors_short.weight",
)  # folded into ModelConfig.rope_scaling, not a weight of the HF model


def _whole_stack(hf: str) -> str:
    """A schema HF name as llama.cpp stores it: an expert stack (``mlp.experts.{e}.gate_proj.weight``) in one
    tensor, [E, out, in] (``mlp.experts.gate_proj.weight``); other names as they are."""
    return hf.replace("{e}.", "")


def _unpermute_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undoes llama.cpp's q/k permutation for the llama architecture.

    HF's Llama rotates the two halves of each head (rotate_half); ggml's "normal" rope rotates adjacent pairs,
    so llama.cpp's converter interleaves the halves: row ``(h, a, j)`` (half ``a``, index ``j``) is stored at
    ``(h, j, a)``. We swap them back.
    """
    half = w.shape[0] // n_head // 2
    return w.reshape(n_head, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _llama3_rope_scaling(freqs: np.ndarray, head_dim: int, theta: float, meta: dict[str, Any], arch: str):
    """Llama-3.1 GGUFs carry rope scaling as per-frequency divisors (``rope_freqs.weight``) instead of
    parameters. Rebuilds the "llama3" parameters (factor = largest divisor; low/high frequency factors 1 and 4
    and 8192 original positions, the values of every Llama 3.x release) and checks they reproduce the tensor.
    """
    factor = float(freqs.max())
    orig = int(meta.get(f"{arch}.rope.scaling.original_context_length") or 8192)
    scaling = RopeScaling("llama3", factor, 1.0, 4.0, orig)
    inv_freq = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    wavelen = 2 * np.pi / inv_freq
    smooth = (orig / wavelen - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
    expected = np.where(
        wavelen < orig / scaling.high_freq_factor,
        1.0,
        np.where(wavelen > orig / scaling.low_freq_factor, factor, 1.0 / ((1 - smooth) / factor + smooth)),
    )
    if freqs.shape != expected.shape or not np.allclose(freqs, expected, rtol=1e-4):
        raise ValueError(
            "rope_freqs.weight does not match llama3 rope scaling "
            f"(factor={factor}, low=1, high=4, original={orig}); this rope scaling is not supported"
        )
    return scaling


# ---------------------------------------------------------------------------------------------- checkpoint
class GGUFCheckpoint:
    """A GGUF file opened for reading: metadata, model config, and tensors in HF naming.

    The data is memory-mapped; tensors are dequantized one at a time when iterated.

    Raises (on construction):
        FileNotFoundError: ``path`` does not exist.
        ValueError: the file is truncated, corrupt, or not a GGUF file.
    """

    def __init__(self, path: str | Path):
        self.path = Path(path)
        if not self.path.is_file():
            raise FileNotFoundError(f"GGUF file not found: {self.path}")
        size = self.path.stat().st_size
        if size == 0:
            raise ValueError(f"{self.path} is truncated or corrupt: the file is empty")
        with open(self.path, "rb") as f:
            self._buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        try:
            self.metadata, self.tensors = _parse(self._buf, size)
        except _Truncated as e:
            raise ValueError(f"{self.path} is truncated (or corrupt): {e}") from None
        except _Corrupt as e:
            raise ValueError(f"{self.path} is corrupt or not a GGUF file: {e}") from None

    def close(self) -> None:
        """Unmaps the file. Arrays from :meth:`raw` must be gone by then; dequantized ones are copies."""
        self._buf.close()

    def __enter__(self) -> GGUFCheckpoint:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"GGUFCheckpoint({str(self.path)!r}, architecture={self.architecture!r}, tensors={len(self.tensors)})"

    @property
    def architecture(self) -> str | None:
        """``general.architecture`` as written in the file (not checked against the supported list)."""
        return self.metadata.get("general.architecture")

    def tensor_shapes(self) -> dict[str, tuple[int, ...]]:
        """GGUF tensor name -> numpy shape (outermost first)."""
        return {name: info.shape for name, info in self.tensors.items()}

    def raw(self, name: str) -> np.ndarray:
        """The undecoded bytes of a tensor: a read-only uint8 view of the mapped file."""
        info = self.tensors[name]
        return np.frombuffer(self._buf, np.uint8, info.nbytes, info.offset)

    def tensor(self, name: str) -> np.ndarray:
        """A tensor dequantized to float32, as stored (GGUF layout, no HF conversion).

        Raises:
            KeyError: no tensor of that name.
            ValueError: its type is not supported.
        """
        if name not in self.tensors:
            raise KeyError(f"{self.path.name} has no tensor {name!r}")
        info = self.tensors[name]
        return dequantize(self.raw(name), info.qtype, info.shape, name=name)

    # ---------------------------------------------------------------- config
    def _family(self) -> registry.Family:
        return registry.for_gguf(self.architecture, self.path.name)

    def _meta(self, key: str, default: Any = ...) -> Any:
        if key in self.metadata:
            return self.metadata[key]
        if default is ...:
            raise ValueError(f"{self.path.name}: required GGUF metadata key {key!r} is missing")
        return default

    def _uniform(self, key: str, default: Any = ...) -> Any:
        """A per-model hyperparameter that some converters write per layer (a list): must be uniform."""
        value = self._meta(key, default)
        if isinstance(value, list):
            if len(set(value)) != 1:
                raise ValueError(f"{self.path.name}: {key} varies per layer ({value}); not supported")
            value = value[0]
        return value

    def model_config(self) -> ModelConfig:
        """The :class:`ModelConfig` described by the file's ``{arch}.*`` and ``tokenizer.ggml.*`` metadata.

        Raises:
            ValueError: the architecture or one of its features is not supported, or a required key is missing.
        """
        family = self._family()
        arch = self.architecture
        a = arch + "."
        hidden = self._meta(a + "embedding_length")
        num_layers = self._meta(a + "block_count")
        moe = self._moe_fields(num_layers)
        if moe and family.gguf_moe_family:  # llama.cpp's llama with experts: Mixtral
            family = registry.family(family.gguf_moe_family)
        num_heads = self._uniform(a + "attention.head_count")
        num_kv_heads = self._uniform(a + "attention.head_count_kv", num_heads)
        head_dim = self._meta(a + "attention.key_length", None)
        if head_dim is None and "blk.0.attn_k.weight" in self.tensors:
            head_dim = self.tensors["blk.0.attn_k.weight"].shape[0] // num_kv_heads
        head_dim = head_dim or hidden // num_heads
        value_dim = self._meta(a + "attention.value_length", head_dim)
        if value_dim != head_dim:
            raise ValueError(f"{self.path.name}: value_length {value_dim} != key_length {head_dim}; not supported")
        theta = float(self._meta(a + "rope.freq_base", 10000.0))

        tokens = self.metadata.get("tokenizer.ggml.tokens")
        vocab_size = len(tokens) if tokens else self._meta(a + "vocab_size", None)
        if vocab_size is None:
            vocab_size = self.tensors["token_embd.weight"].shape[0]

        rope_scaling = None
        scaling_type = self._meta(a + "rope.scaling.type", "none")
        if scaling_type == "linear":
            rope_scaling = RopeScaling("linear", float(self._meta(a + "rope.scaling.factor")))
        elif scaling_type == "yarn":  # Qwen2.5 / Qwen3 long context, as llama.cpp's converter writes it
            for key in ("rope.scaling.attn_factor", "rope.scaling.yarn_log_multiplier"):
                if self._meta(a + key, 1.0 if key.endswith("attn_factor") else 0.0) not in (1.0, 0.0):
                    raise ValueError(f"{self.path.name}: yarn with {a + key} is not supported")
            rope_scaling = RopeScaling(
                "yarn",
                float(self._meta(a + "rope.scaling.factor")),
                original_max_position_embeddings=int(self._meta(a + "rope.scaling.original_context_length")),
                beta_fast=float(self._meta(a + "rope.scaling.yarn_beta_fast", 32.0)),
                beta_slow=float(self._meta(a + "rope.scaling.yarn_beta_slow", 1.0)),
            )
        elif scaling_type != "none":
            raise ValueError(f"{self.path.name}: rope scaling type {scaling_type!r} is not supported")
        if "rope_factors_long.weight" in self.tensors:  # longrope (Phi-3): its factors as tensors
            if rope_scaling is not None:
                raise ValueError(f"{self.path.name}: both rope.scaling.type and rope_factors_long.weight are set")
            original = int(self._meta(a + "rope.scaling.original_context_length"))
            attn = self._meta(a + "rope.scaling.attn_factor", None)
            rope_scaling = RopeScaling(
                "longrope",
                self._meta(a + "context_length", original) / original,
                original_max_position_embeddings=original,
                attention_factor=None if attn is None else float(attn),
                short_factor=self.tensor("rope_factors_short.weight").reshape(-1).tolist(),
                long_factor=self.tensor("rope_factors_long.weight").reshape(-1).tolist(),
            )
        if "rope_freqs.weight" in self.tensors:
            if rope_scaling is not None:
                raise ValueError(f"{self.path.name}: both rope.scaling.type and rope_freqs.weight are set")
            rope_scaling = _llama3_rope_scaling(
                self.tensor("rope_freqs.weight").reshape(-1), head_dim, theta, self.metadata, arch
            )

        eos_ids: list[int] = []
        for key in ("eos_token_id", "eot_token_id", "eom_token_id"):
            token = self.metadata.get("tokenizer.ggml." + key)
            if token is not None and token not in eos_ids:
                eos_ids.append(token)
        fields = dict(
            architecture=family.name,
            vocab_size=vocab_size,
            hidden_size=hidden,
            intermediate_size=self._uniform(a + "feed_forward_length"),
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            rms_norm_eps=float(self._meta(a + "attention.layer_norm_rms_epsilon", 1e-6)),
            rope_theta=theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=self._meta(a + "context_length", 4096),
            tie_word_embeddings="output.weight" not in self.tensors,
            attention_bias="blk.0.attn_q.bias" in self.tensors,
            qk_norm="blk.0.attn_q_norm.weight" in self.tensors,
            partial_rotary_factor=self._meta(a + "rope.dimension_count", head_dim) / head_dim,
            sliding_window=self._meta(a + "attention.sliding_window", None) or None,
            bos_token_id=self.metadata.get("tokenizer.ggml.bos_token_id"),
            eos_token_ids=tuple(eos_ids),
        )
        fields |= moe
        fields |= family.flags
        fields |= family.gguf_fields(lambda key, default=...: self._meta(a + key, default), fields)
        return ModelConfig(**fields)

    def _moe_fields(self, num_layers: int) -> dict[str, Any]:
        """The mixture of experts' fields, from ``{arch}.expert_*`` (any architecture: llama.cpp's keys are the same
        for all); {} for a dense model. The MoE layers are those with a router (``blk.N.ffn_gate_inp.weight``): all
        of them in llama.cpp's files, some where a converter kept an HF model's dense layers (Qwen3-MoE's
        ``mlp_only_layers``)."""
        a = self.architecture + "."
        experts = self._meta(a + "expert_count", 0)
        if not experts:
            return {}
        flags = tuple(f"blk.{i}.ffn_gate_inp.weight" in self.tensors for i in range(num_layers))
        if not any(flags):
            raise ValueError(
                f"{self.path.name}: {a}expert_count is {experts} but no layer has a router (blk.N.ffn_gate_inp.weight)"
            )
        return {
            "num_experts": experts,
            "num_experts_per_tok": self._meta(a + "expert_used_count"),
            "moe_intermediate_size": self._meta(a + "expert_feed_forward_length", None),
            "moe_layers": None if all(flags) else flags,
        }

    @functools.cached_property
    def _hf_names(self) -> tuple[dict[str, str], dict[str, str]]:
        """(global, per-layer) GGUF name -> HF name, from the parameter schema of this file's config."""
        specs = [s for s in param_schema(self.model_config()).values() if s.gguf and s.hf]
        return (
            {s.gguf: s.hf for s in specs if not s.per_layer},
            {s.gguf: _whole_stack(s.hf) for s in specs if s.per_layer} | dict(self._family().gguf_fused),
        )

    @functools.cached_property
    def _layer_specs(self) -> dict[str, ParamSpec]:
        """Per-layer GGUF name (after ``blk.N.``) -> its parameter's spec."""
        return {s.gguf: s for s in param_schema(self.model_config()).values() if s.gguf and s.per_layer}

    def _spec_of(self, name: str, cfg: ModelConfig) -> ParamSpec | None:
        """The spec of a per-layer tensor (None: another tensor). A router, an expert stack or their biases must
        have one entry per expert along their first axis (GGUF's ``[E, ...]``).

        Raises:
            ValueError: one of those does not, naming the tensor and the file's expert count.
        """
        parts = name.split(".", 2)
        spec = self._layer_specs.get(parts[2]) if len(parts) == 3 and parts[0] == "blk" else None
        shape = self.tensors[name].shape
        if spec is not None and {"experts", "routes"} & set(spec.axes) and shape[0] != cfg.num_experts:
            raise ValueError(
                f"{self.path.name}: tensor {name!r} has shape {shape}, whose first axis should have one entry per "
                f"expert: {self.architecture}.expert_count is {cfg.num_experts}"
            )
        return spec

    # ---------------------------------------------------------------- tensors in HF convention
    def hf_name(self, gguf_name: str) -> str | None:
        """The HF transformers name of a GGUF tensor; None for tensors the HF model does not have.

        Raises:
            ValueError: unsupported architecture, or a tensor this loader does not know.
        """
        family = self._family()
        global_names, layer_names = self._hf_names
        if gguf_name in global_names:
            return global_names[gguf_name]
        if gguf_name in _CONSUMED:
            return None
        parts = gguf_name.split(".", 2)
        if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in layer_names:
            return f"model.layers.{parts[1]}.{layer_names[parts[2]]}"
        raise ValueError(f"{self.path.name}: tensor {gguf_name!r} is not known to the {family.name} GGUF loader")

    def hf_tensor_shapes(self) -> dict[str, tuple[int, ...]]:
        """HF name -> shape of every tensor :meth:`iter_hf_tensors` yields."""
        out = {}
        for name, info in self.tensors.items():
            hf = self.hf_name(name)
            if hf is not None:
                out[hf] = info.shape
        return out

    def iter_hf_tensors(
        self, progress: bool = True, quantized: bool = False
    ) -> Iterator[tuple[str, np.ndarray | GGUFQuantized]]:
        """Yields ``(hf_name, float32 array)`` for every weight, in HF transformers' naming and layout.

        llama's q/k rows are un-permuted, and Gemma's norm weights (stored by llama.cpp as ``1 + w``) are
        returned as HF's ``w``. A tied model yields no ``lm_head.weight``. A MoE layer's expert stacks come whole,
        [E, out, in], under the expert's HF name without its index (``mlp.experts.gate_proj.weight``).

        Args:
            progress: show a tqdm bar if loading takes more than a second.
            quantized: matrices and MoE expert stacks stored as Q8_0, Q4_0, Q4_1, Q4_K, Q5_K or Q6_K come as
                ``GGUFQuantized`` (their own blocks, repacked) instead of float32; those of other types are
                dequantized, and logged. MoE routers are always dequantized (computed in float32).

        Raises:
            ValueError: unsupported architecture, tensor type, or tensor name; a router or expert stack whose
                expert count is not the file's ``expert_count``.
        """
        from tqdm.auto import tqdm

        cfg = self.model_config()
        permuted = self._family().gguf_permuted_qk
        names = [(name, self.hf_name(name)) for name in self.tensors]  # fail on unknown names before any work
        names = [(name, hf, self._spec_of(name, cfg)) for name, hf in names if hf is not None]
        total = sum(self.tensors[name].nbytes for name, _, _ in names)
        with tqdm(
            total=total,
            unit="B",
            unit_scale=True,
            desc=f"Loading {self.path.name}",
            delay=1.0,
            disable=not progress,
            leave=False,
        ) as bar:
            fallback = []
            for name, hf, spec in names:
                info = self.tensors[name]
                kind = spec.kind if spec is not None else None
                # the router is computed in float32; an expert stack [E, out, in] is served quantized as a matrix is
                matrix = kind == "experts" or (
                    len(info.shape) == 2 and not name.endswith("norm.weight") and kind != "router"
                )
                if quantized and matrix and info.qtype in _REPACK:
                    w = repack(self.raw(name), info.qtype, info.shape, name=name)
                    rows = w.map_rows
                else:
                    if quantized and matrix and info.qtype not in (_Q.F32, _Q.F16, _Q.BF16):
                        fallback.append(f"{name} ({info.qtype.name})")
                    w = self.tensor(name)
                    rows = lambda fn, w=w: fn(w)  # noqa: E731
                if permuted and hf.endswith(("q_proj.weight", "q_proj.bias")):
                    w = rows(lambda x: _unpermute_rows(x, cfg.num_heads))
                elif permuted and hf.endswith(("k_proj.weight", "k_proj.bias")):
                    w = rows(lambda x: _unpermute_rows(x, cfg.num_kv_heads))
                elif cfg.norm_weight_offset and name.endswith("norm.weight"):  # llama.cpp stores 1 + w
                    w -= cfg.norm_weight_offset
                bar.update(self.tensors[name].nbytes)
                yield hf, w
            if fallback:
                logger.warning(
                    "%s: %d matrices of types that are not served quantized were dequantized to float: %s",
                    self.path.name,
                    len(fallback),
                    ", ".join(fallback[:8]) + (" ..." if len(fallback) > 8 else ""),
                )
