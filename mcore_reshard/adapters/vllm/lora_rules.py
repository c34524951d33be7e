"""vLLM's live LoRA slots as boxes of the canonical PEFT tensors (``layout.lora``).

With ``enable_lora`` every adapted linear is wrapped in a LoRA layer (``vllm/lora/layers/``)
that holds, per sub-projection ``k``, ``lora_a_stacked[k]`` ``[max_loras, 1, max_lora_rank,
in]`` and ``lora_b_stacked[k]`` ``[max_loras, 1, out, max_lora_rank]``, zeroed and filled by
``set_lora`` in PEFT's orientation (A ``[r, in]``, B ``[out, r]``, the rest of the rank zero).
One slot of one of them is a local tensor here, named ``<module>.lora_a_stacked.<k>.slot<s>``
(``[max_lora_rank, in]``; the rows past ``r`` are padding the receiver zero-fills). Sharding,
without ``fully_sharded_loras`` (vLLM's default):

- ``qkv_proj`` (``MergedQKVParallelLinearWithLoRA``, slices q, k, v) and ``gate_up_proj``
  (``MergedColumnParallelLinearWithLoRA``, slices gate, up): A whole on every rank; B split by
  output rows as the base weight is (k and v by ``tp_rank // kv_replicas`` under KV
  replication);
- ``o_proj`` and ``down_proj`` (``RowParallelLinearWithLoRA``): A split by input columns as the
  base weight is, B whole.

vLLM folds ``alpha / r`` into B when it loads an adapter (``lora_weights.py:optimize``): the
layout says so (``SideLayout.scale``), and the senders multiply while packing.
"""

from __future__ import annotations

from typing import Any

from ...layout import Box, LayoutError, LocalParam, ModelSpec, Piece, SideLayout, View
from ...layout.lora import PeftConfig, adapter_tensors, expert_lora_name, lora_name
from .parallel import VllmParallel, check_dims, expert_slots

__all__ = ["vllm_lora_layout", "vllm_lora_rank_params", "slot_name", "parse_slot_name", "is_slot_name", "LORA_MODULES"]

