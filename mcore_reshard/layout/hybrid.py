"""Hybrid families: Nemotron-H (Mamba2 + attention + MLP/MoE) and Qwen3-Next (gated delta net +
gated attention + MoE with a shared expert), as canonical HF tensors.

A hybrid's decoder layers are not all alike, so its spec carries, per HF layer, which mixer it
has (``mixers``: ``M`` Mamba2, ``G`` GDN, ``*`` attention, ``-`` MLP, ``E`` MoE: megatron-core's
``hybrid_layer_allocation.Symbols``) and the sizes of the mixers it uses (:class:`Mamba`,
:class:`GDN`). Nemotron-H has one mixer per HF layer (``hybrid_override_pattern`` is the
megatron pattern, layer for layer); a Qwen3-Next HF layer is two megatron layers, its token
mixer (``G`` or ``*``) then its FFN (``E`` or ``-``). :func:`megatron_pattern` says which.

Metadata only (no torch): the names and shapes are those of the checkpoints transformers 5
writes (``NemotronHForCausalLM``: ``backbone.*``; ``Qwen3NextForCausalLM``: ``model.*``), which
``tests/test_hybrid_layouts.py`` checks against transformers' own model on the meta device.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from .descriptor import LayoutError

__all__ = ["Mamba", "GDN", "Hybrid", "HYBRID_ARCHS", "hybrid_from_config", "hybrid_layer_tensors",
           "megatron_pattern", "megatron_layer_role", "FFN_ONLY", "A_LOG_DTYPE"]

#: HF architecture -> family name (``ModelSpec.arch``).
HYBRID_ARCHS = {"NemotronHForCausalLM": "nemotron_h", "Qwen3NextForCausalLM": "qwen3_next"}

#: The mixers an FFN-only reshard (NeMo RL's ``nccl_reshard``) moves shard to shard; every
#: other tensor goes by broadcast there (docs/families.md#hybrid-families).
FFN_ONLY = ("-", "E")

_T = tuple[str, tuple[int, ...], str]  # (name, shape, dtype)


@dataclass(frozen=True, slots=True)
class Mamba:
    """Mamba2 mixer sizes (HF ``NemotronHConfig`` names in comments)."""

    heads: int  # mamba_num_heads
    head_dim: int  # mamba_head_dim
    groups: int  # n_groups
    state: int  # ssm_state_size
    conv_kernel: int  # conv_kernel
    conv_bias: bool = True  # use_conv_bias

    @property
    def d_inner(self) -> int:
        return self.heads * self.head_dim

    @property
    def conv_dim(self) -> int:
        """``conv1d`` channels ``[x | B | C]``."""
        return self.d_inner + 2 * self.groups * self.state

    @property
    def in_proj_rows(self) -> int:
        """``in_proj`` rows ``[z | x | B | C | dt]``."""
        return 2 * self.d_inner + 2 * self.groups * self.state + self.heads


@dataclass(frozen=True, slots=True)
class GDN:
    """Gated-delta-net sizes (HF ``Qwen3NextConfig`` ``linear_*`` names)."""

    k_heads: int
    v_heads: int
    k_dim: int
    v_dim: int
    conv_kernel: int

    @property
    def ratio(self) -> int:
        """Value heads per key head: each key head's group in ``in_proj_qkvz`` holds this many."""
        return self.v_heads // self.k_heads

    @property
    def group_rows(self) -> int:
        """Rows of one key-head group in HF's ``in_proj_qkvz``: ``[q_g; k_g; v_g; z_g]``."""
        return 2 * self.k_dim + 2 * self.ratio * self.v_dim

    @property
    def conv_dim(self) -> int:
        """``conv1d`` channels ``[q (all heads); k; v]``."""
        return 2 * self.k_heads * self.k_dim + self.v_heads * self.v_dim


