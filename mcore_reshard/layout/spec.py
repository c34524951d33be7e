"""Canonical model specs: the HF parameter names, shapes and dtype of a model.

The canonical namespace is HuggingFace's so that HF checkpoints, the HF-broadcast baseline
and vLLM's own loaders can all serve as oracles for a refit.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Mapping

from .descriptor import DTYPE_BYTES, LayoutError
from .hybrid import HYBRID_ARCHS, Hybrid, hybrid_from_config, hybrid_layer_tensors

__all__ = ["ModelSpec", "MLA", "CanonicalTensor", "ROUTER_BIAS_DTYPE", "load_model_spec", "spec_from_hf_config"]

#: Element type of the MoE router's ``e_score_correction_bias`` whatever the model dtype:
#: megatron-core keeps its ``expert_bias`` in fp32 under a bf16 ``Float16Module`` and vLLM
#: builds ``e_score_correction_bias`` in fp32. A plan in another wire dtype carries it as its
#: bits, reinterpreted (``TransferPlan.reinterpret``), never cast.
ROUTER_BIAS_DTYPE = "float32"

_SUPPORTED = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "DeepseekV3ForCausalLM": "deepseek_v3",
    **HYBRID_ARCHS,
}
#: ``model_type`` -> arch, for configs without ``architectures`` (Kimi-K2 names its type
#: ``kimi_k2`` but is a DeepseekV3ForCausalLM with other sizes).
_MODEL_TYPES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "qwen3_moe": "qwen3_moe",
                "deepseek_v3": "deepseek_v3", "kimi_k2": "deepseek_v3", "nemotron_h": "nemotron_h",
                "qwen3_next": "qwen3_next"}


@dataclass(frozen=True, slots=True)
class MLA:
    """Multi-head latent attention sizes (DeepSeek-V2/V3), in the HF config's names.

    ``q_lora_rank`` None: queries come from one ``q_proj`` instead of ``q_a_proj`` ->
    ``q_a_layernorm`` -> ``q_b_proj`` (Moonlight, DeepSeek-V2-Lite).
    """

    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim


@dataclass(frozen=True, slots=True)
class CanonicalTensor:
    name: str
    shape: tuple[int, ...]
    dtype: str


@dataclass(frozen=True)
class ModelSpec:
    """Architecture facts both layouts are derived from (no weights)."""

    arch: str  # llama | qwen2 | qwen3 | qwen3_moe | deepseek_v3
    hidden: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    tied: bool = False
    qkv_bias: bool = False
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
    #: Hybrid families (Nemotron-H, Qwen3-Next): each layer's mixers and their sizes
    #: (``layout.hybrid``); None: every layer is attention + MLP/MoE.
    hybrid: Hybrid | None = None
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

    def _mla_tensors(self, p: str) -> list[CanonicalTensor]:
        m, H, nH, dt = self.mla, self.hidden, self.num_heads, self.dtype
        assert m is not None
        a = p + "self_attn."
        if m.q_lora_rank is None:
            out = [CanonicalTensor(a + "q_proj.weight", (nH * m.qk_head_dim, H), dt)]
        else:
            out = [CanonicalTensor(a + "q_a_proj.weight", (m.q_lora_rank, H), dt),
                   CanonicalTensor(a + "q_a_layernorm.weight", (m.q_lora_rank,), dt),
                   CanonicalTensor(a + "q_b_proj.weight", (nH * m.qk_head_dim, m.q_lora_rank), dt)]
        return out + [
            CanonicalTensor(a + "kv_a_proj_with_mqa.weight", (m.kv_lora_rank + m.qk_rope_head_dim, H), dt),
            CanonicalTensor(a + "kv_a_layernorm.weight", (m.kv_lora_rank,), dt),
            CanonicalTensor(a + "kv_b_proj.weight", (nH * (m.qk_nope_head_dim + m.v_head_dim), m.kv_lora_rank), dt),
            CanonicalTensor(a + "o_proj.weight", (H, nH * m.v_head_dim), dt),
        ]

    def layer_tensors(self, layer: int) -> list[CanonicalTensor]:
        """HF tensors of decoder layer ``layer``, in HF order."""
        if self.hybrid is not None:
            return [CanonicalTensor(*t) for t in hybrid_layer_tensors(self, layer)]
        H, D, dt = self.hidden, self.head_dim, self.dtype
        p = f"model.layers.{layer}."
        out = [CanonicalTensor(p + "input_layernorm.weight", (H,), dt)]
        if self.mla is not None:
            out.extend(self._mla_tensors(p))
        for proj, rows in (() if self.mla else
                           (("q", self.num_heads * D), ("k", self.num_kv_heads * D), ("v", self.num_kv_heads * D))):
            out.append(CanonicalTensor(f"{p}self_attn.{proj}_proj.weight", (rows, H), dt))
            if self.qkv_bias:
                out.append(CanonicalTensor(f"{p}self_attn.{proj}_proj.bias", (rows,), dt))
        if self.mla is None:
            out.append(CanonicalTensor(p + "self_attn.o_proj.weight", (H, self.num_heads * D), dt))
        if self.qk_norm:
            out.append(CanonicalTensor(p + "self_attn.q_norm.weight", (D,), dt))
            out.append(CanonicalTensor(p + "self_attn.k_norm.weight", (D,), dt))
        out.append(CanonicalTensor(p + "post_attention_layernorm.weight", (H,), dt))
        if self.is_moe(layer):
            F = self.moe_intermediate
            out.append(CanonicalTensor(p + "mlp.gate.weight", (self.num_experts, H), dt))
            if self.router_bias:
                out.append(CanonicalTensor(p + "mlp.gate.e_score_correction_bias", (self.num_experts,),
                                           ROUTER_BIAS_DTYPE))
            for e in range(self.num_experts):
                q = f"{p}mlp.experts.{e}."
                out.append(CanonicalTensor(q + "gate_proj.weight", (F, H), dt))
                out.append(CanonicalTensor(q + "up_proj.weight", (F, H), dt))
                out.append(CanonicalTensor(q + "down_proj.weight", (H, F), dt))
            if self.shared_intermediate:
                S, q = self.shared_intermediate, p + "mlp.shared_experts."
                out.append(CanonicalTensor(q + "gate_proj.weight", (S, H), dt))
                out.append(CanonicalTensor(q + "up_proj.weight", (S, H), dt))
                out.append(CanonicalTensor(q + "down_proj.weight", (H, S), dt))
        else:
            F = self.intermediate
            out.append(CanonicalTensor(p + "mlp.gate_proj.weight", (F, H), dt))
            out.append(CanonicalTensor(p + "mlp.up_proj.weight", (F, H), dt))
            out.append(CanonicalTensor(p + "mlp.down_proj.weight", (H, F), dt))
        return out

    def tensors(self) -> dict[str, CanonicalTensor]:
        """All HF tensors of the model, keyed by name, in HF order (lm_head absent if tied)."""
        dt, h = self.dtype, self.hybrid
        items = [CanonicalTensor(h.embedding if h else "model.embed_tokens.weight", (self.vocab, self.hidden), dt)]
        for layer in range(self.num_layers):
            items.extend(self.layer_tensors(layer))
        items.append(CanonicalTensor(h.final_norm if h else "model.norm.weight", (self.hidden,), dt))
        if not self.tied:
            items.append(CanonicalTensor("lm_head.weight", (self.vocab, self.hidden), dt))
        return {t.name: t for t in items}

    def tensor_table(self) -> dict[str, tuple[tuple[int, ...], str]]:
        """name -> (global shape, dtype): the ``SideLayout.tensors`` form."""
        return {t.name: (t.shape, t.dtype) for t in self.tensors().values()}

    def total_bytes(self) -> int:
        return sum(math.prod(t.shape) * DTYPE_BYTES[t.dtype] for t in self.tensors().values())


def spec_from_hf_config(cfg: Mapping[str, Any], *, dtype: str | None = None, name: str = "") -> ModelSpec:
    """Build a :class:`ModelSpec` from a transformers config (dict or ``PretrainedConfig``)."""
    if hasattr(cfg, "to_dict"):
        cfg = cfg.to_dict()
    archs = cfg.get("architectures") or []
    arch = next((_SUPPORTED[a] for a in archs if a in _SUPPORTED), None)
    if arch is None:
        arch = _MODEL_TYPES.get(cfg.get("model_type", ""))
    if arch is None:
        raise LayoutError(
            f"unsupported architecture {archs or cfg.get('model_type')!r}; supported: {sorted(_SUPPORTED)}"
        )
    H = int(cfg["hidden_size"])
    nH = int(cfg["num_attention_heads"])
    nKV = int(cfg.get("num_key_value_heads") or nH)
    D = int(cfg.get("head_dim") or H // nH)
    if arch in HYBRID_ARCHS.values():
        return _hybrid_spec(arch, cfg, dtype, name, H, nH, nKV, D)
    L = int(cfg["num_hidden_layers"])
    moe_layers: tuple[int, ...] = ()
    E = F_moe = topk = 0
    if arch == "qwen3_moe":
        E = int(cfg.get("num_experts") or cfg.get("num_local_experts") or 0)  # transformers 5 renamed it
        F_moe = int(cfg["moe_intermediate_size"])
        topk = int(cfg.get("num_experts_per_tok", 0))
        step = int(cfg.get("decoder_sparse_step", 1) or 1)
        only = set(cfg.get("mlp_only_layers") or [])
        moe_layers = tuple(i for i in range(L) if i not in only and E > 0 and (i + 1) % step == 0)
    mla, shared, router_bias, mtp = None, 0, False, 0
    if arch == "deepseek_v3":
        mla = MLA(
            q_lora_rank=int(cfg["q_lora_rank"]) if cfg.get("q_lora_rank") else None,
            kv_lora_rank=int(cfg["kv_lora_rank"]),
            qk_nope_head_dim=int(cfg["qk_nope_head_dim"]),
            qk_rope_head_dim=int(cfg["qk_rope_head_dim"]),
            v_head_dim=int(cfg["v_head_dim"]),
        )
        nKV, D = nH, mla.qk_head_dim  # MLA has no KV heads; D only names the per-head q width
        E = int(cfg.get("n_routed_experts") or 0)
        F_moe = int(cfg.get("moe_intermediate_size") or 0)
        topk = int(cfg.get("num_experts_per_tok") or 0)
        # vLLM's DeepseekV2DecoderLayer rule (transformers 5 ignores moe_layer_freq; every
        # published config has 1, where the two agree).
        first, freq = int(cfg.get("first_k_dense_replace") or 0), int(cfg.get("moe_layer_freq") or 1)
        moe_layers = tuple(i for i in range(L) if E > 0 and i >= first and i % freq == 0)
        shared = F_moe * int(cfg.get("n_shared_experts") or 0)
        router_bias = cfg.get("topk_method") == "noaux_tc"
        mtp = int(cfg.get("num_nextn_predict_layers") or 0)
    torch_dtype = dtype or str(cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16").replace("torch.", "")
    return ModelSpec(
        arch=arch,
        hidden=H,
        num_layers=L,
        num_heads=nH,
        num_kv_heads=nKV,
        head_dim=D,
        intermediate=int(cfg.get("intermediate_size", 0)),
        vocab=int(cfg["vocab_size"]),
        tied=bool(cfg.get("tie_word_embeddings", False)),
        qkv_bias=True if arch == "qwen2" else bool(cfg.get("attention_bias", False)),
        qk_norm=arch in ("qwen3", "qwen3_moe"),
        num_experts=E,
        moe_intermediate=F_moe,
        moe_topk=topk,
        moe_layers=moe_layers,
        mla=mla,
        shared_intermediate=shared,
        router_bias=router_bias,
        mtp_layers=mtp,
        dtype=torch_dtype,
        rope_theta=float(cfg.get("rope_theta") or (cfg.get("rope_parameters") or {}).get("rope_theta", 10000.0)),
        rms_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        name=name or str(cfg.get("_name_or_path", "")),
        hf_config=dict(cfg),
    )


def _hybrid_spec(arch: str, cfg: Mapping[str, Any], dtype: str | None, name: str, H: int, nH: int, nKV: int,
                 D: int) -> ModelSpec:
    """A hybrid family's spec: its layers from ``layout.hybrid``, the rest as every spec."""
    hybrid, extra = hybrid_from_config(arch, cfg)
    torch_dtype = dtype or str(cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16").replace("torch.", "")
    rope = cfg.get("rope_theta") or (cfg.get("rope_parameters") or {}).get("rope_theta", 10000.0)
    return ModelSpec(arch=arch, hidden=H, num_heads=nH, num_kv_heads=nKV, head_dim=D,
                     intermediate=int(cfg.get("intermediate_size") or 0), vocab=int(cfg["vocab_size"]),
                     tied=bool(cfg.get("tie_word_embeddings", False)), hybrid=hybrid, dtype=torch_dtype,
                     rope_theta=float(rope), rms_eps=float(cfg.get("rms_norm_eps") or cfg.get("layer_norm_epsilon") or 1e-6),
                     name=name or str(cfg.get("_name_or_path", "")), hf_config=dict(cfg), **extra)


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
