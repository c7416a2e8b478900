"""Hugging Face model directories: ``config.json`` + ``*.safetensors`` (sharded, with an index), read lazily.

The safetensors format is an 8-byte little-endian header length, a JSON header, then raw tensor bytes. We
memory-map each file and hand out one tensor at a time, so a 16 GB checkpoint never needs 32 GB of RAM.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator
from pathlib import Path

import ml_dtypes
import numpy as np

from jaxserve.config import ModelConfig

_DTYPES = {
    "F32": np.float32,
    "F16": np.float16,
    "BF16": ml_dtypes.bfloat16,
    "F64": np.float64,
    "I64": np.int64,
    "I32": np.int32,
    "I16": np.int16,
    "I8": np.int8,
    "U8": np.uint8,
    "BOOL": np.bool_,
    "F8_E4M3": ml_dtypes.float8_e4m3fn,
    "F8_E5M2": ml_dtypes.float8_e5m2,
}


def read_config(model_dir: str | Path) -> ModelConfig:
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"no config.json in {model_dir}")
    try:
        hf = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from e
    return ModelConfig.from_hf(hf)


def safetensors_files(model_dir: str | Path) -> list[Path]:
    model_dir = Path(model_dir)
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        files = [model_dir / n for n in names]
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise FileNotFoundError(f"{index} names shard(s) that are missing: {missing}")
        return files
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {model_dir}")
    return files


def _read_header(path: Path) -> tuple[dict, int]:
    size = path.stat().st_size
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            raise ValueError(f"{path} is truncated: no safetensors header")
        (n,) = struct.unpack("<Q", raw)
        if n > size - 8:
            raise ValueError(f"{path} is truncated: header of {n} bytes in a file of {size}")
        header = json.loads(f.read(n))
    header.pop("__metadata__", None)
    return header, 8 + n


def iter_safetensors(path: str | Path) -> Iterator[tuple[str, np.ndarray]]:
    """Yields (name, array) for each tensor of one file; arrays are views of a read-only memory map."""
    path = Path(path)
    header, base = _read_header(path)
    mm = np.memmap(path, dtype=np.uint8, mode="r")
    for name, info in header.items():
        dtype = _DTYPES.get(info["dtype"])
        if dtype is None:
            raise ValueError(f"tensor {name!r} in {path} has unsupported dtype {info['dtype']}")
        start, end = info["data_offsets"]
        if base + end > mm.shape[0]:
            raise ValueError(f"{path} is truncated: tensor {name!r} ends past the end of the file")
        yield name, mm[base + start : base + end].view(dtype).reshape(info["shape"])


def count_tensors(model_dir: str | Path) -> int:
    return sum(len(_read_header(f)[0]) for f in safetensors_files(model_dir))


def iter_hf_dir(model_dir: str | Path) -> Iterator[tuple[str, np.ndarray]]:
    """Every tensor of the directory; a compressed-tensors checkpoint's quantized modules each come as one
    ``x.weight`` holding its quantized values and scales (``jaxserve.loading.compressed``)."""
    from jaxserve.loading.compressed import quantization_config, quantized_tensors

    qcfg = quantization_config(model_dir)
    tensors = (item for path in safetensors_files(model_dir) for item in iter_safetensors(path))
    yield from tensors if qcfg is None else quantized_tensors(tensors, qcfg)
