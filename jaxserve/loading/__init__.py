"""Model loading: one entry point for GGUF files, HF directories, orbax directories and presets."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from pathlib import Path

import numpy as np

from jaxserve.config import ModelConfig


@dataclasses.dataclass
class LoadedModel:
    name: str
    config: ModelConfig
    params: dict[str, np.ndarray]  # stacked host arrays, see jaxserve.loading.weights.param_shapes
    tokenizer_path: Path  # what jaxserve.tokenizer.load_tokenizer accepts


def resolve_model_path(model: str | Path | None) -> Path:
    """Turns ``None`` (the default model), a preset name or an HF hub id into a local path.

    Raises:
        FileNotFoundError: nothing local, and the hub could not be reached (this machine may be offline).
    """
    from jaxserve import configs
    from jaxserve.defaults import default_model_path

    if model is None:
        return default_model_path()
    path = Path(model).expanduser()
    if path.exists():
        return path
    name = str(model)
    hf_repo = name
    if name in configs.list_presets():
        preset = json.loads(configs.preset_path(name).read_text())
        if preset.get("default"):
            return default_model_path()
        hf_repo = preset["hf_repo"]
    elif name.count("/") != 1 or name.startswith((".", "/", "~")):
        raise FileNotFoundError(
            f"model {name!r} is not a file, a directory, a preset ({', '.join(configs.list_presets())}) "
            "or a Hugging Face repo id"
        )
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(hf_repo, allow_patterns=["*.json", "*.safetensors", "tokenizer*"]))
    except Exception as e:  # offline, unknown repo, gated repo ...
        raise FileNotFoundError(f"could not fetch {hf_repo!r} from the Hugging Face hub: {e}") from e


def load_model(
    model: str | Path | None = None,
    dtype: str = "float32",
    check_config: Callable[[ModelConfig], object] | None = None,
    shardings: Callable[[ModelConfig], dict] | None = None,
    keep_quantized: bool = False,
) -> LoadedModel:
    """Loads config + weights (as host arrays of ``dtype``) from any supported source.

    ``check_config`` sees the model's config before any weight is read (it raises to refuse the model).
    ``shardings`` (config -> {param name: Sharding}): the weights go straight onto the devices, each receiving
    its own part (orbax: each reads its shards from disk; GGUF and safetensors: tensor by tensor, so the host
    holds one tensor at a time), and come back as device arrays; without it, as host arrays.
    ``keep_quantized``: a GGUF file's Q8_0 / Q4_0 / Q4_1 / Q4_K / Q5_K / Q6_K matrices come as host
    ``jaxserve.quant.QArray``s of their own blocks (raises ValueError for other sources).
    """
    check = check_config or (lambda cfg: None)
    from jaxserve.loading import orbax_ckpt
    from jaxserve.loading.weights import params_from_hf_tensors

    path = resolve_model_path(model)
    if path.is_file():
        if path.suffix != ".gguf":
            raise ValueError(f"{path}: a model file must be a .gguf file")
        from jaxserve.loading.gguf import GGUFCheckpoint

        ckpt = GGUFCheckpoint(path)
        cfg = ckpt.model_config()
        check(cfg)
        params = params_from_hf_tensors(
            cfg,
            ckpt.iter_hf_tensors(progress=False, quantized=keep_quantized),
            dtype,
            total=len(ckpt.tensors),
            shardings=shardings and shardings(cfg),
            gguf=True,
        )
        return LoadedModel(path.stem, cfg, params, path)
    if keep_quantized:
        raise ValueError(
            f"quantization='gguf' serves a GGUF file's own quantized weights; {path} is not a GGUF "
            "file (quantize on load with 'int8' or 'int4' instead)"
        )
    if orbax_ckpt.is_orbax_dir(path):
        cfg, params, saved_dtype = orbax_ckpt.load(
            path, None if shardings is None else lambda cfg: (check(cfg), shardings(cfg))[1]
        )
        if shardings is None:
            check(cfg)
        if saved_dtype != dtype:
            from jaxserve.loading.weights import cast_params

            params = cast_params(params, dtype)
        tok = path / "tokenizer.gguf" if (path / "tokenizer.gguf").is_file() else path
        return LoadedModel(path.name, cfg, params, tok)
    if (path / "config.json").is_file():
        from jaxserve.loading.safetensors_dir import count_tensors, iter_hf_dir, read_config

        cfg = read_config(path)
        check(cfg)
        params = params_from_hf_tensors(
            cfg, iter_hf_dir(path), dtype, total=count_tensors(path), shardings=shardings and shardings(cfg)
        )
        return LoadedModel(path.name, cfg, params, path)
    raise FileNotFoundError(f"{path} is not a GGUF file, an HF model directory (config.json) or an orbax directory")


def convert(
    src: str | Path | None, dst: str | Path, dtype: str = "float32", quantization: str | None = None
) -> ModelConfig:
    """Writes an orbax checkpoint of a model (``jaxserve convert SRC DST``), which ``LLM(dst)`` restores shard by
    shard onto any mesh.

    Args:
        src: a GGUF file, HF directory, preset or hub id (as ``load_model``); None = the default model.
        dst: the directory to write (created; an existing checkpoint there is replaced): ``jaxserve.json``,
            ``params/`` and the tokenizer (an HF directory's files, or a tensor-free ``tokenizer.gguf``).
        dtype: the float weights' dtype on disk: "float32", "bfloat16" or "float16".
        quantization: None; "int8", "int4" or "w8a8" to store the weights quantized (``jaxserve.quant``); "gguf"
            to store a GGUF file's own quantized blocks. They are served quantized when loaded.

    Returns:
        The model's config.

    Raises:
        FileNotFoundError: ``src`` cannot be found.
        ValueError: an unsupported model, dtype or quantization ("gguf" from a source that is not a GGUF file).
    """
    if dtype not in ("float32", "bfloat16", "float16"):
        raise ValueError(f"dtype must be float32, bfloat16 or float16, got {dtype!r}")
    if quantization not in (None, "int8", "int4", "w8a8", "gguf"):
        raise ValueError(f"quantization must be None, int8, int4, w8a8 or gguf, got {quantization!r}")
    from jaxserve.loading import orbax_ckpt

    path = resolve_model_path(src)
    loaded = load_model(path, dtype, keep_quantized=quantization == "gguf")
    params = loaded.params
    if quantization not in (None, "gguf"):
        import jax

        from jaxserve import quant
        from jaxserve.models.schema import param_schema, quantizable_names

        quantizable = quantizable_names(param_schema(loaded.config))
        params = {
            name: jax.tree.map(np.asarray, quant.quantize_param(name, value, quantization))
            if name in quantizable
            else value
            for name, value in params.items()
        }
    orbax_ckpt.save(dst, loaded.config, params, dtype)
    orbax_ckpt.copy_tokenizer(path, Path(dst).resolve())
    return loaded.config
