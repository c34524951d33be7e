"""Live adapter: describe the parameters of a running megatron-core model.

The descriptors come from the same pure rules as the planner's (``rules.py``): the parallel
sizes and this rank's coordinates are read from ``parallel_state`` and the model config, the
rules predict every local parameter, and every live parameter is then checked against the
prediction (name and shape), so a layout the rules do not understand fails loudly here,
before any data moves.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Sequence

from ...layout import LayoutError, LocalParam, ModelSpec, SideLayout
from ...layout.lora import PeftConfig, adapter_tensors
from .lora import policy_peft
from .lora_rules import megatron_lora_rank_params
from .mtp_rules import megatron_mtp_rank_params
from ...layout.mtp import draft_tensors
from ...layout.rows import rows_of
from .fsdp import fsdp_rows, fsdp_weights, is_fsdp
from .rules import TIED_OUTPUT_NOTE, MegatronParallel, megatron_rank_params, rank_coords

__all__ = ["live_parallel", "named_local_params", "describe", "describe_world", "side_tensors", "has_mtp", "widened"]


def _unwrap(module):
    """Strip DDP / Float16Module style wrappers (each keeps the real model in ``.module``)."""
    while hasattr(module, "module") and not hasattr(module, "decoder"):
        module = module.module
    return module


def _language(model):
    """The language model of ``model``: a ``LLaVAModel``'s ``language_model`` (a ``GPTModel``),
    else the model itself."""
    lm = getattr(model, "language_model", None)
    return model if lm is None else lm


#: Persistent buffers that are model weights: the router's aux-loss-free balancing bias
#: (HF ``e_score_correction_bias``), updated outside the optimizer and saved in checkpoints.
WEIGHT_BUFFERS = ("mlp.router.expert_bias",)


def named_local_params(model_chunks: Sequence) -> dict[str, "torch.Tensor"]:  # noqa: F821
    """Local parameters (and :data:`WEIGHT_BUFFERS`) by the names the rules use
    (``chunk{v}.`` prefix when several chunks). Under Megatron-FSDP: this rank's rows of each
    parameter's model weights (``fsdp.fsdp_weights``)."""
    out = {}
    multi = len(model_chunks) > 1
    for v, chunk in enumerate(model_chunks):
        prefix = f"chunk{v}." if multi else ""
        model = _unwrap(chunk)
        params = fsdp_weights(chunk) if is_fsdp(chunk) else dict(model.named_parameters())
        for name, p in params.items():
            out[prefix + name] = p
        for name, b in model.named_buffers():
            if b is not None and name.endswith(WEIGHT_BUFFERS):
                if str(b.dtype) != "torch.float32":
                    # Float16Module's cast reaches the buffer until the router's first forward
                    # (or state-dict load/save) puts it back in fp32: do that megatron step now,
                    # so the refit reads what training uses (``rules``: fp32).
                    router = model.get_submodule(name.rsplit(".", 1)[0])
                    getattr(router, "_maintain_float32_expert_bias", lambda: None)()
                    b = getattr(router, name.rsplit(".", 1)[1])
                out[prefix + name] = b
    return out