@dataclass(frozen=True, slots=True)
class Hybrid:
    """What makes a spec a hybrid: the family, each HF layer's mixers, the mixer sizes."""

    family: str  # nemotron_h | qwen3_next
    #: Per HF layer: Nemotron-H one symbol; Qwen3-Next the token mixer (``G`` or ``*``).
    mixers: tuple[str, ...]
    mamba: Mamba | None = None
    gdn: GDN | None = None
    #: Non-gated MLPs and experts (Nemotron-H: relu2, ``up_proj``/``down_proj`` only).
    plain_mlp: bool = False
    #: Attention with an output gate (Qwen3-Next: ``q_proj`` holds ``[q_h; gate_h]`` per head).
    attn_gate: bool = False
    #: The MoE's shared expert has a sigmoid gate (``mlp.shared_expert_gate``).
    shared_gate: bool = False

    @property
    def prefix(self) -> str:
        return "backbone." if self.family == "nemotron_h" else "model."

    def layer_prefix(self, layer: int) -> str:
        return f"{self.prefix}layers.{layer}."

    @property
    def embedding(self) -> str:
        return "backbone.embeddings.weight" if self.family == "nemotron_h" else "model.embed_tokens.weight"

    @property
    def final_norm(self) -> str:
        return "backbone.norm_f.weight" if self.family == "nemotron_h" else "model.norm.weight"


def _pattern(cfg: Mapping[str, Any]) -> str:
    pat = cfg.get("hybrid_override_pattern")
    if pat:
        return str(pat)
    kinds = {"mamba": "M", "linear_attention": "M", "attention": "*", "full_attention": "*", "mlp": "-", "moe": "E"}
    types = cfg.get("layers_block_type") or []
    try:
        return "".join(kinds[t] for t in types)
    except KeyError as exc:
        raise LayoutError(f"nemotron_h: layers_block_type {exc.args[0]!r} is not one of {sorted(kinds)}") from None


