"""Which model a setting names: a name under ``configs/models/``, a HF config path, a local
HF checkpoint directory, or one of the built-in tiny models the local jobs write at run time."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Sequence

from ..infra.checkpoint import tiny_config
from ..errors import ConfigError
from ..layout import DTYPE_BYTES, LayoutError, ModelSpec, load_model_spec, spec_from_hf_config
from ..layout.families import FAMILIES
from ..wire.protocol import one_line
from .reader import check_type

__all__ = ["CONFIG_DIR", "TINY_MODELS", "LOCAL_DTYPES", "check_dtype", "resolve_model", "load_spec", "tiny_spec",
           "is_checkpoint_dir", "megatron_build_problem"]

#: Top-level ``configs/`` of the repository (override with MCORE_RESHARD_CONFIG_DIR).
CONFIG_DIR = Path(os.environ.get("MCORE_RESHARD_CONFIG_DIR", Path(__file__).resolve().parents[2] / "configs"))

#: Built-in random-weight models of the local jobs -> their family in ``mcore_reshard.infra.checkpoint``
#: (written by the job at run time; settings only build their spec, from the same config dict):
#: the names below, then ``tiny-<family>`` for every other family's table (``tiny-gpt-oss``,
#: ``tiny-glm4-moe``, ...).
TINY_MODELS: dict[str, str] = {"tiny-moe": "qwen3_moe", "tiny-dense": "qwen3", "tiny-llama": "llama",
                               "tiny-qwen2": "qwen2", "tiny-deepseek-v3": "deepseek_v3",
                               "tiny-deepseek-v3-mtp": "deepseek_v3_mtp",
                               "tiny-dense-128": "qwen3_128", "tiny-moe-128": "qwen3_moe_128"}
TINY_MODELS.update({"tiny-" + name.replace("_", "-"): name for name in FAMILIES if name not in TINY_MODELS.values()})
#: Dtypes the local CPU job can train and serve in.
LOCAL_DTYPES = ("float32", "bfloat16")  # what the CPU training stack builds (TrainSettings)


def check_dtype(dtype: Any, key: str = "dtype", allowed: Sequence[str] | None = None) -> str:
    """``dtype`` as one of ``allowed`` (default: every dtype the layouts know)."""
    allowed = sorted(DTYPE_BYTES) if allowed is None else list(allowed)
    dtype = check_type(key, dtype, str)
    if dtype not in allowed:
        raise ConfigError(f"{key}={dtype!r} is not one of {allowed}")
    return dtype


def resolve_model(ref: str, dtype: str | None = None, *, what: str = "model") -> ModelSpec:
    """A model name under ``configs/models/`` or a path to a HF config (file or directory)."""
    if not isinstance(ref, str) or not ref:
        raise ConfigError(f"{what}={ref!r} is not a model name or a path")
    if dtype is not None:
        check_dtype(dtype)
    candidate = CONFIG_DIR / "models" / f"{ref}.json"
    path = candidate if candidate.is_file() else Path(ref)
    if not path.exists():
        known = sorted(p.stem for p in (CONFIG_DIR / "models").glob("*.json"))
        raise ConfigError(f"{what}={ref!r} is neither a file nor one of {known}")
    return load_spec(path, dtype, what, ref)


def load_spec(path: Path, dtype: str | None, what: str, ref: str) -> ModelSpec:
    """The spec of the HF config at ``path``; a config it cannot read is named as ``what=ref``."""
    try:
        return load_model_spec(path, dtype=dtype)
    except KeyError as exc:
        raise ConfigError(f"{what}={ref!r}: the HF config has no {exc.args[0]!r}") from None
    except (LayoutError, OSError, UnicodeDecodeError, ValueError, TypeError, AttributeError) as exc:
        raise ConfigError(f"{what}={ref!r}: {one_line(exc)}") from None


def tiny_spec(model: str, dtype: str) -> ModelSpec:
    """The spec of a built-in tiny model from its config dict: no file is written."""
    return spec_from_hf_config(tiny_config(TINY_MODELS[model]), dtype=dtype, name=model)


def megatron_build_problem(spec: ModelSpec) -> str | None:
    """Why the local job's megatron-core build cannot build ``spec``'s family as configured
    (its table's ``megatron_config`` refuses: gpt-oss's YaRN RoPE, DeepSeek-V3's grouped
    routing, ...), or None -- known before any process starts (the table is pure data)."""
    fam = spec.family
    if fam.megatron_config is None:
        return None
    try:
        fam.megatron_config(spec)
    except (LayoutError, ValueError) as exc:
        return one_line(exc)
    return None


def is_checkpoint_dir(path: str | Path) -> bool:
    """A HF checkpoint directory the local job can load: config.json + *.safetensors."""
    p = Path(path)
    return (p / "config.json").is_file() and any(p.glob("*.safetensors"))
