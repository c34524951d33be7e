"""Qwen3-Next (``Qwen3NextForCausalLM``: Qwen3-Next-80B-A3B): each layer a token mixer --
a gated delta net (``linear_attention``) or a gated full attention (``full_attention``) --
then a MoE with a shared expert and its sigmoid gate (a dense MLP where ``mlp_only_layers``
say so). megatron-core's ``HybridModel`` builds each HF layer as two layers: the mixer
(``G`` or ``*``) then the FFN (``E`` or ``-``), hence the blocks' ``megatron_layer``.

The GDN rows (megatron-core 0.19.2 ``ssm/gated_delta_net/gdn.py``, vLLM 0.32
``models/qwen3_next.py``): HF's ``in_proj_qkvz`` holds per key head ``[q_g; k_g; v_g; z_g]``
and ``in_proj_ba`` ``[b_g; a_g]``; vLLM keeps both as they are (each rank a block of whole
key-head groups); megatron's one ``in_proj`` holds, per rank, ``[q_r | k_r | v_r | z_r | b_r
| a_r]`` -- its key heads' q parts, then their k parts ... (``Col(parts=...)`` over the key
heads). ``conv1d`` is ``[q | k | v]`` on both sides, each part chunked; ``A_log`` (fp32 in
vLLM) and ``dt_bias`` by value head; the gated ``norm`` (one head's width) replicated.
Gated attention: HF's ``q_proj`` holds per head ``[q_h; gate_h]``; megatron's ``linear_qkv``
per KV group ``[q (its heads) | gate (its heads) | k | v]`` (``QKV(parts=...)``); vLLM's
``qkv_proj`` takes the rank's heads of ``q_proj`` as they are.
"""

from __future__ import annotations

from typing import Any, Mapping

from ..descriptor import LayoutError
from ..family import QKV, Block, Col, Family, Rep, Row, RowPar, Vocab, standard_dims
from ..hybrid import A_LOG_DTYPE, GDN, Hybrid
from .common import dense_mlp, embedding, moe_router, routed_experts

__all__ = ["QWEN3_NEXT", "TINY_QWEN3_NEXT"]

#: GDN (2 key heads, 4 value heads, dims 64: the CPU GDN kernel needs 64 or 128) + gated
#: attention + MoE with a shared expert, and one dense layer; the vLLM CPU engine serves it in
#: bf16 only.
TINY_QWEN3_NEXT: dict[str, Any] = dict(
    architectures=["Qwen3NextForCausalLM"], vocab_size=1000, hidden_size=64, num_hidden_layers=4,
    layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
    num_attention_heads=4, num_key_value_heads=2, head_dim=64, linear_num_key_heads=2, linear_num_value_heads=4,
    linear_key_head_dim=64, linear_value_head_dim=64, linear_conv_kernel_dim=4, intermediate_size=128,
    moe_intermediate_size=32, shared_expert_intermediate_size=48, num_experts=4, num_experts_per_tok=2,
    decoder_sparse_step=1, mlp_only_layers=[3], max_position_embeddings=512, tie_word_embeddings=False,
    norm_topk_prob=True)

_SA = "self_attention."


def _gdn_rows() -> tuple[Row, ...]:
    a = "linear_attn."
    conv = (a + "conv1d.weight", ("GCONV", 1, "GK"))
    rows = [Row("input_layernorm.weight", ("H",), megatron=Rep("input_layernorm.weight",
                                                               te=Rep(_SA + "in_proj.layer_norm_weight")),
                vllm=Rep("input_layernorm.weight")),
            Row(a + "A_log", ("VH",), megatron=Col(_SA + "A_log", widened=True), vllm=Col(a + "A_log"),
                dtype=A_LOG_DTYPE)]
    rows += [Row(*conv, megatron=Col(_SA + "conv1d.weight"), vllm=Col(conv[0]), part=part)
             for part in ((0, "GQK"), ("GQK", "GQK"), ("GQK2", "GVV"))]  # q, k, v
    rows += [Row(a + "dt_bias", ("VH",), megatron=Col(_SA + "dt_bias"), vllm=Col(a + "dt_bias")),
             # megatron's in_proj: the rank's key heads' q parts, k parts, v parts, z parts, then b and a
             Row(a + "in_proj_qkvz.weight", ("QKVZ", "H"),
                 megatron=Col(_SA + "in_proj.weight", units="KH", parts=((0, "KD"), ("KD", "KD"), ("KD2", "RV"),
                                                                          ("KD2RV", "RV"))),
                 vllm=Col(a + "in_proj_qkvz.weight")),
             Row(a + "in_proj_ba.weight", ("BA", "H"), megatron=Col(_SA + "in_proj.weight", units="KH",
                                                                    parts=((0, "R"), ("R", "R"))),
                 vllm=Col(a + "in_proj_ba.weight")),
             Row(a + "norm.weight", ("VD",), megatron=Rep(_SA + "out_norm.weight"), vllm=Rep(a + "norm.weight")),
             Row(a + "out_proj.weight", ("H", "GVV"), megatron=RowPar(_SA + "out_proj.weight"),
                 vllm=RowPar(a + "out_proj.weight"))]
    return tuple(rows)