def hybrid_from_config(arch: str, cfg: Mapping[str, Any]) -> tuple[Hybrid, dict[str, Any]]:
    """The :class:`Hybrid` of a HF config, and the ``ModelSpec`` fields it implies (MoE
    layers and sizes, shared expert, router bias), or one line naming what is not supported."""
    L = int(cfg["num_hidden_layers"]) if "num_hidden_layers" in cfg else None
    if arch == "nemotron_h":
        pat = _pattern(cfg)
        if L is not None and len(pat) != L:
            raise LayoutError(f"nemotron_h: hybrid_override_pattern has {len(pat)} layers, num_hidden_layers={L}")
        bad = set(pat) - {"M", "*", "-", "E"}
        if bad:
            raise LayoutError(f"nemotron_h: layer symbols {sorted(bad)} in hybrid_override_pattern are not supported "
                              "(M mamba, * attention, - MLP, E MoE)")
        if isinstance(cfg.get("intermediate_size"), list):
            raise LayoutError("nemotron_h: a per-layer intermediate_size list (heterogeneous MLPs) is not supported")
        if cfg.get("moe_latent_size"):
            raise LayoutError("nemotron_h: latent MoE (moe_latent_size) is not supported: no megatron-core mapping")
        mamba = Mamba(heads=int(cfg["mamba_num_heads"]), head_dim=int(cfg["mamba_head_dim"]),
                      groups=int(cfg["n_groups"]), state=int(cfg["ssm_state_size"]),
                      conv_kernel=int(cfg.get("conv_kernel", 4)), conv_bias=bool(cfg.get("use_conv_bias", True)))
        if cfg.get("mamba_proj_bias") or cfg.get("mlp_bias") or cfg.get("attention_bias"):
            raise LayoutError("nemotron_h: projection biases (mamba_proj_bias / mlp_bias / attention_bias) are not "
                              "supported: megatron-core's MambaMixer asserts bias=False")
        moe = tuple(i for i, s in enumerate(pat) if s == "E")
        E = int(cfg.get("n_routed_experts") or 0) if moe else 0
        extra = dict(num_layers=len(pat), moe_layers=moe, num_experts=E,
                     moe_intermediate=int(cfg.get("moe_intermediate_size") or 0) if moe else 0,
                     moe_topk=int(cfg.get("num_experts_per_tok") or 0) if moe else 0,
                     shared_intermediate=(int(cfg.get("moe_shared_expert_intermediate_size") or 0)
                                          * int(cfg.get("n_shared_experts") or 0)) if moe else 0,
                     router_bias=bool(moe), qk_norm=False, qkv_bias=False)
        return Hybrid("nemotron_h", tuple(pat), mamba=mamba, plain_mlp=True), extra
    if arch == "qwen3_next":
        types = list(cfg.get("layer_types") or [])
        if not types:
            interval = int(cfg.get("full_attention_interval", 4))
            types = ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(L or 0)]
        if L is not None and len(types) != L:
            raise LayoutError(f"qwen3_next: layer_types has {len(types)} layers, num_hidden_layers={L}")
        gdn = GDN(k_heads=int(cfg["linear_num_key_heads"]), v_heads=int(cfg["linear_num_value_heads"]),
                  k_dim=int(cfg["linear_key_head_dim"]), v_dim=int(cfg["linear_value_head_dim"]),
                  conv_kernel=int(cfg.get("linear_conv_kernel_dim", 4)))
        if gdn.v_heads % gdn.k_heads:
            raise LayoutError(f"qwen3_next: linear_num_value_heads={gdn.v_heads} must be a multiple of "
                              f"linear_num_key_heads={gdn.k_heads}")
        E = int(cfg.get("num_experts") or 0)
        step = int(cfg.get("decoder_sparse_step", 1) or 1)
        only = set(cfg.get("mlp_only_layers") or [])
        n = len(types)
        moe = tuple(i for i in range(n) if i not in only and E > 0 and (i + 1) % step == 0)
        mixers = tuple("G" if t == "linear_attention" else "*" for t in types)
        extra = dict(num_layers=n, moe_layers=moe, num_experts=E, moe_intermediate=int(cfg.get("moe_intermediate_size") or 0),
                     moe_topk=int(cfg.get("num_experts_per_tok") or 0),
                     shared_intermediate=int(cfg.get("shared_expert_intermediate_size") or 0),
                     router_bias=False, qk_norm=True, qkv_bias=False)
        return Hybrid("qwen3_next", mixers, gdn=gdn, attn_gate=True, shared_gate=True), extra
    raise LayoutError(f"{arch!r} is not a hybrid family")


def megatron_pattern(spec: Any) -> str:
    """megatron-core's ``hybrid_layer_pattern`` for ``spec`` (no ``|``: stages come from the
    parallel sizes). Nemotron-H: its own pattern; Qwen3-Next: mixer then FFN per HF layer."""
    h: Hybrid = spec.hybrid
    if h.family == "nemotron_h":
        return "".join(h.mixers)
    return "".join(m + ("E" if spec.is_moe(i) else "-") for i, m in enumerate(h.mixers))


def megatron_layer_role(spec: Any, j: int) -> tuple[int, str]:
    """Megatron layer ``j`` of the pattern -> (HF layer, symbol)."""
    h: Hybrid = spec.hybrid
    if h.family == "nemotron_h":
        return j, h.mixers[j]
    i = j // 2
    return i, (h.mixers[i] if j % 2 == 0 else ("E" if spec.is_moe(i) else "-"))


#: ``A_log``'s element type whatever the model dtype: vLLM keeps it in fp32 (Mamba's derived
#: ``A``, GDN's raw ``A_log``) and megatron-core's ``MambaMixer`` keeps it in fp32 ("Keep A_log
#: in fp32"); a plan in another wire dtype carries it as its bits, as the router bias.
A_LOG_DTYPE = "float32"


def _mamba(p: str, m: Mamba, H: int, dt: str) -> list[_T]:
    out = [(p + "A_log", (m.heads,), A_LOG_DTYPE), (p + "D", (m.heads,), dt),
           (p + "conv1d.weight", (m.conv_dim, 1, m.conv_kernel), dt)]
    if m.conv_bias:
        out.append((p + "conv1d.bias", (m.conv_dim,), dt))
    out += [(p + "dt_bias", (m.heads,), dt), (p + "in_proj.weight", (m.in_proj_rows, H), dt),
            (p + "norm.weight", (m.d_inner,), dt), (p + "out_proj.weight", (H, m.d_inner), dt)]
    return out


