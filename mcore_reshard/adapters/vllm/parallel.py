"""The parallel sizes of a vLLM engine and the shard dimensions vLLM derives from them.

``VllmParallel`` is what a user sets (tp, pp, dp, replicas, EP, EPLB); ``check_dims`` derives,
as vLLM's config classes do (``QKVParallelLinear``, ``VocabParallelEmbedding``,
``FusedMoEParallelConfig``, ``get_pp_indices``), every size a worker's shards have, and refuses
what vLLM would refuse, with vLLM's reason. ``rules.py`` lays the shards out from these sizes.

No vllm or torch import: plans for full-size models are computed from metadata alone.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

from ...layout import LayoutError, ModelSpec
from ...layout.quant import BlockFp8

__all__ = ["QUANTIZATIONS", "VOCAB_PAD", "Dims", "VllmParallel", "check_dims", "expert_slots", "pad_vocab",
           "pp_layer_bounds"]

#: ``vocab_parallel_embedding.DEFAULT_VOCAB_PADDING_SIZE``.
VOCAB_PAD = 64

#: vLLM ``quantization`` values the rules describe (``VllmParallel.quantization``).
QUANTIZATIONS = (None, "fp8_per_block")

@dataclass(frozen=True)
class VllmParallel:
    """Inference-side sizes. Rank order: ((replica*dp + dp_r)*pp + pp_r)*tp + tp_r.

    ``replicas`` are independent engines (each a full dp*pp*tp group, what RL frameworks run);
    ``dp`` is vLLM's own ``data_parallel_size`` inside one engine (attention replicated per DP
    rank, MoE sharded across dp*tp).
    """

    tp: int = 1
    pp: int = 1
    dp: int = 1
    replicas: int = 1
    enable_ep: bool = False
    num_redundant_experts: int = 0
    expert_placement: str = "linear"  # "linear" | "round_robin"
    #: Current EPLB physical->logical expert map per MoE layer (global layer index -> tuple of
    #: logical ids, one per physical slot). None: the initial map [0..E-1] + [i % E for i < R].
    physical_to_logical: tuple[tuple[int, tuple[int, ...]], ...] | None = None
    #: VLLM_PP_LAYER_PARTITION equivalent; None: vLLM's default split.
    pp_partition: tuple[int, ...] | None = None
    #: vLLM's ``quantization``, one of ``QUANTIZATIONS``: None (the model dtype) or
    #: ``fp8_per_block`` (online block FP8:
    #: linears and experts held as FP8 codes + fp32 block scales, the router kept in the model
    #: dtype, ``layout.quant``); a refit into it quantizes at the sender.
    quantization: str | None = None
    #: vLLM's ``mm_encoder_tp_mode``: "weights" shards a vision tower over TP like the language
    #: model; "data" keeps it whole on every rank (models with ``supports_encoder_tp_data``:
    #: Qwen2.5-VL, Qwen3-VL; LLaVA's tower is sharded by weights whatever the mode).
    mm_encoder_tp_mode: str = "weights"

    @property
    def world_size(self) -> int:
        return self.replicas * self.dp * self.pp * self.tp

    @property
    def fp8(self) -> BlockFp8 | None:
        """What the engine holds in block FP8 (None: nothing)."""
        if self.quantization is None:
            return None
        if self.quantization not in QUANTIZATIONS:
            raise LayoutError(f"vllm.quantization={self.quantization!r} is not one of {list(QUANTIZATIONS)} "
                              f"(block FP8 quantized at the sender)")
        return BlockFp8()


def pad_vocab(vocab: int, pad_to: int = VOCAB_PAD) -> int:
    """``vocab_parallel_embedding.pad_vocab_size``: vLLM pads the global vocab, not per rank."""
    return -(-vocab // pad_to) * pad_to


def pp_layer_bounds(
    num_layers: int, pp: int, partition: tuple[int, ...] | None = None
) -> tuple[tuple[int, int], ...]:
    """``[start, end)`` decoder layers of every PP stage, as ``get_pp_indices`` splits them."""
    if partition is not None:
        if len(partition) != pp:
            raise LayoutError(
                f"pp_partition {partition} has {len(partition)} entries, pp={pp} (VLLM_PP_LAYER_PARTITION)"
            )
        if sum(partition) != num_layers or any(n < 0 for n in partition):
            raise LayoutError(
                f"pp_partition {partition} does not split num_layers={num_layers} (VLLM_PP_LAYER_PARTITION)"
            )
        parts = list(partition)
    else:
        parts = [num_layers // pp] * pp
        for i in range(2, num_layers % pp + 2):  # remainder to all but the last stage, from the back
            parts[-i] += 1
    bounds, start = [], 0
    for n in parts:
        bounds.append((start, start + n))
        start += n
    return tuple(bounds)


# ----------------------------------------------------------------------------- validation


@dataclass(frozen=True)
class Dims:
    """Every size the rules need, checked once against what vLLM accepts."""

    tp: int
    q_rows: int  # query rows per TP rank
    kv_rows: int  # rows of K (and of V) per TP rank
    kv_rep: int  # TP ranks sharing one KV shard
    padded_vocab: int
    vocab_rows: int  # padded rows per TP rank
    dense_rows: int  # dense intermediate rows per TP rank
    moe_tp: int  # MoE tensor-parallel size (dp*tp without EP, 1 with EP)
    ep: int  # expert-parallel size (1 without EP)
    moe_rows: int  # expert intermediate rows per MoE TP rank
    physical: int  # G = E + R physical expert slots
    stages: tuple[tuple[int, int], ...]
    maps: Mapping[int, tuple[int, ...]]  # MoE layer -> physical->logical map (missing: initial)
    initial_map: tuple[int, ...]


def check_dims(spec: ModelSpec, par: VllmParallel) -> Dims:
    """Every dimension a vLLM worker's shards have, checked in vLLM's order of complaints."""
    P, stages, has_dense = _check_attention_and_dense(spec, par)
    moe_tp, ep, G, initial, maps = _check_experts(spec, par)
    tp, nH, nKV, D = par.tp, spec.num_heads, spec.num_kv_heads, spec.head_dim
    return Dims(
        tp=tp,
        q_rows=nH // tp * D,
        kv_rows=max(1, nKV // tp) * D,
        kv_rep=max(1, tp // nKV),
        padded_vocab=P,
        vocab_rows=P // tp,
        dense_rows=spec.intermediate // tp if has_dense else 0,
        moe_tp=moe_tp,
        ep=ep,
        moe_rows=spec.moe_intermediate // moe_tp if spec.moe_layers else 0,
        physical=G,
        stages=stages,
        maps=maps,
        initial_map=initial,
    )


def _check_attention_and_dense(spec: ModelSpec, par: VllmParallel) -> tuple[int, tuple[tuple[int, int], ...], bool]:
    """(padded vocab, PP stage bounds, whether any layer is dense) once attention, vocab, PP
    and dense-MLP sizes split as vLLM splits them."""
    for field_name in ("tp", "pp", "dp", "replicas"):
        if getattr(par, field_name) < 1:
            raise LayoutError(f"VllmParallel.{field_name}={getattr(par, field_name)} must be >= 1")
    tp = par.tp
    nH, nKV, D = spec.num_heads, spec.num_kv_heads, spec.head_dim
    if nH % tp:
        raise LayoutError(f"self_attn.qkv_proj: num_attention_heads={nH} is not divisible by tp={tp}")
    if nKV >= tp and nKV % tp:
        raise LayoutError(f"self_attn.qkv_proj: num_key_value_heads={nKV} is not divisible by tp={tp}")
    if nKV < tp and tp % nKV:
        raise LayoutError(
            f"self_attn.qkv_proj: tp={tp} is not a multiple of num_key_value_heads={nKV} (KV replication)"
        )
    if spec.mla is not None and spec.tied:
        raise LayoutError(
            "tied embeddings with DeepSeek-V3: vLLM 0.32's DeepseekV2ForCausalLM builds an untied lm_head "
            "that no checkpoint tensor loads; not supported"
        )
    if spec.shared_intermediate % tp:
        raise LayoutError(
            f"mlp.shared_experts: shared intermediate {spec.shared_intermediate} is not divisible by tp={tp}"
        )
    if spec.arch == "llama" and spec.qkv_bias:
        raise LayoutError(
            "llama attention_bias also gives vLLM an o_proj.bias, which the canonical spec does not describe"
        )
    P = pad_vocab(spec.vocab)
    if P % tp:
        raise LayoutError(f"embed_tokens/lm_head: padded vocab {P} (pad64 of {spec.vocab}) is not divisible by tp={tp}")
    if spec.num_layers < par.pp and par.pp_partition is None:
        raise LayoutError(f"pp={par.pp} exceeds num_layers={spec.num_layers}: a PP stage would hold no layer")
    stages = pp_layer_bounds(spec.num_layers, par.pp, par.pp_partition)
    has_dense = any(not spec.is_moe(i) for i in range(spec.num_layers))
    if has_dense and spec.intermediate % tp:
        raise LayoutError(
            f"mlp.gate_up_proj/down_proj: intermediate_size={spec.intermediate} is not divisible by tp={tp}"
        )
    return P, stages, has_dense


def _check_experts(spec: ModelSpec, par: VllmParallel) -> tuple[int, int, int, tuple[int, ...], dict[int, tuple[int, ...]]]:
    """(MoE TP size, EP size, physical experts, initial physical->logical map, explicit EPLB
    maps) as ``FusedMoEParallelConfig`` derives them, checked."""
    tp = par.tp
    if par.expert_placement not in ("linear", "round_robin"):
        raise LayoutError(f"expert_placement={par.expert_placement!r} is not 'linear' or 'round_robin'")

    E, R = spec.num_experts, par.num_redundant_experts
    flat = par.dp * tp
    use_ep = par.enable_ep and flat > 1  # FusedMoEParallelConfig.make
    moe_tp, ep = (1, flat) if use_ep else (flat, 1)
    eplb = R > 0 or par.physical_to_logical is not None
    if R < 0:
        raise LayoutError(f"num_redundant_experts={R} must be >= 0")
    if eplb and not spec.moe_layers:
        raise LayoutError("redundant experts / physical_to_logical given for a model without MoE layers")
    if eplb and not use_ep:
        raise LayoutError(
            "EPLB (redundant experts or a physical->logical map) needs enable_ep with dp*tp > 1 "
            "(ParallelConfig: 'enable_expert_parallel must be True to use EPLB')"
        )
    G = E + R
    initial = tuple(range(E)) + tuple(i % E for i in range(R)) if E else ()
    maps: dict[int, tuple[int, ...]] = {}
    if spec.moe_layers:
        if tp > E:
            raise LayoutError(f"mlp.experts: tp={tp} is greater than num_experts={E} (Qwen3MoeSparseMoeBlock)")
        if spec.moe_intermediate % moe_tp:
            raise LayoutError(
                f"mlp.experts: moe_intermediate_size={spec.moe_intermediate} is not divisible by the MoE "
                f"TP size {moe_tp} (dp*tp without EP, FusedMoEConfig)"
            )
        if eplb and G % ep:
            raise LayoutError(
                f"mlp.experts: EPLB needs an even split, {G} physical experts (E={E} + R={R}) "
                f"over ep={ep} ranks"
            )
        if par.physical_to_logical is not None:
            maps = _check_maps(spec, par.physical_to_logical, G)
    return moe_tp, ep, G, initial, maps


def _check_maps(spec: ModelSpec, given: tuple[tuple[int, tuple[int, ...]], ...], G: int) -> dict[int, tuple[int, ...]]:
    """An EPLB map must name every MoE layer once, have one logical id per physical slot and
    leave no logical expert without a slot (EPLB never drops one)."""
    maps: dict[int, tuple[int, ...]] = {}
    E = spec.num_experts
    for layer, phys in given:
        if not spec.is_moe(layer):
            raise LayoutError(f"physical_to_logical: layer {layer} is not a MoE layer")
        if layer in maps:
            raise LayoutError(f"physical_to_logical: layer {layer} given twice")
        phys = tuple(int(x) for x in phys)
        if len(phys) != G:
            raise LayoutError(
                f"physical_to_logical: layer {layer} maps {len(phys)} physical slots, expected E+R={G}"
            )
        if any(not 0 <= x < E for x in phys):
            raise LayoutError(f"physical_to_logical: layer {layer} has a logical id outside [0, {E})")
        missing = set(range(E)).difference(phys)
        if missing:
            raise LayoutError(
                f"physical_to_logical: layer {layer} has no slot for logical experts {sorted(missing)[:8]}"
            )
        maps[layer] = phys
    absent = [i for i in spec.moe_layers if i not in maps]
    if absent:
        raise LayoutError(f"physical_to_logical: no map for MoE layers {absent[:8]} (give every MoE layer)")
    return maps


def expert_slots(d: Dims, ep_rank: int) -> tuple[int, int]:
    """First physical slot and local count of ``ep_rank`` (``determine_expert_map``, linear).

    Always linear: vLLM honours ``round_robin`` only for grouped experts (num_expert_group > 1)
    without EPLB, and none of the supported architectures groups experts, so it falls back.
    """
    base, rem = divmod(d.physical, d.ep)
    return ep_rank * base + min(ep_rank, rem), base + (1 if ep_rank < rem else 0)


# ----------------------------------------------------------------------------- templates
