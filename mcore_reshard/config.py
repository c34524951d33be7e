"""Hydra configs of the CLI: compose ``configs/<command>.yaml`` with command-line overrides
and turn the result into the typed objects the library takes."""

from __future__ import annotations

import os
from dataclasses import fields
from pathlib import Path
from typing import Any, Sequence

from .layout import LayoutError, ModelSpec, load_model_spec

__all__ = ["CONFIG_DIR", "compose", "resolve_model", "build_dataclass"]

#: Top-level ``configs/`` of the repository (override with MCORE_RESHARD_CONFIG_DIR).
CONFIG_DIR = Path(os.environ.get("MCORE_RESHARD_CONFIG_DIR", Path(__file__).resolve().parents[1] / "configs"))


def compose(config_name: str, overrides: Sequence[str] = ()) -> Any:
    """Hydra compose (struct mode: an unknown key is an error, not a silent no-op)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from omegaconf import OmegaConf

    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base=None):
        cfg = hydra_compose(config_name=config_name, overrides=list(overrides))
    OmegaConf.set_struct(cfg, True)
    return cfg


def resolve_model(ref: str, dtype: str | None = None) -> ModelSpec:
    """A model name under ``configs/models/`` or a path to a HF config (file or directory)."""
    candidate = CONFIG_DIR / "models" / f"{ref}.json"
    path = candidate if candidate.is_file() else Path(ref)
    if not path.exists():
        known = sorted(p.stem for p in (CONFIG_DIR / "models").glob("*.json"))
        raise LayoutError(f"model {ref!r} is neither a file nor one of {known}")
    return load_model_spec(path, dtype=dtype)


def build_dataclass(cls: type, section: Any, what: str) -> Any:
    """``cls(**section)``, with unknown keys named in the error."""
    from omegaconf import OmegaConf

    data = OmegaConf.to_container(section, resolve=True) if not isinstance(section, dict) else dict(section)
    names = {f.name for f in fields(cls)}
    unknown = sorted(set(data) - names)
    if unknown:
        raise LayoutError(f"{what}: unknown setting(s) {unknown}; known: {sorted(names)}")
    return cls(**data)
