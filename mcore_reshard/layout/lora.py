"""LoRA adapters as canonical tensors: the PEFT names both sides' adapter layouts are boxes of.

A LoRA policy trains, per targeted linear, ``A`` ``[r, in]`` and ``B`` ``[out, r]``; the layer
computes ``W x + (alpha / r) B A x``. The canonical form is the HF PEFT checkpoint's
(``model.layers.{i}.self_attn.q_proj.lora_A.weight``, without PEFT's ``base_model.model.``
prefix), which is what vLLM loads a ``LoRARequest`` from. Megatron targets its fused modules
(``linear_qkv``, ``linear_proj``, ``linear_fc1``, ``linear_fc2``, as Megatron-Bridge names them);
one fused module's adapter is the canonical adapters of the projections it fuses, with one ``A``
they share (Bridge exports that ``A`` under each of them) and ``B`` split as the base weight's
rows are.

Settings follow NeMo RL's ``policy.megatron_cfg.peft`` keys. Pure metadata: no torch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace
from typing import Iterable

from .descriptor import LayoutError, LocalParam, SideLayout
from .spec import ModelSpec

__all__ = ["PeftConfig", "MEGATRON_TARGETS", "HF_PROJECTIONS", "adapter_tensors", "lora_name", "VLLM_MAX_LORA_RANKS",
           "is_adapter_tensor", "adapters_only", "with_adapter", "expert_lora_name", "check_lora",
           "projection_io", "module_io"]

#: Megatron module -> the HF projections it fuses (in the fused order).
MEGATRON_TARGETS: dict[str, tuple[str, ...]] = {
    "linear_qkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "linear_proj": ("self_attn.o_proj",),
    "linear_fc1": ("mlp.gate_proj", "mlp.up_proj"),
    "linear_fc2": ("mlp.down_proj",),
}
#: Every HF projection a target may hold, by its short name (PEFT's ``target_modules``).
HF_PROJECTIONS = tuple(p.rsplit(".", 1)[1] for ps in MEGATRON_TARGETS.values() for p in ps)
#: ``max_lora_rank`` values vLLM accepts (``vllm.config.lora.LoRAConfig``).
VLLM_MAX_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
_INITS = ("xavier", "normal", "kaiming", "zero")


@dataclass(frozen=True)
class PeftConfig:
    """``policy.megatron_cfg.peft`` (NeMo RL's keys, Megatron-Bridge's LoRA) plus the engine's
    LoRA slots (ours: ``max_lora_rank``, ``max_loras``, ``slot``)."""

    enabled: bool = False
    #: Megatron modules to adapt (empty: all four ``MEGATRON_TARGETS``), minus ``exclude_modules``.
    target_modules: tuple[str, ...] = ()
    exclude_modules: tuple[str, ...] = ()
    dim: int = 8
    alpha: float = 32.0
    dropout: float = 0.0
    dropout_position: str = "post"
    lora_A_init_method: str = "xavier"
    lora_B_init_method: str = "zero"
    lora_dtype: str | None = None
    #: The engine's ``max_lora_rank`` (None: the smallest vLLM accepts that holds ``dim``).
    max_lora_rank: int | None = None
    #: The engine's ``max_loras``: slots per worker. 2 on CPU: vLLM 0.32's CPU LoRA ops read a
    #: request without an adapter (slot -1) from the last slot, which must stay empty.
    max_loras: int = 2
    #: The slot the policy's adapter lives in.
    slot: int = 0

    def __post_init__(self) -> None:
        def bad(key: str, value: object, why: str) -> LayoutError:
            return LayoutError(f"peft.{key}={value!r}: {why}")

        if self.dim < 1:
            raise bad("dim", self.dim, "must be >= 1")
        if not self.alpha > 0:
            raise bad("alpha", self.alpha, "must be > 0")
        for key in ("target_modules", "exclude_modules"):
            unknown = sorted(set(getattr(self, key)) - set(MEGATRON_TARGETS))
            if unknown:
                raise bad(key, list(getattr(self, key)), f"{unknown} not among {list(MEGATRON_TARGETS)}")
        if not self.modules:
            raise bad("exclude_modules", list(self.exclude_modules), "leaves no module to adapt")
        if self.dropout_position not in ("pre", "post"):
            raise bad("dropout_position", self.dropout_position, "must be 'pre' or 'post'")
        if not 0.0 <= self.dropout < 1.0:
            raise bad("dropout", self.dropout, "must be in [0, 1)")
        for key in ("lora_A_init_method", "lora_B_init_method"):
            if getattr(self, key) not in _INITS:
                raise bad(key, getattr(self, key), f"must be one of {list(_INITS)}")
        if self.max_lora_rank is not None and self.max_lora_rank not in VLLM_MAX_LORA_RANKS:
            raise bad("max_lora_rank", self.max_lora_rank, f"vLLM accepts {list(VLLM_MAX_LORA_RANKS)}")
        if self.engine_rank < self.dim:
            raise bad("dim", self.dim, f"the engine's max_lora_rank={self.engine_rank} cannot hold rank {self.dim}")
        if self.max_loras < 1 or not 0 <= self.slot < self.max_loras:
            raise bad("slot", self.slot, f"must be a slot of max_loras={self.max_loras}")

    @property
    def modules(self) -> tuple[str, ...]:
        """The Megatron modules adapted, in ``MEGATRON_TARGETS`` order."""
        chosen = self.target_modules or tuple(MEGATRON_TARGETS)
        return tuple(m for m in MEGATRON_TARGETS if m in chosen and m not in self.exclude_modules)

    @property
    def projections(self) -> tuple[str, ...]:
        """The HF projections adapted (``self_attn.q_proj``, ...)."""
        return tuple(p for m in self.modules for p in MEGATRON_TARGETS[m])

    @property
    def scaling(self) -> float:
        """``alpha / r``, what the adapter's output is multiplied by (vLLM folds it into B)."""
        return self.alpha / self.dim

    @property
    def engine_rank(self) -> int:
        """The engine's ``max_lora_rank``."""
        if self.max_lora_rank is not None:
            return self.max_lora_rank
        return next((r for r in VLLM_MAX_LORA_RANKS if r >= self.dim), self.dim)

    @property
    def lora_int_id(self) -> int:
        """The ``LoRARequest.lora_int_id`` of the engine's refit adapter (vLLM ids start at 1)."""
        return self.slot + 1

    def to_wire(self) -> dict:
        return {f.name: (list(v) if isinstance(v, tuple) else v) for f in fields(self) for v in (getattr(self, f.name),)}

    @staticmethod
    def from_wire(d: dict) -> "PeftConfig":
        known = {f.name for f in fields(PeftConfig)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise LayoutError(f"peft: unknown keys {unknown}")
        return PeftConfig(**{k: (tuple(v) if isinstance(v, list) else v) for k, v in d.items()})

    def peft_config_json(self) -> dict:
        """``adapter_config.json`` of the same adapter (what vLLM and PEFT read)."""
        return {"peft_type": "LORA", "r": self.dim, "lora_alpha": self.alpha, "lora_dropout": self.dropout,
                "target_modules": sorted({p.rsplit(".", 1)[1] for p in self.projections}), "bias": "none",
                "use_rslora": False, "use_dora": False, "task_type": "CAUSAL_LM"}


def lora_name(layer: int, projection: str, part: str) -> str:
    """Canonical name of one adapter matrix: ``part`` is ``lora_A`` or ``lora_B``."""
    return f"model.layers.{layer}.{projection}.{part}.weight"


def projection_io(spec: ModelSpec, projection: str, expert: bool = False) -> tuple[int, int]:
    """(in, out) features of an HF projection (``expert``: a routed expert's ``mlp.*_proj``)."""
    H, D = spec.hidden, spec.head_dim
    if expert:
        F = spec.moe_intermediate
        return (F, H) if projection == "mlp.down_proj" else (H, F)
    return {
        "self_attn.q_proj": (H, spec.num_heads * D),
        "self_attn.k_proj": (H, spec.num_kv_heads * D),
        "self_attn.v_proj": (H, spec.num_kv_heads * D),
        "self_attn.o_proj": (spec.num_heads * D, H),
        "mlp.gate_proj": (H, spec.intermediate),
        "mlp.up_proj": (H, spec.intermediate),
        "mlp.down_proj": (spec.intermediate, H),
    }[projection]


def module_io(spec: ModelSpec, module: str, expert: bool = False) -> tuple[int, int]:
    """(in, out) features of a Megatron module: the projections it fuses stack their outputs."""
    projs = MEGATRON_TARGETS[module]
    return projection_io(spec, projs[0], expert)[0], sum(projection_io(spec, p, expert)[1] for p in projs)


#: The families whose adapters the LoRA layouts describe (GQA attention, dense SwiGLU MLPs,
#: per-expert routed experts without biases).
LORA_FAMILIES = ("llama", "qwen2", "qwen3", "qwen3_moe")


def check_lora(spec: ModelSpec, peft: PeftConfig) -> None:
    """What the adapter layouts describe: GQA attention, dense MLPs and routed experts (without
    shared experts). One line otherwise."""
    if spec.mla is not None:
        raise LayoutError("peft: LoRA on MLA attention (DeepSeek-V3) is not described yet")
    if spec.arch not in LORA_FAMILIES:
        raise LayoutError(f"peft: LoRA on {spec.family.title} ({spec.arch}) is not described yet; the adapter "
                          f"layouts describe {list(LORA_FAMILIES)}")
    moe_mlp = [m for m in ("linear_fc1", "linear_fc2") if m in peft.modules]
    if spec.moe_layers and moe_mlp and spec.shared_intermediate:
        raise LayoutError(f"peft.target_modules: {moe_mlp} on a MoE model with shared experts: their adapters are "
                          f"not described yet; set peft.exclude_modules={moe_mlp}")


def expert_lora_name(layer: int, expert: int, projection: str, part: str) -> str:
    """Canonical name of one routed expert's adapter matrix (PEFT's, as vLLM loads it):
    ``model.layers.{i}.mlp.experts.{e}.gate_proj.lora_A.weight``."""
    return f"model.layers.{layer}.mlp.experts.{expert}.{projection}.{part}.weight"


def adapter_tensors(spec: ModelSpec, peft: PeftConfig) -> dict[str, tuple[tuple[int, ...], str]]:
    """Every canonical adapter matrix: name -> (shape, dtype), in layer then projection order.
    On a MoE layer ``linear_fc1`` / ``linear_fc2`` adapt every routed expert, each with its own
    A and B (Megatron-Bridge's adapters on each expert's linears)."""
    check_lora(spec, peft)
    dt = peft.lora_dtype or spec.dtype
    r = peft.dim
    out: dict[str, tuple[tuple[int, ...], str]] = {}
    for layer in range(spec.num_layers):
        for proj in peft.projections:
            if proj.startswith("mlp.") and spec.is_moe(layer):
                short = proj.removeprefix("mlp.")
                n_in, n_out = projection_io(spec, proj, expert=True)
                for e in range(spec.num_experts):
                    out[expert_lora_name(layer, e, short, "lora_A")] = ((r, n_in), dt)
                    out[expert_lora_name(layer, e, short, "lora_B")] = ((n_out, r), dt)
                continue
            n_in, n_out = projection_io(spec, proj)
            out[lora_name(layer, proj, "lora_A")] = ((r, n_in), dt)
            out[lora_name(layer, proj, "lora_B")] = ((n_out, r), dt)
    return out


def adapter_bytes(spec: ModelSpec, peft: PeftConfig) -> int:
    """Bytes of one copy of the adapter (every matrix once)."""
    from .descriptor import DTYPE_BYTES

    return sum(math.prod(shape) * DTYPE_BYTES[dt] for shape, dt in adapter_tensors(spec, peft).values())


def is_adapter_tensor(name: str) -> bool:
    """Whether a canonical name is an adapter matrix (``lora_name``)."""
    return name.endswith((".lora_A.weight", ".lora_B.weight"))


def adapters_only(side: SideLayout) -> SideLayout:
    """The local tensors of ``side`` that hold adapter matrices only: an adapter refit's side
    (every refit of a LoRA policy after the first moves nothing else)."""
    params = tuple(p for p in side.params if p.pieces and all(is_adapter_tensor(q.canonical) for q in p.pieces))
    tensors = {n: v for n, v in side.tensors.items() if is_adapter_tensor(n)}
    return replace(side, name=f"{side.name} (adapters)", params=params, tensors=tensors,
                   quantize=tuple(q for q in side.quantize if is_adapter_tensor(q[0])))


def with_adapter(side: SideLayout, adapter: Iterable[LocalParam], tensors: dict, scale: tuple = ()) -> SideLayout:
    """``side`` plus an adapter's local tensors: a LoRA policy's first refit, base and adapter."""
    return replace(side, params=side.params + tuple(adapter), tensors={**side.tensors, **tensors},
                   scale=side.scale + tuple(scale))
