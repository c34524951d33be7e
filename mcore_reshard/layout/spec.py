"""Canonical model specs: the HF parameter names, shapes and dtype of a model.

The canonical namespace is HuggingFace's so that HF checkpoints, the HF-broadcast baseline
and vLLM's own loaders can all serve as oracles for a refit.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, replace
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping

from .descriptor import DTYPE_BYTES, LayoutError
from .families import family, family_of_config
from .families.deepseek_v3 import MLA
from .hybrid import Hybrid
from .vision import QwenVision, Vision

if TYPE_CHECKING:
    from .family import Family

__all__ = ["ModelSpec", "MLA", "CanonicalTensor", "ROUTER_BIAS_DTYPE", "load_model_spec", "spec_from_hf_config"]

#: Element type of the MoE router's ``e_score_correction_bias`` whatever the model dtype:
#: megatron-core keeps its ``expert_bias`` in fp32 under a bf16 ``Float16Module`` and vLLM
#: builds ``e_score_correction_bias`` in fp32. A plan in another wire dtype carries it as its
#: bits, reinterpreted (``TransferPlan.reinterpret``), never cast.
ROUTER_BIAS_DTYPE = "float32"

@dataclass(frozen=True, slots=True)
class CanonicalTensor:
    name: str
    shape: tuple[int, ...]
    dtype: str
    #: The HF checkpoint's shape where the plan addresses a finer view of the same storage.
    checkpoint: tuple[int, ...] | None = None


@dataclass(frozen=True)
class ModelSpec:
    """Architecture facts both layouts are derived from (no weights)."""

    arch: str  # the family's name (``layout.families.FAMILIES``): llama | qwen2 | qwen3 | qwen3_moe | deepseek_v3 | ...
    hidden: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    tied: bool = False
    qkv_bias: bool = False
    #: ``o_proj`` carries a bias (gpt-oss's ``attention_bias`` covers it; Llama's is refused).
    o_bias: bool = False
    qk_norm: bool = False
    num_experts: int = 0
    moe_intermediate: int = 0
    moe_topk: int = 0
    #: Global indices of the layers whose MLP is a routed MoE (empty for dense models).
    moe_layers: tuple[int, ...] = ()
    #: MLA attention (DeepSeek-V3 family); None: GQA ``q/k/v_proj``.
    mla: MLA | None = None
    #: Shared-expert MLP width of every MoE layer (``moe_intermediate_size * n_shared_experts``).
    shared_intermediate: int = 0
    #: MoE routers carry ``e_score_correction_bias`` (``topk_method == "noaux_tc"``), always
    #: described in fp32 (``ROUTER_BIAS_DTYPE``), as both libraries hold it.
    router_bias: bool = False
    #: Multi-token-prediction layers after the decoder (``num_nextn_predict_layers``): in the
    #: HF checkpoint as ``model.layers.{L+i}``, not described (no side below holds them).
    mtp_layers: int = 0
    #: Hybrid families (Nemotron-H, Qwen3-Next): each layer's mixer and the Mamba / GDN sizes
    #: (``layout.hybrid``); None: every layer is attention + MLP/MoE.
    hybrid: Hybrid | None = None
    #: Vision-language families (LLaVA): the vision tower and projector (``layout.vision``);
    #: the other fields describe the language model.
    vision: "Vision | QwenVision | None" = None
    dtype: str = "bfloat16"
    rope_theta: float = 1_000_000.0
    rms_eps: float = 1e-6
    name: str = ""
    hf_config: Mapping[str, Any] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.dtype not in DTYPE_BYTES:
            raise LayoutError(f"model dtype {self.dtype!r} is not one of {sorted(DTYPE_BYTES)}")
        if self.num_heads % self.num_kv_heads:
            raise LayoutError(
                f"num_attention_heads={self.num_heads} is not a multiple of "
                f"num_key_value_heads={self.num_kv_heads}"
            )
        if self.moe_layers and (self.num_experts <= 0 or self.moe_intermediate <= 0):
            raise LayoutError("MoE layers need num_experts > 0 and moe_intermediate_size > 0")
        if self.mla is not None and self.qkv_bias:
            raise LayoutError("MLA with attention_bias is not supported (no DeepSeek-V3 checkpoint has it)")

    @property
    def itemsize(self) -> int:
        return DTYPE_BYTES[self.dtype]

    def is_moe(self, layer: int) -> bool:
        return layer in self._moe_set

    @property
    def _moe_set(self) -> frozenset[int]:
        return frozenset(self.moe_layers)

    def with_dtype(self, dtype: str) -> "ModelSpec":
        return replace(self, dtype=dtype)

    @property
    def family(self) -> "Family":
        """The family table this spec is read by (``layout.families``)."""
        return family(self.arch)

    def layer_tensors(self, layer: int) -> list[CanonicalTensor]:
        """HF tensors of decoder layer ``layer``, in HF order (the family's rows)."""
        return list(_layer_tensors(self, layer))

    def tensors(self) -> dict[str, CanonicalTensor]:
        """All HF tensors of the model, keyed by name, in HF order (lm_head absent if tied)."""
        return dict(_tensors(self))

    def checkpoint_shapes(self) -> dict[str, tuple[int, ...]]:
        """The HF checkpoint's shape of every tensor the plan addresses in a finer shape of the
        same row-major storage (gpt-oss's interleaved gate/up): loaders reshape by it."""
        return {t.name: t.checkpoint for t in _tensors(self).values() if t.checkpoint is not None}

    def tensor_table(self) -> dict[str, tuple[tuple[int, ...], str]]:
        """name -> (global shape, dtype): the ``SideLayout.tensors`` form."""
        return {t.name: (t.shape, t.dtype) for t in self.tensors().values()}

    def tower_tensors(self) -> frozenset[str]:
        """A vision-language model's tensors its multimodal encoder computes with: the vision
        tower's and the projector's (an engine caches their output per image); empty for a
        text model."""
        return frozenset(_tower_tensors(self)) if self.family.tower is not None else frozenset()

    def frozen_tensors(self, vision_model: bool = False, vision_projection: bool = False) -> frozenset[str]:
        """The tensors a policy that freezes its vision tower (``vision_model``) or its projector
        (``vision_projection``) never changes (``LLaVAModel.freeze``'s parts): a refit moves them
        once. One line for a text model asked to freeze either."""
        if not (vision_model or vision_projection):
            return frozenset()
        tower = self.family.tower
        if tower is None:
            raise LayoutError(f"freeze_vision_model / freeze_vision_projection: {self.family.title} has no vision tower")
        projector = tuple(tower.projector)
        return frozenset(n for n in _tower_tensors(self) if (n.startswith(projector) and vision_projection)
                         or (not n.startswith(projector) and vision_model))

    def total_bytes(self) -> int:
        return sum(math.prod(t.shape) * DTYPE_BYTES[t.dtype] for t in self.tensors().values())


def spec_from_hf_config(cfg: Mapping[str, Any], *, dtype: str | None = None, name: str = "") -> ModelSpec:
    """Build a :class:`ModelSpec` from a transformers config (dict or ``PretrainedConfig``):
    the fields every family shares, then the family's own reader (``Family.read``)."""
    if hasattr(cfg, "to_dict"):
        cfg = cfg.to_dict()
    fam = family_of_config(cfg)
    top = cfg
    if fam.text_config is not None:  # a VLM: the language model's sizes are its text config's
        cfg = dict(cfg.get(fam.text_config) or {})
        if "hidden_size" not in cfg:
            raise LayoutError(f"{fam.title} config has no {fam.text_config}.hidden_size")
    H = int(cfg["hidden_size"])
    nH = int(cfg["num_attention_heads"])
    fields: dict[str, Any] = dict(
        hidden=H,
        num_layers=int(cfg["num_hidden_layers"]) if "num_hidden_layers" in cfg else None,
        num_heads=nH,
        num_kv_heads=int(cfg.get("num_key_value_heads") or nH),
        head_dim=int(cfg.get("head_dim") or H // nH),
        intermediate=int(cfg.get("intermediate_size", 0)),
        vocab=int(cfg["vocab_size"]),
        tied=bool(cfg.get("tie_word_embeddings", False)),
        qkv_bias=bool(cfg.get("attention_bias", False)),
        rope_theta=float(cfg.get("rope_theta") or (cfg.get("rope_parameters") or {}).get("rope_theta", 10000.0)),
        rms_eps=float(cfg.get("rms_norm_eps", 1e-6)),
    )
    fields.update(fam.read(top))  # a family may read its depth elsewhere (Nemotron-H: its layer pattern)
    if fields["num_layers"] is None:
        raise LayoutError(f"{fam.title} config has no num_hidden_layers")
    torch_dtype = dtype or str(top.get("torch_dtype") or top.get("dtype") or cfg.get("torch_dtype")
                               or cfg.get("dtype") or "bfloat16").replace("torch.", "")
    return ModelSpec(arch=fam.name, dtype=torch_dtype, name=name or str(top.get("_name_or_path", "")),
                     hf_config=dict(top), **fields)


def load_model_spec(path: str | Path, *, dtype: str | None = None) -> ModelSpec:
    """Load a spec from a HF ``config.json`` file, or a directory holding one."""
    p = Path(path)
    if p.is_dir():
        p = p / "config.json"
    if not p.is_file():
        raise LayoutError(f"model config file not found: {str(path)!r}")
    try:
        cfg = json.loads(p.read_text())
    except json.JSONDecodeError as exc:
        raise LayoutError(f"model config {str(p)!r} is not valid JSON: {exc}") from exc
    return spec_from_hf_config(cfg, dtype=dtype, name=p.parent.name if p.name == "config.json" else p.stem)


# ----------------------------------------------------------------------------- the family's rows


@lru_cache(maxsize=4096)
def _layer_tensors(spec: ModelSpec, layer: int) -> tuple[CanonicalTensor, ...]:
    fam = spec.family
    dims, flags = fam.dims(spec), fam.flags(spec)
    out: dict[str, CanonicalTensor] = {}
    p = fam.hf_layer.format(layer=layer)
    for _, block in fam.layer_blocks(spec, layer):
        experts = range(spec.num_experts) if block.experts and not block.stacked else (None,)
        for e in experts:
            for row in block.rows:
                if fam.present(row, flags):
                    _add(out, p + (row.hf if e is None else row.hf.format(e=e)), row, fam, dims, spec.dtype)
    return tuple(out.values())


@lru_cache(maxsize=16)
def _tensors(spec: ModelSpec) -> dict[str, CanonicalTensor]:
    fam = spec.family
    dims, flags = fam.dims(spec), fam.flags(spec)
    out: dict[str, CanonicalTensor] = {}
    if fam.tower is not None:
        out.update(_tower_tensors(spec))
    for row in fam.pre:
        if fam.present(row, flags):
            _add(out, row.hf, row, fam, dims, spec.dtype)
    for layer in range(spec.num_layers):
        for t in _layer_tensors(spec, layer):
            out[t.name] = t
    for row in fam.post:
        if fam.present(row, flags):
            _add(out, row.hf, row, fam, dims, spec.dtype)
    return out


def _tower_tensors(spec: ModelSpec) -> dict[str, CanonicalTensor]:
    """The vision tower's and projector's tensors (``Family.tower``), in the tower's sizes."""
    fam, tower = spec.family, spec.family.tower
    dims, flags = tower.dims(spec), tower.flags(spec)
    out: dict[str, CanonicalTensor] = {}
    for row in tower.pre:
        _add(out, row.hf, row, fam, dims, spec.dtype)
    for layer in range(tower.layers(spec)):
        for row in tower.layer:
            _add(out, tower.hf_layer.format(layer=layer) + row.hf, row, fam, dims, spec.dtype)
    for row in tower.post_rows(spec):
        if fam.present(row, flags):
            _add(out, row.hf, row, fam, dims, spec.dtype)
    return out


def _add(out: dict[str, CanonicalTensor], name: str, row: Any, fam: Any, dims: Mapping[str, int], dtype: str) -> None:
    """One row's canonical tensor (rows sharing a fused tensor name it once, alike)."""
    t = CanonicalTensor(name, fam.resolve(row.shape, dims), row.dtype or dtype,
                        None if row.checkpoint is None else fam.resolve(row.checkpoint, dims))
    prev = out.setdefault(name, t)
    if prev != t:
        raise LayoutError(f"family {fam.name}: rows name {name} twice with different shapes ({prev.shape}, {t.shape})")