def _gated_attention_rows() -> tuple[Row, ...]:
    a, qkv = "self_attn.", _SA + "linear_qkv.weight"
    return (Row("input_layernorm.weight", ("H",), megatron=Rep("input_layernorm.weight", te=Rep(_SA + "linear_qkv.layer_norm_weight")),
                vllm=Rep("input_layernorm.weight")),
            Row(a + "q_proj.weight", ("Q2", "H"), megatron=QKV(qkv, units="heads", parts=((0, "D"), ("D", "D"))),
                vllm=Col(a + "qkv_proj.weight")),
            Row(a + "k_proj.weight", ("KV", "H"), megatron=QKV(qkv), vllm=Col(a + "qkv_proj.weight", units="kv_heads")),
            Row(a + "v_proj.weight", ("KV", "H"), megatron=QKV(qkv), vllm=Col(a + "qkv_proj.weight", units="kv_heads")),
            Row(a + "o_proj.weight", ("H", "Q"), megatron=RowPar(_SA + "linear_proj.weight"), vllm=RowPar(a + "o_proj.weight")),
            Row(a + "q_norm.weight", ("D",), megatron=Rep(_SA + "q_layernorm.weight"), vllm=Rep(a + "q_norm.weight")),
            Row(a + "k_norm.weight", ("D",), megatron=Rep(_SA + "k_layernorm.weight"), vllm=Rep(a + "k_norm.weight")))


def _shared_rows() -> tuple[Row, ...]:
    """One shared expert (HF ``shared_expert``, megatron ``shared_experts``) and its gate."""
    s, ms = "mlp.shared_expert.", "mlp.shared_experts."
    return (Row(s + "gate_proj.weight", ("S", "H"), megatron=Col(ms + "linear_fc1.weight"), vllm=Col(s + "gate_up_proj.weight")),
            Row(s + "up_proj.weight", ("S", "H"), megatron=Col(ms + "linear_fc1.weight"), vllm=Col(s + "gate_up_proj.weight")),
            Row(s + "down_proj.weight", ("H", "S"), megatron=RowPar(ms + "linear_fc2.weight"), vllm=RowPar(s + "down_proj.weight")),
            Row("mlp.shared_expert_gate.weight", (1, "H"), megatron=Rep(ms + "gate_weight"),
                vllm=Rep("mlp.shared_expert_gate.weight")))


def _read(cfg: Mapping[str, Any]) -> dict[str, Any]:
    L = int(cfg["num_hidden_layers"])
    types = list(cfg.get("layer_types") or [])
    if not types:
        interval = int(cfg.get("full_attention_interval", 4))
        types = ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(L)]
    if len(types) != L:
        raise LayoutError(f"qwen3_next: layer_types has {len(types)} layers, num_hidden_layers={L}")
    bad = set(types) - {"linear_attention", "full_attention"}
    if bad:
        raise LayoutError(f"qwen3_next: layer_types {sorted(bad)} are not supported (linear_attention, full_attention)")
    gdn = GDN(k_heads=int(cfg["linear_num_key_heads"]), v_heads=int(cfg["linear_num_value_heads"]),
              k_dim=int(cfg["linear_key_head_dim"]), v_dim=int(cfg["linear_value_head_dim"]),
              conv_kernel=int(cfg.get("linear_conv_kernel_dim", 4)))
    if gdn.v_heads % gdn.k_heads:
        raise LayoutError(f"qwen3_next: linear_num_value_heads={gdn.v_heads} must be a multiple of "
                          f"linear_num_key_heads={gdn.k_heads}")
    E = int(cfg.get("num_experts") or 0)
    step = int(cfg.get("decoder_sparse_step", 1) or 1)
    only = set(cfg.get("mlp_only_layers") or [])
    return dict(hybrid=Hybrid(tuple("G" if t == "linear_attention" else "*" for t in types), gdn=gdn),
                qk_norm=True, qkv_bias=False, num_experts=E, moe_intermediate=int(cfg.get("moe_intermediate_size") or 0),
                moe_topk=int(cfg.get("num_experts_per_tok") or 0),
                moe_layers=tuple(i for i in range(L) if i not in only and E > 0 and (i + 1) % step == 0),
                shared_intermediate=int(cfg.get("shared_expert_intermediate_size") or 0) if E else 0)


