"""orbax checkpoints: ``jaxserve convert SRC DST`` writes one; ``LLM(model=DST)`` restores it.

Layout of DST: ``jaxserve.json`` (our ModelConfig and the dtype), ``params/`` (orbax StandardCheckpointer
pytree of the stacked parameters), and the tokenizer files (copied from an HF directory, or, for a GGUF
source, a tensor-free ``tokenizer.gguf`` carrying the vocabulary and chat template metadata).
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from collections.abc import Callable
from pathlib import Path

import jax
import numpy as np

from jaxserve.config import ModelConfig

MARKER = "jaxserve.json"
_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "special_tokens_map.json",
    "generation_config.json",
    "chat_template.jinja",
    "tokenizer.gguf",  # a directory whose tokenizer came from a GGUF file (an orbax checkpoint converted again)
)


def is_orbax_dir(path: Path) -> bool:
    return path.is_dir() and (path / MARKER).is_file()


def _static(q) -> dict:
    return {f.name: getattr(q, f.name) for f in dataclasses.fields(q) if f.metadata.get("static")}


def save(dst: str | Path, cfg: ModelConfig, params: dict[str, np.ndarray], dtype: str) -> None:
    """Writes ``params`` (host arrays, or sharded device arrays: each shard written once). A quantized parameter
    (``jaxserve.quant.QArray``) is stored as its arrays, its format in ``jaxserve.json``, and comes back as it
    went."""
    import orbax.checkpoint as ocp

    from jaxserve.quant import is_quantized

    dst = Path(dst).resolve()
    dst.mkdir(parents=True, exist_ok=True)
    tree, quantized = {}, {}
    for name, value in params.items():
        if is_quantized(value):
            tree[name] = {
                f.name: getattr(value, f.name)
                for f in dataclasses.fields(value)
                if not f.metadata.get("static") and getattr(value, f.name) is not None
            }
            quantized[name] = _static(value)
        else:
            tree[name] = value
    ckpt = ocp.StandardCheckpointer()
    ckpt.save(dst / "params", tree, force=True)
    ckpt.wait_until_finished()
    meta = {"model": cfg.to_dict(), "dtype": dtype} | ({"quantized": quantized} if quantized else {})
    (dst / MARKER).write_text(json.dumps(meta, indent=1))


def _rebuild(params: dict, quantized: dict) -> dict:
    from jaxserve.quant import QArray

    return {
        name: QArray(**{"zero": None} | value, **quantized[name]) if name in quantized else value  # zero: optional
        for name, value in params.items()
    }


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
    quantized = meta.get("quantized", {})
    ckpt = ocp.StandardCheckpointer()
    if shardings is None:
        params = jax.tree.map(np.asarray, ckpt.restore(path / "params"))
        return cfg, _rebuild(params, quantized), meta["dtype"]
    stored = ckpt.metadata(path / "params")
    stored = getattr(stored, "item_metadata", stored)  # orbax >= 0.11 wraps the tree
    placement = shardings(cfg)
    from jaxserve.parallel.sharding import fit_sharding

    def abstract(m, sharding):
        return jax.ShapeDtypeStruct(tuple(m.shape), m.dtype, sharding=fit_sharding(sharding, tuple(m.shape)))

    target = {
        name: jax.tree.map(lambda m, s=placement[name]: abstract(m, s), value, is_leaf=lambda m: hasattr(m, "shape"))
        for name, value in stored.items()
    }
    return cfg, _rebuild(ckpt.restore(path / "params", target), quantized), meta["dtype"]
