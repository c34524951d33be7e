"""Tiny megatron-core GPT models on CPU (the multi-process harness that runs them in tests is
``mcore_reshard.testing.worlds``).

``build_gpt`` builds the same architecture as the HF checkpoint a :class:`ModelSpec` describes
(Qwen3 / Qwen3-MoE / Llama: SwiGLU, RMSNorm, GQA, optional qk-norm, RoPE, no bias; DeepSeek-V3:
MLA, shared experts, sigmoid router with expert bias, dense first layers; gpt-oss; GLM-4.5:
each family's own TransformerConfig fields come from its table, ``Family.megatron_config``),
so that a checkpoint loaded through the descriptors must reproduce HF's logits. ``run_world`` spawns one
process per rank (torch.multiprocessing, spawn) for tests and the refit job.
"""

from __future__ import annotations

import os
from typing import Any

from ...layout import ModelSpec
from ...layout.mtp import mtp_spec
from ...infra.ports import bound_store
from .rules import MegatronParallel, padded_vocab

__all__ = ["init_megatron", "build_gpt", "megatron_config"]


# --------------------------------------------------------------------------- megatron


def init_megatron(par: MegatronParallel, rank: int, world: int, master_addr: str = "127.0.0.1",
                  master_port: int = 29500, timeout_s: float = 120.0) -> None:
    """gloo default group + megatron's model-parallel groups (+ CPU patches, RNG seeds)."""
    from datetime import timedelta

    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from .runtime import apply_cpu_patches

    if world != par.world_size:
        raise ValueError(f"world {world} != tp*cp*dp*pp = {par.world_size}")
    apply_cpu_patches()
    os.environ.setdefault("MASTER_ADDR", master_addr)
    if not dist.is_initialized():
        # A store bound to ``master_addr`` only (``tcp://`` would listen on every interface).
        store = bound_store(master_addr, master_port, world, rank == 0, timeout_s)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=timeout_s))
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=par.tp,
        pipeline_model_parallel_size=par.pp,
        virtual_pipeline_model_parallel_size=par.vpp if par.vpp > 1 else None,
        context_parallel_size=par.cp,
        expert_model_parallel_size=par.ep,
        expert_tensor_parallel_size=par.etp_size,
        distributed_timeout_minutes=max(1, int(timeout_s // 60)),
    )
    model_parallel_cuda_manual_seed(1234)


#: Fields a family's ``megatron_config`` may return that are ``GPTModel`` arguments, not
#: TransformerConfig fields.
_MODEL_ARGS = ("rotary_percent", "rotary_base")


def megatron_config(spec: ModelSpec, par: MegatronParallel, dtype: str | None = None):
    """The TransformerConfig for ``spec`` (fusions off: they need CUDA kernels): the fields
    every family shares, then its table's own (``Family.megatron_config``: pure data, named
    activations resolved here)."""
    import torch
    from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig

    if par.layer_spec != "local" or par.experts != "sequential":
        raise ValueError("CPU builds support layer_spec='local' with sequential experts only")
    torch_dtype = getattr(torch, dtype or spec.dtype)
    kw: dict[str, Any] = dict(activation_func="silu")
    if spec.moe_layers:
        kw.update(
            num_moe_experts=spec.num_experts,
            moe_ffn_hidden_size=spec.moe_intermediate,
            moe_router_topk=spec.moe_topk,
            moe_layer_freq=[1 if spec.is_moe(l) else 0 for l in range(spec.num_layers)],
            # Qwen3-MoE (norm_topk_prob): softmax over the top-k logits == renormalised top-k of
            # the full softmax, which is megatron's default (pre_softmax False).
            moe_router_pre_softmax=False,
            moe_router_load_balancing_type="none",
            moe_aux_loss_coeff=0.0,
            moe_token_dispatcher_type="alltoall" if par.ep > 1 else "allgather",
        )
    fam = spec.family
    if fam.megatron_config is not None:
        kw.update({k: v for k, v in fam.megatron_config(spec).items() if k not in _MODEL_ARGS})
    kw["activation_func"] = _activation(kw["activation_func"])
    config_cls = MLATransformerConfig if spec.mla is not None else TransformerConfig
    return config_cls(**{**dict(
        num_layers=spec.num_layers,
        hidden_size=spec.hidden,
        num_attention_heads=spec.num_heads,
        num_query_groups=spec.num_kv_heads,
        kv_channels=spec.head_dim,
        ffn_hidden_size=spec.intermediate or 4 * spec.hidden,
        normalization="RMSNorm",
        layernorm_epsilon=spec.rms_eps,
        gated_linear_unit=True,
        add_bias_linear=False,
        add_qkv_bias=spec.qkv_bias,
        qk_layernorm=spec.qk_norm or spec.mla is not None,  # MLA: q/kv_a_layernorm (local spec)
        hidden_dropout=0.0,
        attention_dropout=0.0,
        tensor_model_parallel_size=par.tp,
        pipeline_model_parallel_size=par.pp,
        virtual_pipeline_model_parallel_size=par.vpp if par.vpp > 1 else None,
        num_layers_in_first_pipeline_stage=par.first_stage_layers,
        num_layers_in_last_pipeline_stage=par.last_stage_layers,
        context_parallel_size=par.cp,
        expert_model_parallel_size=par.ep,
        expert_tensor_parallel_size=par.etp_size,
        sequence_parallel=par.sequence_parallel,
        use_cpu_initialization=True,
        params_dtype=torch_dtype,
        pipeline_dtype=torch_dtype,
        bf16=torch_dtype == torch.bfloat16,
        bias_activation_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        gradient_accumulation_fusion=False,
        apply_rope_fusion=False,
        bias_dropout_fusion=False,
    ), **kw})


def _relu2(x):
    """Nemotron-H's squared ReLU (HF ``relu2``)."""
    import torch

    return torch.square(torch.relu(x))


def _activation(name: Any):
    """A family's activation by name (``"silu"``, ``"quick_gelu"``: gpt-oss's
    ``x * sigmoid(1.702 x)``, ``"relu2"``: Nemotron-H's), or a callable as given."""
    if callable(name):
        return name
    import torch.nn.functional as F
    from megatron.core.activations import quick_gelu

    known = {"silu": F.silu, "quick_gelu": quick_gelu, "relu2": _relu2}
    if name not in known:
        raise ValueError(f"activation {name!r} is not one of {sorted(known)}")
    return known[name]


def model_args(spec: ModelSpec) -> dict[str, Any]:
    """``GPTModel`` arguments the family's table sets (``rotary_percent``, ``rotary_base``)."""
    fam = spec.family
    extra = fam.megatron_config(spec) if fam.megatron_config is not None else {}
    return {"rotary_base": int(spec.rope_theta), **{k: v for k, v in extra.items() if k in _MODEL_ARGS}}


def _mla_core_attention():
    """megatron-core 0.19's local MLA spec builds ``DotProductAttention`` with ``k_channels`` /
    ``v_channels``, which only ``TEDotProductAttention`` accepts (TypeError at build). The
    unfused kernel handles MLA's shapes (q/k head dim != v head dim) once its output width
    is ``v_channels`` per head; MLA always passes its own ``softmax_scale``."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    class MLADotProductAttention(DotProductAttention):
        def __init__(self, *args, k_channels: int | None = None, v_channels: int | None = None, **kwargs):
            super().__init__(*args, **kwargs)
            if v_channels is not None:
                self.hidden_size_per_partition = v_channels * self.num_attention_heads_per_partition

    return MLADotProductAttention


def _mla_plain_q_attention():
    """``MLASelfAttention`` for ``q_lora_rank=None`` in the local spec. megatron-core 0.19's
    ``QKNormConfigResolver`` then insists on a fused norm+linear ``linear_q_proj`` (which the
    local backend lacks, and which would add a q norm HF's model does not have); DeepSeek's
    plain-q MLA has ``q_proj`` unnormalised and ``kv_a_layernorm`` standalone."""
    from megatron.core.transformer.identity_op import IdentityOp
    from megatron.core.transformer.multi_latent_attention import MLASelfAttention

    class PlainQMLASelfAttention(MLASelfAttention):
        def _resolve_qk_norm_config(self, submodules):
            return dict(linear_q_proj=submodules.linear_q_proj, linear_q_up_proj=IdentityOp,
                        linear_kv_up_proj=submodules.linear_kv_up_proj, q_layernorm=IdentityOp,
                        kv_layernorm=submodules.kv_layernorm)

    return PlainQMLASelfAttention


def _use_cpu_mla_attention(block, q_lora: bool) -> None:
    """Local-spec MLA fixes on every layer spec of ``block``: the core attention of
    :func:`_mla_core_attention`, and :func:`_mla_plain_q_attention` without q_lora."""
    from megatron.core.transformer.multi_latent_attention import MLASelfAttention

    core = _mla_core_attention()
    plain_q = None if q_lora else _mla_plain_q_attention()
    for layer in block.layer_specs:
        attn = layer.submodules.self_attention
        if attn.module is MLASelfAttention:
            attn.submodules.core_attention = core
            if plain_q is not None:
                attn.module = plain_q


def build_gpt(spec: ModelSpec, par: MegatronParallel, dtype: str | None = None, max_seq: int = 512,
              mtp: bool = False) -> list:
    """One ``GPTModel`` per virtual-pipeline chunk of this rank (call after ``init_megatron``).

    ``mtp``: megatron-core's MTP block (``mtp_num_layers`` = the checkpoint's
    ``num_nextn_predict_layers``) on the last stage, each MTP layer built like the last decoder
    layer (``get_gpt_mtp_block_spec``), trained by megatron's own MTP loss beside the main one
    (in RL its labels are the input ids rolled left)."""
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec, get_gpt_mtp_block_spec

    config = megatron_config(spec, par, dtype)
    if mtp:
        mtp_spec(spec)  # one line where the model has no MTP layers, or not of a described family
        config.mtp_num_layers = spec.mtp_layers
    pp_r = ps.get_pipeline_model_parallel_rank()
    chunks = []
    for v in range(par.vpp):
        vp = v if par.vpp > 1 else None
        block = get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization="RMSNorm",
                                           vp_stage=vp, pp_rank=pp_r)
        if spec.mla is not None:
            _use_cpu_mla_attention(block, q_lora=spec.mla.q_lora_rank is not None)
        mtp_block = (get_gpt_mtp_block_spec(config, block.layer_specs[-1], use_transformer_engine=False, vp_stage=vp,
                                            pp_rank=pp_r) if mtp else None)
        chunks.append(GPTModel(
            config=config,
            transformer_layer_spec=block,
            vocab_size=padded_vocab(spec, par),
            max_sequence_length=max_seq,
            pre_process=ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp),
            post_process=ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp),
            share_embeddings_and_output_weights=spec.tied,
            position_embedding_type="rope",
            **model_args(spec),
            vp_stage=vp,
            mtp_block_spec=mtp_block,
        ))
    return chunks