def _layers(spec: Any, layer: int) -> tuple[str, ...]:
    mixer = "gdn" if spec.hybrid.mixers[layer] == "G" else "attention"
    return (mixer, "moe", "experts", "shared") if spec.is_moe(layer) else (mixer, "mlp")


def _dims(spec: Any) -> dict[str, int]:
    g: GDN = spec.hybrid.gdn
    qk = g.k_heads * g.k_dim
    return {**standard_dims(spec), "KH": g.k_heads, "VH": g.v_heads, "KD": g.k_dim, "VD": g.v_dim, "R": g.ratio,
            "KD2": 2 * g.k_dim, "RV": g.ratio * g.v_dim, "KD2RV": 2 * g.k_dim + g.ratio * g.v_dim,
            "QKVZ": g.k_heads * g.group_rows, "BA": 2 * g.v_heads, "GK": g.conv_kernel, "GCONV": g.conv_dim,
            "GQK": qk, "GQK2": 2 * qk, "GVV": g.v_heads * g.v_dim, "Q2": 2 * spec.num_heads * spec.head_dim}


def _check(spec: Any, library: str, tp: int) -> tuple[str, ...]:
    """Both libraries split GDN key and value heads by TP. (Fewer KV heads than TP ranks is
    fine on both sides: megatron chunks its gated ``linear_qkv`` inside a KV group's
    ``[q | gate | k | v]`` block, as for plain GQA; vLLM replicates the KV heads.)"""
    g: GDN = spec.hybrid.gdn
    for what, n in (("linear_num_key_heads", g.k_heads), ("linear_num_value_heads", g.v_heads)):
        if "G" in spec.hybrid.mixers and n % tp:
            if library == "megatron":
                raise LayoutError(f"qwen3_next: linear_attn.in_proj_qkvz: {what}={n} must be divisible by megatron "
                                  f"tp={tp} (GatedDeltaNet splits heads by TP)")
            raise LayoutError(f"qwen3_next: linear_attn.in_proj_qkvz: {what}={n} is not divisible by vLLM tp={tp}; "
                              "pick a tp that divides it")
    if library == "vllm" and spec.dtype != A_LOG_DTYPE:
        return (f"A_log: float32 as vLLM holds GDN's (megatron's {spec.dtype} copy widened by its ranks when sending, "
                f"exact), carried as its bits in a {spec.dtype} plan",)
    return ()


def _megatron_config(spec: Any) -> dict[str, Any]:
    """``HybridModel``'s TransformerConfig fields (``adapters/megatron/hybrid_build.py``)."""
    g: GDN = spec.hybrid.gdn
    return dict(linear_conv_kernel_dim=g.conv_kernel, linear_key_head_dim=g.k_dim, linear_value_head_dim=g.v_dim,
                linear_num_key_heads=g.k_heads, linear_num_value_heads=g.v_heads, attention_output_gate=True,
                moe_shared_expert_gate=bool(spec.moe_layers))


def _mixer(rows: tuple[Row, ...], symbol: str) -> Block:
    return Block(rows, symbol=symbol)


def _ffn(rows: tuple[Row, ...], symbol: str, experts: bool = False) -> Block:
    return Block(rows, experts=experts, symbol=symbol, megatron_layer=1)


QWEN3_NEXT = Family(
    name="qwen3_next", title="Qwen3-Next", architectures=("Qwen3NextForCausalLM",), model_types=("qwen3_next",),
    read=_read,
    blocks={"gdn": _mixer(_gdn_rows(), "G"), "attention": _mixer(_gated_attention_rows(), "*"),
            "mlp": _ffn(dense_mlp(), "-"), "moe": _ffn(moe_router(), "E"), "experts": _ffn(routed_experts(), "E", True),
            "shared": _ffn(_shared_rows(), "E")},
    layers=_layers, pre=embedding(),
    # HybridStack names its final norm ``final_norm`` (GPTModel's: ``final_layernorm``)
    post=(Row("model.norm.weight", ("H",), megatron=Rep("decoder.final_norm.weight"), vllm=Rep("model.norm.weight")),
          Row("lm_head.weight", ("V", "H"), megatron=Vocab("output_layer.weight"), vllm=Vocab("lm_head.weight"),
              when="!tied")),
    dims=_dims, check=_check, megatron_config=_megatron_config,
    vllm_every_stage=("model.embed_tokens.weight", "lm_head.weight"), tiny=TINY_QWEN3_NEXT,
)
