"""The model families mcore-reshard describes, one table each (``layout.family``).

Adding a family: write its module here (a :class:`~mcore_reshard.layout.family.Family`) and
list it in :data:`FAMILIES`; ``docs/families.md`` walks through one.
"""

from __future__ import annotations

from typing import Any, Mapping

from ..descriptor import LayoutError
from ..family import Family
from .deepseek_v3 import DEEPSEEK_V3
from .dense import LLAMA, QWEN2, QWEN3
from .glm4_moe import GLM4_MOE
from .gpt_oss import GPT_OSS
from .llava import LLAVA
from .qwen2_5_vl import QWEN2_5_VL
from .qwen3_vl import QWEN3_VL_MOE
from .nemotron_h import NEMOTRON_H
from .qwen3_moe import QWEN3_MOE
from .qwen3_next import QWEN3_NEXT

__all__ = ["FAMILIES", "family", "family_of_config", "supported_architectures"]

#: Every family by name (``ModelSpec.arch``).
FAMILIES: dict[str, Family] = {f.name: f for f in (LLAMA, QWEN2, QWEN3, QWEN3_MOE, DEEPSEEK_V3, GPT_OSS, GLM4_MOE,
                                                   NEMOTRON_H, QWEN3_NEXT, LLAVA, QWEN2_5_VL, QWEN3_VL_MOE)}


def family(name: str) -> Family:
    """The family called ``name`` (a spec's ``arch``), or one line saying which exist."""
    found = FAMILIES.get(name)
    if found is None:
        raise LayoutError(f"unknown model family {name!r}: mcore-reshard describes {sorted(FAMILIES)}; "
                          f"a new family is one table under mcore_reshard/layout/families/ (docs/families.md)")
    return found


def supported_architectures() -> list[str]:
    return sorted(a for f in FAMILIES.values() for a in f.architectures)


def family_of_config(cfg: Mapping[str, Any]) -> Family:
    """The family of an HF config: by ``architectures``, else by ``model_type``."""
    archs = list(cfg.get("architectures") or [])
    for f in FAMILIES.values():
        if any(a in f.architectures for a in archs):
            return f
    mtype = cfg.get("model_type", "")
    for f in FAMILIES.values():
        if mtype in f.model_types:
            return f
    raise LayoutError(
        f"unsupported model family {archs or mtype!r}: mcore-reshard describes {supported_architectures()}; "
        f"a new family is one table under mcore_reshard/layout/families/ (docs/families.md)")
