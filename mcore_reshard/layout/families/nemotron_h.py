"""Nemotron-H (``NemotronHForCausalLM``: Nemotron-H-8B/47B/56B, Nemotron-Nano-9B-v2): one
mixer per layer -- Mamba2 (``M``), attention (``*``), a non-gated relu2 MLP (``-``) or a MoE
with non-gated experts, a shared expert and a sigmoid router with ``e_score_correction_bias``
(``E``) -- as ``hybrid_override_pattern`` / ``layers_block_type`` says, each layer's input
norm ``norm`` before it. HF keeps it under ``backbone.``; vLLM under ``model.``.

The Mamba2 rows (megatron-core 0.19.2 ``ssm/mamba_mixer.py``, vLLM 0.32
``layers/mamba/mamba_mixer2.py``): ``in_proj`` is ``[z | x | B | C | dt]`` in HF and, per TP
rank, ``[z_r | x_r | B_r | C_r | dt_r]`` on both sides (each part chunked on its own: five
``Col`` rows of one tensor, ``part`` each); ``conv1d`` likewise ``[x | B | C]`` (megatron's
``conv1d_weight`` / ``conv1d_bias`` parameters, vLLM's ``conv1d.weight`` ``[C, 1, k]``);
``A_log``, ``D``, ``dt_bias`` by head, the gated ``norm`` by channel, ``out_proj`` row-
parallel. vLLM replicates B and C on every rank when there is one group (``units``:
``mamba_v2_sharded_weight_loader``) and refuses other ``n_groups % tp``; megatron asserts
``n_groups % tp == 0``. vLLM stores ``A = -exp(A_log)`` under the name ``A`` (its loader
computes; the applier re-derives it in the layer's reload shadow, ``adapters/vllm/layers.py``),
in fp32 (megatron's bf16 policy holds ``A_log`` in bf16: its ranks widen it when sending).
"""

from __future__ import annotations

from typing import Any, Mapping

from ..descriptor import LayoutError
from ..family import QKV, Block, Col, Family, Rep, Row, RowPar, Vocab, standard_dims, standard_flags
from ..hybrid import A_LOG_DTYPE, Hybrid, Mamba

__all__ = ["NEMOTRON_H", "TINY_NEMOTRON_H", "DERIVED_NOTE"]

#: Mamba2 (8 heads of 16, 2 groups) + MLP + attention, servable by the vLLM CPU engine in fp32
#: (prompts under 64 tokens); ``infra.checkpoint`` adds a one-group and a MoE variant.
TINY_NEMOTRON_H: dict[str, Any] = dict(
    architectures=["NemotronHForCausalLM"], vocab_size=1000, hidden_size=64,
    layers_block_type=["mamba", "mlp", "attention", "mamba", "mlp"], num_attention_heads=4,
    num_key_value_heads=2, head_dim=32, intermediate_size=128, ssm_state_size=16, mamba_num_heads=8,
    mamba_head_dim=16, n_groups=2, conv_kernel=4, use_conv_bias=True, max_position_embeddings=512,
    tie_word_embeddings=False, n_routed_experts=4, moe_intermediate_size=32, moe_shared_expert_intermediate_size=48,
    num_experts_per_tok=2, n_shared_experts=1)

#: What the plan report says about the tensor vLLM computes from the checkpoint at load.
DERIVED_NOTE = ("Mamba mixer.A: vLLM derives A = -exp(A_log) in its weight loader; the refit writes A_log's bytes into "
                "the mixer's model-format shadow and re-runs that derivation (reload mode), with D and dt_bias")

_SYMBOLS = {"mamba": "M", "linear_attention": "M", "attention": "*", "full_attention": "*", "mlp": "-", "moe": "E"}


