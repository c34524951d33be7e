"""Turning mcore-reshard on from an RL framework's policy config (NeMo RL shape).

``policy.megatron_cfg.mcore_reshard.enabled: true`` selects the shard-to-shard refit; the
parallel sizes come from the config the recipe already has, so nothing is said twice. The
keys are declared in ``settings.schema.RecipeKeys`` and read by the settings reader; every bad
setting raises :class:`~mcore_reshard.errors.ConfigError` naming the recipe key.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

from ..adapters.dtensor.parallel import DTensorParallel
from ..adapters.megatron.rules import MegatronParallel
from ..adapters.vllm.rules import VllmParallel
from ..errors import ConfigError
from ..layout import ModelSpec
from . import (RECIPE, TINY_MODELS, check_world, load_recipe, lookup, read, read_mapping, read_section,
                       resolve_model, tiny_spec)
from .schema import (APPLY, MAX_BUFFER_BYTES, MIN_BUFFER_BYTES, PLACEMENTS, TRANSPORTS, VERIFY, RecipeLayout,
                              RefitConfig)
from .topology import TopologyConfig

__all__ = [
    "RefitConfig",
    "RecipeLayout",
    "dtensor_backend",
    "from_policy_config",
    "load_recipe_file",
    "TRANSPORTS",
    "VERIFY",
    "APPLY",
    "PLACEMENTS",
    "MIN_BUFFER_BYTES",
    "MAX_BUFFER_BYTES",
]

_M = "policy.megatron_cfg."
_V = "policy.generation.vllm_cfg."


def dtensor_backend(cfg: Mapping[str, Any]) -> bool:
    """Whether the policy is NeMo RL's DTensor backend (``policy.dtensor_cfg.enabled``) rather
    than Megatron-Core (``policy.megatron_cfg.enabled``): exactly one of them is on."""
    read_mapping(cfg, "policy")
    megatron = lookup(cfg, "policy.megatron_cfg") is not None and read(cfg, RECIPE.megatron_enabled)
    dtensor = lookup(cfg, "policy.dtensor_cfg") is not None and read(cfg, RECIPE.dtensor_enabled)
    if megatron and dtensor:
        raise ConfigError("policy.megatron_cfg.enabled=true and policy.dtensor_cfg.enabled=true: a policy has one "
                          "backend (turn one off)")
    if not (megatron or dtensor):
        raise ConfigError("policy.megatron_cfg.enabled or policy.dtensor_cfg.enabled must be true: mcore-reshard "
                          "refits from Megatron-Core or from a DTensor (FSDP2) policy")
    return dtensor


def _refit(cfg: Mapping[str, Any]) -> RefitConfig:
    """The policy backend's ``mcore_reshard`` section (``policy.megatron_cfg.mcore_reshard`` or
    ``policy.dtensor_cfg.mcore_reshard``), which must be on."""
    dtensor = dtensor_backend(cfg)
    section, enabled = (RECIPE.dtensor_refit, RECIPE.dtensor_refit_enabled) if dtensor else \
        (RECIPE.refit, RECIPE.refit_enabled)
    read_mapping(cfg, section.key, {})
    if not read(cfg, enabled):
        raise ConfigError(f"{enabled.key} is not true: mcore-reshard is off in this recipe")
    return read_section(cfg, section)


def _dtensor(cfg: Mapping[str, Any], world: int) -> DTensorParallel:
    """A DTensor policy's mesh from ``policy.dtensor_cfg`` (data parallel fills ``world``)."""
    tp = read(cfg, RECIPE.dtensor_tp)
    for field, what in ((RECIPE.dtensor_cp, "context parallelism"), (RECIPE.dtensor_sp, "sequence parallelism")):
        if read(cfg, field) not in (1, False):
            raise ConfigError(f"{field.key}={read(cfg, field)}: the DTensor policy here is FSDP2 x TP (NeMo RL's plan "
                              f"for a Qwen/Llama layer) without {what}")
    if world % tp:
        raise ConfigError(f"training world {world} (cluster minus generation GPUs) is not a multiple of "
                          f"policy.dtensor_cfg.tensor_parallel_size={tp}")
    return DTensorParallel(dp=world // tp, tp=tp)


def _model(cfg: Mapping[str, Any]) -> ModelSpec:
    """``policy.model_config`` (else ``policy.model_name``) at ``policy.precision``."""
    if lookup(cfg, RECIPE.model_config.key) is not None:
        f = RECIPE.model_config
    elif lookup(cfg, RECIPE.model_name.key) is not None:
        f = RECIPE.model_name
    else:
        raise ConfigError("recipe: policy.model_config is missing (a name under configs/models/, a HF config "
                          "path or a built-in tiny model such as tiny-moe), and so is policy.model_name")
    model_ref = read(cfg, f)
    precision = read(cfg, RECIPE.precision)
    if model_ref in TINY_MODELS:  # a built-in random-weight model of the local jobs ("tiny-moe")
        return tiny_spec(model_ref, precision)
    return resolve_model(model_ref, dtype=precision, what=f.key)


def _worlds(cfg: Mapping[str, Any]) -> tuple[int, int, bool]:
    """(training GPUs, generation GPUs, colocated): NeMo RL's split of ``cluster``."""
    gpn = read(cfg, RECIPE.gpus_per_node)
    gpus = gpn * read(cfg, RECIPE.num_nodes)
    backend = read(cfg, RECIPE.backend)
    if backend != "vllm":
        raise ConfigError(f"policy.generation.backend={backend!r}: mcore-reshard refits into vLLM")
    if read(cfg, RECIPE.colocated):  # NeMo RL's colocated mode: both sides share every GPU
        return gpus, gpus, True
    gen_gpn = read(cfg, RECIPE.generation_gpus_per_node)
    gen_nodes = read(cfg, RECIPE.generation_num_nodes)
    if gen_gpn > gpn:
        raise ConfigError(f"policy.generation.colocated.resources.gpus_per_node={gen_gpn} contradicts "
                          f"cluster.gpus_per_node={gpn}")
    gen_gpus = gen_gpn * gen_nodes
    if gpus - gen_gpus <= 0:
        raise ConfigError(f"policy.generation.colocated.resources ({gen_gpus} GPUs) leave no training GPUs of "
                          f"cluster.num_nodes*cluster.gpus_per_node={gpus}")
    return gpus - gen_gpus, gen_gpus, False


def _training(cfg: Mapping[str, Any], world: int) -> MegatronParallel:
    """Megatron-Core's sizes from ``policy.megatron_cfg`` (data parallel fills ``world``)."""
    tp, pp, cp = read(cfg, RECIPE.tp), read(cfg, RECIPE.pp), read(cfg, RECIPE.cp)
    if world % (tp * pp * cp):
        raise ConfigError(
            f"training world {world} (cluster minus generation GPUs) is not a multiple of "
            f"{_M}tensor_model_parallel_size*pipeline_model_parallel_size*context_parallel_size={tp * pp * cp}"
        )
    if read(cfg, RECIPE.use_custom_fsdp) and pp > 1:
        raise ConfigError(f"{_M}use_custom_fsdp=true with {_M}pipeline_model_parallel_size={pp}: megatron-core "
                          f"0.19.2's FSDP builds its device mesh over the whole world as dp_cp x ep x tp, so it does "
                          f"not compose with pipeline parallelism (Megatron-FSDP with pipeline_model_parallel_size={pp})")
    impl = read(cfg, RECIPE.transformer_impl)
    if impl not in ("transformer_engine", "local"):
        raise ConfigError(f"{_M}transformer_impl={impl!r} is not 'transformer_engine' or 'local'")
    return MegatronParallel(
        tp=tp, pp=pp, cp=cp, dp=world // (tp * pp * cp),
        ep=read(cfg, RECIPE.ep),
        etp=read(cfg, RECIPE.etp),
        vpp=read(cfg, RECIPE.vpp) or 1,
        first_stage_layers=read(cfg, RECIPE.first_stage_layers),
        last_stage_layers=read(cfg, RECIPE.last_stage_layers),
        make_vocab_size_divisible_by=read(cfg, RECIPE.make_vocab_size_divisible_by),
        layer_spec="te" if impl == "transformer_engine" else "local",
        experts="grouped" if read(cfg, RECIPE.moe_grouped_gemm) else "sequential",
        sequence_parallel=read(cfg, RECIPE.sequence_parallel),
        fsdp=read(cfg, RECIPE.use_custom_fsdp),
    )


def _vllm(cfg: Mapping[str, Any], gen_gpus: int) -> VllmParallel:
    """One engine's sizes from ``policy.generation.vllm_cfg``; engines fill ``gen_gpus``."""
    vtp, vpp, vdp = read(cfg, RECIPE.vllm_tp), read(cfg, RECIPE.vllm_pp), read(cfg, RECIPE.vllm_dp)
    per_engine = vtp * vpp * vdp
    if gen_gpus % per_engine:
        raise ConfigError(f"generation GPUs {gen_gpus} (policy.generation.colocated.resources) are not a multiple "
                          f"of one engine's {_V}tensor*pipeline*data_parallel_size={per_engine}")
    ep = read(cfg, RECIPE.vllm_ep)
    if ep > 1 and ep != vtp * vdp:
        raise ConfigError(f"{_V}expert_parallel_size={ep}: vLLM's expert parallelism spans "
                          f"data_parallel_size*tensor_parallel_size={vdp * vtp} ranks")
    return VllmParallel(tp=vtp, pp=vpp, dp=vdp, replicas=gen_gpus // per_engine, enable_ep=ep > 1,
                        num_redundant_experts=read(cfg, RECIPE.num_redundant_experts),
                        mm_encoder_tp_mode=read(cfg, RECIPE.mm_encoder_tp_mode),
                        quantization="fp8_per_block" if read(cfg, RECIPE.vllm_precision) == "fp8" else None)


def from_policy_config(cfg: Mapping[str, Any]) -> RecipeLayout:
    """Map a NeMo-RL-shaped GRPO config onto training / vLLM layouts and a refit config."""
    if not isinstance(cfg, Mapping):
        raise ConfigError(f"recipe: the top level is a {type(cfg).__name__}, not a mapping (policy:, cluster:, ...)")
    refit = _refit(cfg)
    spec = _model(cfg)
    train_world, gen_gpus, colocated = _worlds(cfg)
    if dtensor_backend(cfg):
        training: Any = _dtensor(cfg, train_world)
        if spec.moe_layers or spec.hybrid is not None or spec.mla is not None:
            raise ConfigError(f"policy.dtensor_cfg.enabled=true with {spec.name or spec.arch}: the DTensor policy "
                              f"here builds dense Qwen/Llama layers (NeMo RL's TP plan); MoE, MLA and hybrid "
                              f"models go through policy.megatron_cfg")
        if spec.dtype != "float32":
            raise ConfigError(f"policy.precision={spec.dtype!r} with policy.dtensor_cfg.enabled=true: the DTensor "
                              f"policy here trains in float32")
    else:
        training = _training(cfg, train_world)
    vllm = _vllm(cfg, gen_gpus)
    # Non-colocated NeMo RL: training fills its nodes, generation the nodes after them;
    # colocated: training rank i and inference rank i share GPU i.
    topology = TopologyConfig(gpus_per_node=read(cfg, RECIPE.gpus_per_node),
                              placement="colocated" if colocated else "separate")
    peft = read_section(cfg, RECIPE.peft)
    if peft.enabled and refit.transport != "reshard":
        raise ConfigError(f"policy.megatron_cfg.mcore_reshard.transport={refit.transport!r} with "
                          f"policy.megatron_cfg.peft.enabled=true: only the reshard transport refits a LoRA policy's "
                          f"adapter (the HF broadcast goes through vLLM's loader, which has no adapter path)")
    speculative = read_section(cfg, RECIPE.speculative)
    if isinstance(training, DTensorParallel) and (peft.enabled or speculative.method):
        raise ConfigError("policy.dtensor_cfg.enabled=true with a LoRA policy or an MTP draft: not built for the "
                          "DTensor policy here")
    if isinstance(training, MegatronParallel) and training.fsdp and (peft.enabled or speculative.method):
        what = "peft.enabled=true (a LoRA policy)" if peft.enabled else "an MTP draft (vllm_cfg.speculative_config)"
        raise ConfigError(f"{_M}use_custom_fsdp=true with {what}: Megatron-FSDP policies are built without "
                          f"LoRA adapters or an MTP block here; turn one of them off")
    return RecipeLayout(spec, training, vllm, refit, topology=topology, peft=peft if peft.enabled else None,
                        speculative=speculative if speculative.method else None)


def load_recipe_file(path: str | Path) -> RecipeLayout:
    """A GRPO recipe (NeMo RL shape) with ``policy.megatron_cfg.mcore_reshard`` on
    (``mcore-reshard plan --recipe``: the file as it is, no overrides)."""
    recipe = from_policy_config(load_recipe(path))
    check_world(recipe.training.world_size, recipe.vllm.world_size)
    return recipe
