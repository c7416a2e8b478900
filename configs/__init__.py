"""Model presets: plain JSON data that ``jaxserve.config.ModelConfig.from_dict`` loads and validates."""

from __future__ import annotations

from pathlib import Path

_DIR = Path(__file__).resolve().parent


def list_presets() -> list[str]:
    return sorted(p.stem for p in _DIR.glob("*.json"))


def preset_path(name: str) -> Path:
    path = _DIR / f"{name}.json"
    if not path.is_file():
        raise ValueError(f"unknown preset {name!r}; known presets: {', '.join(list_presets())}")
    return path