def _mamba_rows() -> tuple[Row, ...]:
    m = "mixer."
    ip, conv = (m + "in_proj.weight", ("MIN", "H")), ("MCONV", 1, "MK")
    rows = [Row("norm.weight", ("H",), megatron=Rep("norm.weight", te=Rep(m + "in_proj.layer_norm_weight")),
                vllm=Rep("norm.weight")),
            Row(m + "A_log", ("MH",), megatron=Col(m + "A_log", widened=True), vllm=Col(m + "A"),
                dtype=A_LOG_DTYPE),
            Row(m + "D", ("MH",), megatron=Col(m + "D"), vllm=Col(m + "D"))]
    for hf, shape, mega, when in ((m + "conv1d.weight", conv, m + "conv1d_weight", None),
                                  (m + "conv1d.bias", ("MCONV",), m + "conv1d_bias", "conv_bias")):
        for part, units in (((0, "MI"), None), (("MI", "MGS"), "MGROUPS"), (("MIGS", "MGS"), "MGROUPS")):
            rows.append(Row(hf, shape, megatron=Col(mega), vllm=Col(m + hf[len(m):], units=units), part=part, when=when))
    rows.append(Row(m + "dt_bias", ("MH",), megatron=Col(m + "dt_bias"), vllm=Col(m + "dt_bias")))
    for part, units in (((0, "MI"), None), (("MI", "MI"), None), (("MB", "MGS"), "MGROUPS"),
                        (("MC", "MGS"), "MGROUPS"), (("MDT", "MH"), None)):  # z, x, B, C, dt
        rows.append(Row(*ip, megatron=Col(ip[0]), vllm=Col(ip[0], units=units), part=part))
    rows += [Row(m + "norm.weight", ("MI",), megatron=Col(m + "norm.weight"), vllm=Col(m + "norm.weight")),
             Row(m + "out_proj.weight", ("H", "MI"), megatron=RowPar(m + "out_proj.weight"),
                 vllm=RowPar(m + "out_proj.weight"))]
    return tuple(rows)


def _attention_rows() -> tuple[Row, ...]:
    rows = [Row("norm.weight", ("H",), megatron=Rep("input_layernorm.weight",
                                                     te=Rep("self_attention.linear_qkv.layer_norm_weight")),
                vllm=Rep("norm.weight"))]
    for proj, size, units in (("q", "Q", None), ("k", "KV", "kv_heads"), ("v", "KV", "kv_heads")):
        rows.append(Row(f"mixer.{proj}_proj.weight", (size, "H"), megatron=QKV("self_attention.linear_qkv.weight"),
                        vllm=Col("mixer.qkv_proj.weight", units=units)))
    rows.append(Row("mixer.o_proj.weight", ("H", "Q"), megatron=RowPar("self_attention.linear_proj.weight"),
                    vllm=RowPar("mixer.o_proj.weight")))
    return tuple(rows)


def _mlp_rows() -> tuple[Row, ...]:
    """relu2, not gated: megatron's ``linear_fc1`` is ``up_proj`` alone."""
    return (Row("norm.weight", ("H",), megatron=Rep("pre_mlp_layernorm.weight", te=Rep("mlp.linear_fc1.layer_norm_weight")),
                vllm=Rep("norm.weight")),
            Row("mixer.up_proj.weight", ("F", "H"), megatron=Col("mlp.linear_fc1.weight"), vllm=Col("mixer.up_proj.weight")),
            Row("mixer.down_proj.weight", ("H", "F"), megatron=RowPar("mlp.linear_fc2.weight"),
                vllm=RowPar("mixer.down_proj.weight")))


def _moe_rows() -> tuple[Row, ...]:
    return (Row("norm.weight", ("H",), megatron=Rep("pre_mlp_layernorm.weight"), vllm=Rep("norm.weight")),
            Row("mixer.gate.weight", ("E", "H"), megatron=Rep("mlp.router.weight"), vllm=Rep("mixer.gate.weight")),
            Row("mixer.gate.e_score_correction_bias", ("E",), megatron=Rep("mlp.router.expert_bias"),
                vllm=Rep("mixer.gate.e_score_correction_bias"), dtype="float32", when="router_bias"))


def _expert_rows() -> tuple[Row, ...]:
    """Non-gated experts: FusedMoE's ``w13`` holds ``up_proj`` alone."""
    e = "mixer.experts.{e}."
    return (Row(e + "up_proj.weight", ("FE", "H"), megatron=Col("linear_fc1.weight"), vllm=Col("w13_weight")),
            Row(e + "down_proj.weight", ("H", "FE"), megatron=RowPar("linear_fc2.weight"), vllm=RowPar("w2_weight")))


