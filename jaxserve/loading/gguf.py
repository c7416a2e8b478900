"""GGUF files: metadata, tensors, dequantization."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np


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