#: Megatron module -> (vLLM module, its HF sub-projections in slice order).
LORA_MODULES: dict[str, tuple[str, tuple[str, ...]]] = {
    "linear_qkv": ("self_attn.qkv_proj", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
    "linear_proj": ("self_attn.o_proj", ("self_attn.o_proj",)),
    "linear_fc1": ("mlp.gate_up_proj", ("mlp.gate_proj", "mlp.up_proj")),
    "linear_fc2": ("mlp.down_proj", ("mlp.down_proj",)),
}


def slot_name(layer: int, module: str, part: str, k: int, slot: int) -> str:
    """Local name of one slot of one stacked LoRA tensor (``part``: ``lora_a`` or ``lora_b``)."""
    return f"model.layers.{layer}.{module}.{part}_stacked.{k}.slot{slot}"


def is_slot_name(name: str) -> bool:
    """Whether a local name is a ``slot_name``."""
    module, _, last = name.rpartition(".")
    return last.startswith("slot") and last[4:].isdigit() and "_stacked." in module


def parse_slot_name(name: str) -> tuple[str, str, int, int]:
    """(module path, ``lora_a`` | ``lora_b``, slice, slot) of a ``slot_name``."""
    module, stacked, k, slot = name.rsplit(".", 3)
    if not stacked.endswith("_stacked") or not slot.startswith("slot"):
        raise LayoutError(f"{name}: not a LoRA slot name (<module>.lora_a_stacked.<k>.slot<s>)")
    return module, stacked[: -len("_stacked")], int(k), int(slot[4:])


def _check(spec: ModelSpec, par: VllmParallel, peft: PeftConfig) -> None:
    if par.quantization is not None:
        raise LayoutError(f"peft.enabled with vllm.quantization={par.quantization}: LoRA adapters into an FP8 "
                          f"engine are not supported (vLLM's LoRA layers take unquantized bases here)")
    if peft.lora_dtype not in (None, spec.dtype):
        raise LayoutError(f"peft.lora_dtype={peft.lora_dtype}: vLLM holds LoRA slots in the model dtype "
                          f"{spec.dtype} (lora_dtype=auto)")


def _rows(name: str, row0: int, rows: int, r: int, R: int) -> tuple[str, Box, View]:
    """B rows ``[row0, row0+rows)`` (all ``r`` columns) in a ``[rows, R]`` slot."""
    return name, Box((row0, 0), (rows, r)), View(0, (rows, r), (R, 1))


def _a(name: str, col0: int, cols: int, r: int) -> tuple[str, Box, View]:
    """A columns ``[col0, col0+cols)`` (all ``r`` rows) in an ``[R, cols]`` slot."""
    return name, Box((0, col0), (r, cols)), View(0, (r, cols), (cols, 1))


def vllm_lora_rank_params(spec: ModelSpec, par: VllmParallel, peft: PeftConfig, rank: int) -> list[LocalParam]:
    """One worker's slot ``peft.slot`` of every adapted module's stacked A and B."""
    _check(spec, par, peft)
    d = check_dims(spec, par)
    tp_r, pp_r = rank % par.tp, rank // par.tp % par.pp
    H, r, R, s = spec.hidden, peft.dim, peft.engine_rank, peft.slot
    ks = tp_r // d.kv_rep if spec.num_kv_heads < d.tp else tp_r
    sizes = {  # HF projection -> (input columns on this rank, its first column, output rows, first row)
        "self_attn.q_proj": (H, 0, d.q_rows, tp_r * d.q_rows),
        "self_attn.k_proj": (H, 0, d.kv_rows, ks * d.kv_rows),
        "self_attn.v_proj": (H, 0, d.kv_rows, ks * d.kv_rows),
        "self_attn.o_proj": (d.q_rows, tp_r * d.q_rows, H, 0),
        "mlp.gate_proj": (H, 0, d.dense_rows, tp_r * d.dense_rows),
        "mlp.up_proj": (H, 0, d.dense_rows, tp_r * d.dense_rows),
        "mlp.down_proj": (d.dense_rows, tp_r * d.dense_rows, H, 0),
    }
    dt = spec.dtype
    out: list[LocalParam] = []

    def add(name: str, shape: tuple[int, int], piece: tuple[str, Box, View]) -> None:
        out.append(LocalParam(rank, name, shape, dt, (Piece(rank, name, *piece),)))

    start, end = d.stages[pp_r]
    moe_r = rank // (par.tp * par.pp) % par.dp * par.tp + tp_r  # flattened MoE rank (ep_rank with EP)
    for layer in range(start, end):
        if spec.is_moe(layer) and {"linear_fc1", "linear_fc2"} & set(peft.modules):
            out.extend(_expert_slots(spec, d, peft, layer, moe_r, rank))
        for module in peft.modules:
            vmod, projs = LORA_MODULES[module]
            if vmod.startswith("mlp.") and spec.is_moe(layer):
                continue
            for k, proj in enumerate(projs):
                cols, col0, rows, row0 = sizes[proj]
                add(slot_name(layer, vmod, "lora_a", k, s), (R, cols), _a(lora_name(layer, proj, "lora_A"), col0, cols, r))
                add(slot_name(layer, vmod, "lora_b", k, s), (rows, R), _rows(lora_name(layer, proj, "lora_B"), row0,
                                                                              rows, r, R))
    return out


def _expert_slots(spec: ModelSpec, d: Any, peft: PeftConfig, layer: int, moe_r: int, rank: int) -> list[LocalParam]:
    """One worker's slot of a MoE layer's ``FusedMoEWithLoRA`` (``vllm/lora/layers/fused_moe.py``,
    not ``fully_sharded_loras``): per local expert ``j``, ``w13_lora_a_stacked[k]`` ``[E_l, R, H]``
    (gate, up: A whole), ``w13_lora_b_stacked[k]`` ``[E_l, f, R]`` (B's rows of this MoE-TP rank),
    ``w2_lora_a_stacked[0]`` ``[E_l, R, f]`` (A's columns), ``w2_lora_b_stacked[0]`` ``[E_l, H, R]``
    (B whole). Under EP each worker holds its linear share of the experts, whole (MoE TP 1)."""
    if spec.num_experts != d.physical:
        raise LayoutError("peft: adapters on the experts with redundant experts (EPLB) are not described: vLLM "
                          "slices expert adapters linearly at load")
    H, f, r, R, s = spec.hidden, d.moe_rows, peft.dim, peft.engine_rank, peft.slot
    first, n = expert_slots(d, moe_r) if d.ep > 1 else (0, spec.num_experts)
    row0 = 0 if d.ep > 1 else moe_r * f
    module = f"model.layers.{layer}.mlp.experts"
    name = lambda e, proj, part: expert_lora_name(layer, e, proj, part)  # noqa: E731
    dt = spec.dtype
    out: list[LocalParam] = []

    def add(stacked: str, k: int, shape: tuple[int, int], per_expert) -> None:
        local = f"{module}.{stacked}_stacked.{k}.slot{s}"
        size = shape[0] * shape[1]
        pieces = tuple(Piece(rank, local, c, box, View(j * size + v.offset, v.shape, v.stride))
                       for j in range(n) for c, box, v in [per_expert(first + j)])
        out.append(LocalParam(rank, local, (n, *shape), dt, pieces))

    if "linear_fc1" in peft.modules:
        for k, proj in enumerate(("gate_proj", "up_proj")):
            add("w13_lora_a", k, (R, H), lambda e, p=proj: _a(name(e, p, "lora_A"), 0, H, r))
            add("w13_lora_b", k, (f, R), lambda e, p=proj: _rows(name(e, p, "lora_B"), row0, f, r, R))
    if "linear_fc2" in peft.modules:
        add("w2_lora_a", 0, (R, f), lambda e: _a(name(e, "down_proj", "lora_A"), row0, f, r))
        add("w2_lora_b", 0, (H, R), lambda e: _rows(name(e, "down_proj", "lora_B"), 0, H, r, R))
    return out


def vllm_lora_layout(spec: ModelSpec, par: VllmParallel, peft: PeftConfig) -> SideLayout:
    """Every worker's slot of the adapter: the destination side of an adapter refit."""
    params = [p for rank in range(par.world_size) for p in vllm_lora_rank_params(spec, par, peft, rank)]
    tensors = adapter_tensors(spec, peft)
    scale = tuple((n, peft.scaling) for n in tensors if n.endswith(".lora_B.weight"))
    return SideLayout("vllm-lora", par.world_size, tuple(params), tensors,
                      (f"vllm lora slot {peft.slot} of max_loras={peft.max_loras}, max_lora_rank={peft.engine_rank}",),
                      scale=scale)