def _shared_rows() -> tuple[Row, ...]:
    s = "mixer.shared_experts."
    return (Row(s + "up_proj.weight", ("S", "H"), megatron=Col("mlp.shared_experts.linear_fc1.weight"),
                vllm=Col(s + "up_proj.weight"), when="shared"),
            Row(s + "down_proj.weight", ("H", "S"), megatron=RowPar("mlp.shared_experts.linear_fc2.weight"),
                vllm=RowPar(s + "down_proj.weight"), when="shared"))


def _pattern(cfg: Mapping[str, Any]) -> str:
    pat = cfg.get("hybrid_override_pattern")
    if pat:
        return str(pat)
    try:
        return "".join(_SYMBOLS[t] for t in cfg.get("layers_block_type") or [])
    except KeyError as exc:
        raise LayoutError(f"nemotron_h: layers_block_type {exc.args[0]!r} is not one of {sorted(_SYMBOLS)}") from None


def _read(cfg: Mapping[str, Any]) -> dict[str, Any]:
    pat = _pattern(cfg)
    L = cfg.get("num_hidden_layers")
    if L is not None and len(pat) != int(L):
        raise LayoutError(f"nemotron_h: hybrid_override_pattern has {len(pat)} layers, num_hidden_layers={L}")
    bad = set(pat) - {"M", "*", "-", "E"}
    if bad or not pat:
        raise LayoutError(f"nemotron_h: layer symbols {sorted(bad)} in hybrid_override_pattern are not supported "
                          "(M mamba, * attention, - MLP, E MoE)")
    if isinstance(cfg.get("intermediate_size"), list):
        raise LayoutError("nemotron_h: a per-layer intermediate_size list (heterogeneous MLPs) is not supported")
    if cfg.get("moe_latent_size"):
        raise LayoutError("nemotron_h: latent MoE (moe_latent_size) is not supported: no megatron-core mapping")
    if cfg.get("mamba_proj_bias") or cfg.get("mlp_bias") or cfg.get("attention_bias"):
        raise LayoutError("nemotron_h: projection biases (mamba_proj_bias / mlp_bias / attention_bias) are not "
                          "supported: megatron-core's MambaMixer asserts bias=False")
    if cfg.get("num_nextn_predict_layers"):
        raise LayoutError("nemotron_h: MTP layers (num_nextn_predict_layers) are not described")
    mamba = Mamba(heads=int(cfg["mamba_num_heads"]), head_dim=int(cfg["mamba_head_dim"]), groups=int(cfg["n_groups"]),
                  state=int(cfg["ssm_state_size"]), conv_kernel=int(cfg.get("conv_kernel", 4)),
                  conv_bias=bool(cfg.get("use_conv_bias", True)))
    moe = tuple(i for i, s in enumerate(pat) if s == "E")
    out: dict[str, Any] = dict(num_layers=len(pat), hybrid=Hybrid(tuple(pat), mamba=mamba), qk_norm=False, qkv_bias=False,
                               moe_layers=moe, router_bias=bool(moe),
                               rms_eps=float(cfg.get("layer_norm_epsilon") or cfg.get("rms_norm_eps") or 1e-5))
    if cfg.get("attention_head_dim"):  # older configs' name of head_dim
        out["head_dim"] = int(cfg["attention_head_dim"])
    if moe:
        out.update(num_experts=int(cfg["n_routed_experts"]), moe_intermediate=int(cfg["moe_intermediate_size"]),
                   moe_topk=int(cfg.get("num_experts_per_tok") or 0),
                   shared_intermediate=int(cfg.get("moe_shared_expert_intermediate_size") or 0)
                   * int(cfg.get("n_shared_experts") or 0))
    return out


def _layers(spec: Any, layer: int) -> tuple[str, ...]:
    sym = spec.hybrid.mixers[layer]
    return {"M": ("mamba",), "*": ("attention",), "-": ("mlp",), "E": ("moe", "experts", "shared")}[sym]


def _dims(spec: Any) -> dict[str, int]:
    m: Mamba = spec.hybrid.mamba
    gs = m.groups * m.state
    return {**standard_dims(spec), "MI": m.d_inner, "MGS": gs, "MH": m.heads, "MGROUPS": m.groups, "MK": m.conv_kernel,
            "MIN": m.in_proj_rows, "MCONV": m.conv_dim, "MIGS": m.d_inner + gs, "MB": 2 * m.d_inner,
            "MC": 2 * m.d_inner + gs, "MDT": 2 * m.d_inner + 2 * gs}