def live_parallel(model_chunks: Sequence) -> tuple[MegatronParallel, int]:
    """``MegatronParallel`` and this rank, read from ``parallel_state`` and the model config."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    model = _language(_unwrap(model_chunks[0]))
    cfg = model.config
    names = named_local_params(model_chunks)
    vpp = ps.get_virtual_pipeline_model_parallel_world_size() or 1
    if vpp != len(model_chunks):
        raise LayoutError(f"{len(model_chunks)} model chunks but virtual pipeline size {vpp}")
    te = any(n.endswith(("linear_qkv.layer_norm_weight", "linear_kv_up_proj.layer_norm_weight")) for n in names)
    grouped = any(".mlp.experts.linear_fc1.weight" in n for n in names)
    tp = ps.get_tensor_model_parallel_world_size()
    par = MegatronParallel(
        tp=tp,
        pp=ps.get_pipeline_model_parallel_world_size(),
        ep=ps.get_expert_model_parallel_world_size(),
        etp=ps.get_expert_tensor_parallel_world_size(),
        cp=ps.get_context_parallel_world_size(),
        dp=ps.get_data_parallel_world_size(with_context_parallel=False),
        vpp=vpp,
        first_stage_layers=cfg.num_layers_in_first_pipeline_stage,
        last_stage_layers=cfg.num_layers_in_last_pipeline_stage,
        layer_spec="te" if te else "local",
        experts="grouped" if grouped else "sequential",
        sequence_parallel=bool(cfg.sequence_parallel),
        vocab_padded=int(model.vocab_size),
        fsdp=any(is_fsdp(c) for c in model_chunks),
    )
    rank = dist.get_rank()
    live = dict(tp=ps.get_tensor_model_parallel_rank(), pp=ps.get_pipeline_model_parallel_rank(),
                ep=ps.get_expert_model_parallel_rank(), etp=ps.get_expert_tensor_parallel_rank(),
                cp=ps.get_context_parallel_rank())
    coords = rank_coords(par, rank)
    wrong = {k: (coords[k], v) for k, v in live.items() if coords[k] != v}
    if wrong:
        raise LayoutError(f"rank {rank}: megatron's rank order is not tp-cp-ep-dp-pp; (predicted, live) = {wrong}")
    return par, rank


def _check_spec(spec: ModelSpec, cfg) -> None:
    """The HF spec and the live config must describe the same architecture (a hybrid's layer
    count is its megatron pattern's; its table's ``megatron_config`` says whether MLPs are gated)."""
    fam = spec.family
    pattern = fam.megatron_pattern(spec)
    table_cfg = fam.megatron_config(spec) if fam.megatron_config is not None else {}
    pairs = {
        "num_layers": (len(pattern) if pattern else spec.num_layers, cfg.num_layers),
        "hidden_size": (spec.hidden, cfg.hidden_size),
        "num_attention_heads": (spec.num_heads, cfg.num_attention_heads),
        "num_moe_experts": (spec.num_experts or None, cfg.num_moe_experts),
        "gated_linear_unit": (table_cfg.get("gated_linear_unit", True), cfg.gated_linear_unit),
        "multi_latent_attention": (spec.mla is not None, bool(getattr(cfg, "multi_latent_attention", False))),
    }
    if spec.mla is None:
        pairs["num_query_groups"] = (spec.num_kv_heads, cfg.num_query_groups)
        pairs["kv_channels"] = (spec.head_dim, cfg.kv_channels)
    else:
        m = spec.mla
        pairs.update(q_lora_rank=(m.q_lora_rank, cfg.q_lora_rank), kv_lora_rank=(m.kv_lora_rank, cfg.kv_lora_rank),
                     qk_head_dim=(m.qk_nope_head_dim, cfg.qk_head_dim),
                     qk_pos_emb_head_dim=(m.qk_rope_head_dim, cfg.qk_pos_emb_head_dim),
                     v_head_dim=(m.v_head_dim, cfg.v_head_dim))
    if spec.moe_layers:
        pairs["moe_shared_expert_intermediate_size"] = (spec.shared_intermediate or None,
                                                        cfg.moe_shared_expert_intermediate_size)
        pairs["moe_router_enable_expert_bias"] = (spec.router_bias, bool(cfg.moe_router_enable_expert_bias))
    if spec.moe_layers:
        pairs["moe_ffn_hidden_size"] = (spec.moe_intermediate, cfg.moe_ffn_hidden_size)
    if len(spec.moe_layers) < spec.num_layers:
        pairs["ffn_hidden_size"] = (spec.intermediate, cfg.ffn_hidden_size)
    bad = {k: v for k, v in pairs.items() if v[0] != v[1]}
    if bad:
        raise LayoutError(f"model spec and megatron config disagree (spec, live): {bad}")


def describe(model_chunks: Sequence, spec: ModelSpec) -> list[LocalParam]:
    """Descriptors of the calling rank's parameters (``spec`` gives HF names and the real vocab).

    Raises LayoutError naming any live parameter the rules do not predict, any predicted one
    that is missing, or a shape mismatch. The tied last-stage ``output_layer.weight`` copy is
    the one parameter deliberately not described (never a sender).
    """
    _check_spec(spec, _language(_unwrap(model_chunks[0])).config)
    par, rank = live_parallel(model_chunks)
    predicted = megatron_rank_params(spec, replace(par, fsdp=False), rank)  # whole; FSDP's rows below
    peft = policy_peft(_unwrap(model_chunks[0]))
    if peft is not None:  # a LoRA policy: its adapters too (``lora_rules``)
        predicted = predicted + megatron_lora_rank_params(spec, par, peft, rank)
    if has_mtp(model_chunks):  # megatron's MTP block (``mtp_rules``)
        predicted = predicted + megatron_mtp_rank_params(spec, par, rank)
    live = named_local_params(model_chunks)
    if par.fsdp:  # this rank's rows of each parameter, as Megatron-FSDP placed them (``layout.rows``)
        rows = fsdp_rows(model_chunks, {p.name: live[p.name] for p in predicted if p.name in live})
        predicted = [rows_of(p, *rows[p.name]) if p.name in rows else p for p in predicted]
    by_name = {p.name: p for p in predicted}
    for name, tensor in live.items():
        if spec.tied and par.pp > 1 and name.endswith("output_layer.weight"):
            continue  # TIED_OUTPUT_NOTE: a copy of the first stage's embedding
        p = by_name.get(name)
        if p is None:
            raise LayoutError(f"rank {rank}: live parameter {name!r} {tuple(tensor.shape)} is not described by the rules")
        if tuple(tensor.shape) != p.shape:
            raise LayoutError(f"rank {rank}: {name!r} has shape {tuple(tensor.shape)}, rules predict {p.shape}")
        if str(tensor.dtype).removeprefix("torch.") != p.dtype and not widened(spec, name, tensor.element_size(), p.dtype):
            raise LayoutError(f"rank {rank}: {name!r} has dtype {tensor.dtype}, spec says {p.dtype}")
        if not tensor.is_contiguous():
            raise LayoutError(f"rank {rank}: {name!r} is not contiguous; views address flat storage")
    missing = sorted(set(by_name) - set(live))
    if missing:
        raise LayoutError(f"rank {rank}: predicted parameters missing from the live model: {missing[:5]}")
    return predicted


def widened(spec: ModelSpec, name: str, live_itemsize: int, described: str) -> bool:
    """Whether ``name`` is a parameter megatron holds narrower than the family's table carries
    it (``Placement.widened``: the endpoint widens its copy when sending)."""
    from ...layout.descriptor import DTYPE_BYTES

    if live_itemsize >= DTYPE_BYTES.get(described, 0):
        return False
    fam = spec.family
    names = {r.megatron.name for b in fam.blocks.values() for r in b.rows
             if r.megatron is not None and r.megatron.widened}
    return any(name.endswith("." + n) for n in names)


def side_tensors(spec: ModelSpec, peft: "PeftConfig | None", mtp: bool = False) -> dict:
    """Canonical tensors of a policy: the model's, a LoRA policy's adapter matrices, and the
    MTP layers where it has them."""
    return {**spec.tensor_table(), **(adapter_tensors(spec, peft) if peft is not None else {}),
            **(draft_tensors(spec) if mtp else {})}


def has_mtp(model_chunks: Sequence) -> bool:
    """Whether the model was built with megatron-core's MTP block (``mtp_num_layers``)."""
    return bool(getattr(_unwrap(model_chunks[0]).config, "mtp_num_layers", None))


def describe_world(model_chunks: Sequence, spec: ModelSpec) -> SideLayout:
    """Every rank's descriptors, all-gathered over the default group (collective)."""
    import torch.distributed as dist

    mine = describe(model_chunks, spec)
    par, _ = live_parallel(model_chunks)
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    params = tuple(p for rank_params in gathered for p in rank_params)
    notes = (TIED_OUTPUT_NOTE,) if spec.tied and par.pp > 1 else ()
    return SideLayout(
        name=f"megatron-live(tp={par.tp},pp={par.pp},vpp={par.vpp},ep={par.ep},etp={par.etp_size},dp={par.dp})",
        world_size=dist.get_world_size(),
        params=params,
        tensors=side_tensors(spec, policy_peft(_unwrap(model_chunks[0])), has_mtp(model_chunks)),
        notes=notes,
    )
