"""megatron-core's ``HybridModel`` (Nemotron-H, Qwen3-Next) built on CPU with a local spec.

The stock ``hybrid_stack_spec`` needs Transformer Engine, mamba-ssm and FLA. The same modules
-- ``MambaLayer`` + ``MambaMixer``, ``TransformerLayer`` + ``GatedDeltaNet``, ``SelfAttention``,
``MLPLayer``, ``MoETransformerLayer`` -- are built here from megatron's local pieces
(``ColumnParallelLinear`` / ``RowParallelLinear`` / ``WrappedTorchNorm``), after the CPU
patches of ``runtime.apply_hybrid_cpu_patches``. The parameters are megatron's own; what the
local spec changes is only where each layer's input norm lives (a module of its own instead of
fused into the first linear), which the family's table describes for both specs.

What runs: every module builds and is described on CPU; GDN runs forward with
``deterministic_mode=True`` (torch conv1d and ``torch_chunk_gated_delta_rule``); Mamba has no
torch fallback for its scan, so a Nemotron-H model here is built, loaded and refit, not trained.
"""

from __future__ import annotations

from typing import Any

from ...layout import ModelSpec
from .build import megatron_config
from .rules import MegatronParallel, padded_vocab

__all__ = ["build_hybrid", "hybrid_config"]


def hybrid_config(spec: ModelSpec, par: MegatronParallel, dtype: str | None = None):
    """``megatron_config`` (which applies the table's own fields: Mamba / GDN sizes, gated
    attention, non-gated relu2 MLPs, the shared-expert gate, the router bias) with the
    pattern's layer count and MoE layers."""
    fam = spec.family
    pattern = fam.megatron_pattern(spec)
    assert pattern, f"{fam.title} is not a hybrid family"
    cfg = megatron_config(spec, par, dtype)
    cfg.num_layers = len(pattern)
    if spec.moe_layers:
        cfg.moe_layer_freq = [1 if c == "E" else 0 for c in pattern]
        cfg.moe_shared_expert_intermediate_size = spec.shared_intermediate or None
    if spec.hybrid.gdn is not None:
        cfg.deterministic_mode = True  # torch conv1d + torch_chunk_gated_delta_rule (no FLA) on CPU
        # Qwen3-Next's RMSNorms scale by (1 + w) (``layernorm_zero_centered_gamma``), which
        # megatron's torch norm refuses: the same bytes are held and moved; a CPU forward here
        # scales by w (layouts are what this build is for).
    return cfg


def _stack_spec(spec: ModelSpec, config: Any):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec
    from megatron.core.models.hybrid.hybrid_block import HybridStack, HybridStackSubmodules
    from megatron.core.ssm.gated_delta_net import GatedDeltaNet, GatedDeltaNetSubmodules
    from megatron.core.ssm.mamba_layer import MambaLayer, MambaLayerSubmodules
    from megatron.core.ssm.mamba_mixer import MambaMixer, MambaMixerSubmodules
    from megatron.core.ssm.mlp_layer import MLPLayer
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.torch_norm import WrappedTorchNorm
    from megatron.core.transformer.transformer_layer import (MoETransformerLayer, TransformerLayer,
                                                            TransformerLayerSubmodules)
    from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add

    dense = get_gpt_layer_local_spec(qk_layernorm=spec.qk_norm, normalization="RMSNorm")
    attn = dense.submodules.self_attention
    mlp = dense.submodules.mlp
    subs = HybridStackSubmodules(
        mamba_layer=ModuleSpec(module=MambaLayer, submodules=MambaLayerSubmodules(
            norm=WrappedTorchNorm,
            mixer=ModuleSpec(module=MambaMixer, submodules=MambaMixerSubmodules(
                in_proj=ColumnParallelLinear, out_proj=RowParallelLinear)),
            mamba_bda=get_bias_dropout_add)),
        gdn_layer=ModuleSpec(module=TransformerLayer, submodules=TransformerLayerSubmodules(
            input_layernorm=WrappedTorchNorm,
            self_attention=ModuleSpec(module=GatedDeltaNet, submodules=GatedDeltaNetSubmodules(
                in_proj=ColumnParallelLinear, out_norm=WrappedTorchNorm, out_proj=RowParallelLinear)),
            self_attn_bda=get_bias_dropout_add)),
        attention_layer=ModuleSpec(module=TransformerLayer, submodules=TransformerLayerSubmodules(
            input_layernorm=WrappedTorchNorm, self_attention=attn, self_attn_bda=get_bias_dropout_add)),
        mlp_layer=ModuleSpec(module=MLPLayer, submodules=TransformerLayerSubmodules(
            pre_mlp_layernorm=WrappedTorchNorm, mlp=mlp, mlp_bda=get_bias_dropout_add)),
        moe_layer=ModuleSpec(module=MoETransformerLayer, submodules=TransformerLayerSubmodules(
            pre_mlp_layernorm=WrappedTorchNorm,
            mlp=get_moe_module_spec(use_te=False, num_experts=max(spec.num_experts, 1), moe_grouped_gemm=False),
            mlp_bda=get_bias_dropout_add)),
    )
    return ModuleSpec(module=HybridStack, submodules=subs)


def build_hybrid(spec: ModelSpec, par: MegatronParallel, dtype: str | None = None, max_seq: int = 512) -> list:
    """This rank's ``HybridModel`` (one chunk: hybrids without ``|`` have no virtual stages);
    call after ``init_megatron``."""
    from megatron.core import parallel_state as ps
    from megatron.core.models.hybrid.hybrid_model import HybridModel

    from .runtime import apply_hybrid_cpu_patches

    apply_hybrid_cpu_patches()
    config = hybrid_config(spec, par, dtype)
    h = spec.hybrid
    model = HybridModel(
        config=config, hybrid_stack_spec=_stack_spec(spec, config), vocab_size=padded_vocab(spec, par),
        max_sequence_length=max_seq, hybrid_layer_pattern=spec.family.megatron_pattern(spec),
        pre_process=ps.is_pipeline_first_stage(), post_process=ps.is_pipeline_last_stage(),
        share_embeddings_and_output_weights=spec.tied,
        position_embedding_type="rope" if "*" in h.mixers else "none",
        rotary_base=int(spec.rope_theta),
        rotary_percent=float(spec.hf_config.get("partial_rotary_factor", 1.0)),
    )
    return [model]