def _flags(spec: Any) -> frozenset[str]:
    return standard_flags(spec) | ({"conv_bias"} if spec.hybrid.mamba.conv_bias else set())


def _check(spec: Any, library: str, tp: int) -> tuple[str, ...]:
    """megatron's ``MambaMixer`` splits heads and groups by TP; vLLM's ``MambaMixer2`` splits
    heads, and groups unless there is one (then every rank holds it)."""
    m: Mamba = spec.hybrid.mamba
    if "M" not in spec.hybrid.mixers:
        return ()
    lib = "megatron" if library == "megatron" else "vLLM"
    if m.heads % tp:
        raise LayoutError(f"nemotron_h: mixer.in_proj / A_log / D: mamba_num_heads={m.heads} is not divisible by {lib} "
                          f"tp={tp} (it splits Mamba heads); pick a tp that divides it")
    if m.heads % m.groups:
        raise LayoutError(f"nemotron_h: mamba_num_heads={m.heads} must be divisible by n_groups={m.groups}")
    if library == "megatron" and m.groups % tp:
        raise LayoutError(f"nemotron_h: mixer.in_proj B/C: n_groups={m.groups} must be divisible by megatron tp={tp} "
                          "(MambaMixer asserts ngroups % tp == 0; vLLM alone replicates a single group)")
    if library == "vllm" and m.groups % tp and m.groups != 1:
        raise LayoutError(f"nemotron_h: mixer.in_proj B/C: n_groups={m.groups} is neither divisible by vLLM tp={tp} "
                          "nor 1 (MambaMixer2 replicates only a single group); pick a tp that divides n_groups")
    if library != "vllm":
        return ()
    notes = [DERIVED_NOTE]
    if m.groups % tp:
        notes.append(f"Mamba n_groups={m.groups} < tp={tp}: every vLLM rank holds the whole group's B and C rows "
                     "(mamba_v2_sharded_weight_loader), sent to each")
    if spec.dtype != A_LOG_DTYPE:
        notes.append(f"A_log: float32 as vLLM holds it (megatron's {spec.dtype} copy widened by its ranks when "
                     f"sending, exact), carried as its bits in a {spec.dtype} plan")
    return tuple(notes)


def _megatron_config(spec: Any) -> dict[str, Any]:
    """``HybridModel``'s TransformerConfig fields (``adapters/megatron/hybrid_build.py``)."""
    m: Mamba = spec.hybrid.mamba
    out: dict[str, Any] = dict(gated_linear_unit=False, activation_func="relu2", mamba_state_dim=m.state,
                               mamba_head_dim=m.head_dim, mamba_num_groups=m.groups, mamba_num_heads=m.heads)
    if spec.moe_layers:
        out.update(moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True)
    return out


NEMOTRON_H = Family(
    name="nemotron_h", title="Nemotron-H", architectures=("NemotronHForCausalLM",), model_types=("nemotron_h",),
    read=_read,
    blocks={"mamba": Block(_mamba_rows(), symbol="M"), "attention": Block(_attention_rows(), symbol="*"),
            "mlp": Block(_mlp_rows(), symbol="-"), "moe": Block(_moe_rows(), symbol="E"),
            "experts": Block(_expert_rows(), experts=True, symbol="E"), "shared": Block(_shared_rows(), symbol="E")},
    layers=_layers,
    pre=(Row("backbone.embeddings.weight", ("V", "H"), megatron=Vocab("embedding.word_embeddings.weight"),
             vllm=Vocab("model.embed_tokens.weight")),),
    post=(Row("backbone.norm_f.weight", ("H",), megatron=Rep("decoder.final_norm.weight"), vllm=Rep("model.norm_f.weight")),
          Row("lm_head.weight", ("V", "H"), megatron=Vocab("output_layer.weight"), vllm=Vocab("lm_head.weight"),
              when="!tied")),
    dims=_dims, flags=_flags, vllm_top_on_every_stage=True, hf_layer="backbone.layers.{layer}.",
    vllm_experts="mixer.experts.routed_experts.", check=_check, megatron_config=_megatron_config,
    tiny=TINY_NEMOTRON_H,
)
