"""orbax checkpoints: ``jaxserve convert SRC DST`` writes one; ``LLM(model=DST)`` restores it.

Layout of DST: ``jaxserve.json`` (our ModelConfig and the dtype), ``params/`` (orbax StandardCheckpointer
pytree of the stacked parameters), and the tokenizer files (copied from an HF directory, or, for a GGUF
source, a tensor-free ``tokenizer.gguf`` carrying the vocabulary and chat template metadata).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Callable

import jax
import numpy as np

from jaxserve.config import ModelConfig

MARKER = "jaxserve.json"
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "special_tokens_map.json",
                    "generation_config.json", "chat_template.jinja")


def is_orbax_dir(path: Path) -> bool:
    return path.is_dir() and (path / MARKER).is_file()


def save(dst: str | Path, cfg: ModelConfig, params: dict[str, np.ndarray], dtype: str) -> None:
    import orbax.checkpoint as ocp

    dst = Path(dst).resolve()
    dst.mkdir(parents=True, exist_ok=True)
    ckpt = ocp.StandardCheckpointer()
    ckpt.save(dst / "params", params, force=True)  # host arrays, or sharded device arrays (each shard written once)
    ckpt.wait_until_finished()
    (dst / MARKER).write_text(json.dumps({"model": cfg.to_dict(), "dtype": dtype}, indent=1))


def copy_tokenizer(src: Path, dst: Path) -> None:
    """Puts a tokenizer for ``src`` (GGUF file or HF directory) into the orbax directory ``dst``."""
    if src.is_dir():
        for name in _TOKENIZER_FILES:
            if (src / name).is_file():
                shutil.copy2(src / name, dst / name)
        return
    import gguf

    reader = gguf.GGUFReader(str(src))
    writer = gguf.GGUFWriter(str(dst / "tokenizer.gguf"), arch=str(reader.fields["general.architecture"].contents()))
    for name, field in reader.fields.items():
        if not name.startswith("tokenizer."):
            continue
        value = field.contents()
        vtype = field.types[0]
        sub_type = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(name, value, vtype, sub_type=sub_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def load(path: str | Path, shardings: Callable[[ModelConfig], dict] | None = None) -> tuple[ModelConfig, dict, str]:
    """Restores (config, params, dtype name) from an orbax directory.

    Without ``shardings`` the params are host numpy arrays. With it (config -> {name: Sharding}), each device
    reads only its own shard from disk, onto any mesh shape (whatever mesh the checkpoint was written from).
    """
    import orbax.checkpoint as ocp

    path = Path(path).resolve()
    meta = json.loads((path / MARKER).read_text())
    cfg = ModelConfig.from_dict(meta["model"])
    ckpt = ocp.StandardCheckpointer()
    if shardings is None:
        params = ckpt.restore(path / "params")
        return cfg, {k: np.asarray(v) for k, v in params.items()}, meta["dtype"]
    stored = ckpt.metadata(path / "params")
    stored = getattr(stored, "item_metadata", stored)  # orbax >= 0.11 wraps the tree
    placement = shardings(cfg)
    target = {name: jax.ShapeDtypeStruct(tuple(m.shape), m.dtype, sharding=placement[name])
              for name, m in stored.items()}
    return cfg, ckpt.restore(path / "params", target), meta["dtype"]