def _gdn(p: str, g: GDN, H: int, dt: str) -> list[_T]:
    return [(p + "A_log", (g.v_heads,), A_LOG_DTYPE), (p + "conv1d.weight", (g.conv_dim, 1, g.conv_kernel), dt),
            (p + "dt_bias", (g.v_heads,), dt), (p + "in_proj_ba.weight", (2 * g.v_heads, H), dt),
            (p + "in_proj_qkvz.weight", (g.k_heads * g.group_rows, H), dt), (p + "norm.weight", (g.v_dim,), dt),
            (p + "out_proj.weight", (H, g.v_heads * g.v_dim), dt)]


def _attention(p: str, spec: Any, gate: bool, dt: str) -> list[_T]:
    H, D, nH, nKV = spec.hidden, spec.head_dim, spec.num_heads, spec.num_kv_heads
    out = [(p + "q_proj.weight", (nH * D * (2 if gate else 1), H), dt), (p + "k_proj.weight", (nKV * D, H), dt),
           (p + "v_proj.weight", (nKV * D, H), dt), (p + "o_proj.weight", (H, nH * D), dt)]
    if spec.qk_norm:
        out += [(p + "q_norm.weight", (D,), dt), (p + "k_norm.weight", (D,), dt)]
    return out


def _mlp(p: str, F: int, H: int, plain: bool, dt: str) -> list[_T]:
    gate = [] if plain else [(p + "gate_proj.weight", (F, H), dt)]
    return gate + [(p + "up_proj.weight", (F, H), dt), (p + "down_proj.weight", (H, F), dt)]


def _moe(p: str, spec: Any, h: Hybrid, dt: str) -> list[_T]:
    H, E, F, S = spec.hidden, spec.num_experts, spec.moe_intermediate, spec.shared_intermediate
    out = [(p + "gate.weight", (E, H), dt)]
    if spec.router_bias:
        out.append((p + "gate.e_score_correction_bias", (E,), "float32"))  # spec.ROUTER_BIAS_DTYPE
    for e in range(E):
        out += _mlp(f"{p}experts.{e}.", F, H, h.plain_mlp, dt)
    if S:
        out += _mlp(p + ("shared_experts." if h.family == "nemotron_h" else "shared_expert."), S, H, h.plain_mlp, dt)
    if h.shared_gate:
        out.append((p + "shared_expert_gate.weight", (1, H), dt))
    return out


def hybrid_layer_tensors(spec: Any, layer: int) -> list[_T]:
    """HF tensors of decoder layer ``layer`` of a hybrid ``spec``."""
    h: Hybrid = spec.hybrid
    H, dt, p = spec.hidden, spec.dtype, h.layer_prefix(layer)
    sym = h.mixers[layer]
    if h.family == "nemotron_h":
        out = [(p + "norm.weight", (H,), dt)]
        m = p + "mixer."
        if sym == "M":
            assert h.mamba is not None
            return out + _mamba(m, h.mamba, H, dt)
        if sym == "*":
            return out + _attention(m, spec, False, dt)
        if sym == "-":
            return out + _mlp(m, spec.intermediate, H, True, dt)
        return out + _moe(m, spec, h, dt)
    out = [(p + "input_layernorm.weight", (H,), dt)]
    if sym == "G":
        assert h.gdn is not None
        out += _gdn(p + "linear_attn.", h.gdn, H, dt)
    else:
        out += _attention(p + "self_attn.", spec, h.attn_gate, dt)
    out.append((p + "post_attention_layernorm.weight", (H,), dt))
    if spec.is_moe(layer):
        out += _moe(p + "mlp.", spec, h, dt)
    else:
        out += _mlp(p + "mlp.", spec.intermediate, H, False, dt)
    return out
