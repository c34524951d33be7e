"""GRPO recipes: a NeMo-RL-shaped YAML file (plus ``a.b.c=value`` overrides) as one checked
:class:`GrpoRecipe`.

The layouts and the refit settings come from :func:`mcore_reshard.settings.policy.from_policy_config`
(the same reading as ``mcore-reshard plan --recipe``); this module adds the loop's own
sections (``grpo``, ``loss_fn``, ``policy.generation``, ``env.target_tokens``, ``ray``; declared
with the rest in ``settings.schema.RecipeKeys``) and the checks that tie them together. Every
bad setting raises :class:`~mcore_reshard.errors.ConfigError` with one line naming the recipe
key, before any process starts: the loop can trust what it is given.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Mapping, Sequence

from ...adapters.megatron.rules import MegatronParallel
from ...adapters.vllm.rules import VllmParallel
from ...errors import ConfigError
from ...layout import ModelSpec
from ...layout.lora import PeftConfig
from ...settings.policy import dtensor_backend, from_policy_config
from ...settings import (KNOWN_KEYS, LOCAL_DTYPES, RECIPE, TINY_MODELS, AsyncGrpoSettings, ClusterSettings,
                        ColourTaskSettings, GenerationSettings, GrpoSettings, LossSettings, RaySettings, RefitConfig,
                        TaskSettings,
                        apply_overrides, check_type, check_world, is_checkpoint_dir, load_recipe, local_cpu_problem,
                        local_train_problem, lookup, read, read_section)

__all__ = [
    "GrpoSettings",
    "AsyncGrpoSettings",
    "LossSettings",
    "GenerationSettings",
    "TaskSettings",
    "ClusterSettings",
    "RaySettings",
    "GrpoRecipe",
    "load_grpo_recipe",
    "apply_overrides",
    "KNOWN_KEYS",
]


@dataclass(frozen=True)
class GrpoRecipe:
    """One GRPO run, every setting checked (see :func:`load_grpo_recipe`)."""

    path: str
    #: ``policy.model_name``: a TINY_MODELS key ("tiny-moe"), a local HF checkpoint directory,
    #: or a hub name (plan-only: ``local_problem`` says so).
    model: str
    spec: ModelSpec  # at policy.precision
    dtype: str  # policy.precision
    training: MegatronParallel
    vllm: VllmParallel  # vllm.replicas = number of engines
    refit: RefitConfig  # policy.megatron_cfg.mcore_reshard
    grpo: GrpoSettings
    loss: LossSettings
    generation: GenerationSettings
    task: "TaskSettings | ColourTaskSettings"  # env.target_tokens | env.colour_squares
    cluster: ClusterSettings
    ray: RaySettings
    lr: float  # policy.megatron_cfg.optimizer.lr
    log_dir: str  # logger.log_dir
    colocated: bool  # policy.generation.colocated.enabled
    #: ``policy.generation.vllm_cfg.async_engine``: engines run vLLM's AsyncLLM in async actors.
    async_engine: bool
    async_grpo: AsyncGrpoSettings  # grpo.async_grpo
    #: None if this recipe runs on this CPU machine; else one line why not.
    local_problem: str | None
    #: ``policy.megatron_cfg.peft``: a LoRA policy (None: every weight trains).
    peft: PeftConfig | None = None
    #: ``policy.generation.vllm_cfg.speculative_config``: the engines draft with the model's MTP
    #: layers, which train and refit with it in one vote (None: no draft).
    speculative: Any = None
    #: ``policy.megatron_cfg.freeze_vision_model`` / ``freeze_vision_projection``: a
    #: vision-language policy's frozen parts (its refits move them once).
    freeze_vision_model: bool = False
    freeze_vision_projection: bool = False

    @property
    def frozen(self) -> frozenset[str]:
        """The tensors this policy never trains (its refits after the first leave them out)."""
        return self.spec.frozen_tensors(self.freeze_vision_model, self.freeze_vision_projection)

    @property
    def checkpoint_family(self) -> str | None:
        """The ``mcore_reshard.infra.checkpoint`` family of a built-in tiny model, else None."""
        return TINY_MODELS.get(self.model)


# --------------------------------------------------------------------------- checks


def _check_placement(cluster: ClusterSettings, gen_nodes: int, gen_gpn: int, training: MegatronParallel,
                     vllm: VllmParallel) -> None:
    """NeMo RL's split of a non-colocated cluster: one node is shared (training takes the
    slots generation leaves), several nodes are split whole; and the training world that is
    left must hold the expert-parallel group (else the cluster is too small)."""
    r = "policy.generation.colocated.resources"
    if cluster.num_nodes == 1 and gen_nodes != 1:
        raise ConfigError(f"{r}.num_nodes={gen_nodes} contradicts cluster.num_nodes=1: on one node generation "
                          f"takes {r}.gpus_per_node slots of it (set {r}.num_nodes=1)")
    if cluster.num_nodes > 1 and gen_gpn != cluster.gpus_per_node:
        raise ConfigError(f"{r}.gpus_per_node={gen_gpn} contradicts cluster.gpus_per_node={cluster.gpus_per_node}: "
                          f"on a multi-node cluster generation takes whole nodes ({r}.num_nodes of them)")
    if not isinstance(training, MegatronParallel):  # a DTensor policy: any world is a mesh of it
        return
    need = training.etp_size * training.ep * training.pp
    if (training.tp * training.cp * training.dp) % (training.etp_size * training.ep):
        raise ConfigError(
            f"cluster.num_nodes*cluster.gpus_per_node={cluster.slots} minus {vllm.world_size} generation slots leaves "
            f"a training world of {training.world_size}, not a multiple of policy.megatron_cfg.expert_model_parallel_size"
            f"*expert_tensor_parallel_size*pipeline_model_parallel_size={need} (cluster too small for training + "
            f"generation?)"
        )


def _lora_problem(peft: PeftConfig | None, spec: ModelSpec) -> str | None:
    """Why this machine cannot serve a LoRA policy's engine (None: it can)."""
    if peft is None or not spec.moe_layers:
        return None
    return ("policy.megatron_cfg.peft.enabled=true on a MoE model: vLLM 0.32's CPU build cannot run an engine with "
            "LoRA on a MoE model (its MoE LoRA path needs Triton); the adapter refits plan (mcore-reshard plan "
            "--recipe prints their bytes)")


def _local_problem(model: str, dtype: str, impl: str, training: MegatronParallel, vllm: VllmParallel) -> str | None:
    """Why this recipe cannot run on this CPU machine (the limits of ``mcore-reshard refit``)."""
    v = "policy.generation.vllm_cfg."
    if not isinstance(training, MegatronParallel):  # a DTensor policy: the megatron stack's limits do not apply
        training = MegatronParallel(dp=training.world_size)
    problem = local_cpu_problem(training, replace(vllm, quantization=None), labels={
        "layer_spec": f"policy.megatron_cfg.transformer_impl={impl!r}",
        "experts": "policy.megatron_cfg.moe_grouped_gemm=true",
        "vllm_pp_dp": f"{v}pipeline_parallel_size={vllm.pp}, {v}data_parallel_size={vllm.dp}",
        "enable_ep": f"{v}expert_parallel_size={vllm.tp * vllm.dp}",
    })
    if problem is not None:
        return problem
    if vllm.quantization is not None:  # on every CPU: never a bf16 engine in its place
        return (f"{v}precision=fp8: the local GRPO run does not start FP8 engines yet (its rollout check's bound is "
                f"bf16's); refits into a live FP8 engine run through `mcore-reshard refit vllm.quantization="
                f"{vllm.quantization}`, the refit driver and vLLM's trainer API; --dry-run plans this recipe")
    if dtype not in LOCAL_DTYPES:
        return f"policy.precision={dtype!r}: the local CPU job trains and serves in {list(LOCAL_DTYPES)}"
    if model not in TINY_MODELS and not is_checkpoint_dir(model):
        return (f"policy.model_name={model!r} is neither one of {list(TINY_MODELS)} nor a local HF checkpoint "
                f"directory (config.json + *.safetensors): plan it with --dry-run")
    return None


# --------------------------------------------------------------------------- loading


def _loop_settings(cfg: Mapping[str, Any], path: str | Path) -> dict[str, Any]:
    """The GRPO loop's own sections, its learning rate and log directory."""
    grpo = read_section(cfg, RECIPE.grpo)
    loss = read_section(cfg, RECIPE.loss)
    generation = read_section(cfg, RECIPE.generation)
    env = lookup(cfg, "env") or {}
    if not isinstance(env, Mapping):
        raise ConfigError(f"recipe: env is a {type(env).__name__}, not a mapping")
    unknown = sorted(str(k) for k in env if k not in ("target_tokens", "colour_squares"))
    if unknown:
        raise ConfigError(f"unknown environment(s) {', '.join(f'env.{k}' for k in unknown)}: this loop has "
                          f"env.target_tokens and env.colour_squares")
    if "target_tokens" in env and "colour_squares" in env:
        raise ConfigError("env.target_tokens and env.colour_squares: a run has one task (keep one)")
    task = read_section(cfg, RECIPE.colour_task if "colour_squares" in env else RECIPE.task)
    ray = read_section(cfg, RECIPE.ray)
    async_grpo = read_section(cfg, RECIPE.async_grpo)
    cluster = read_section(cfg, RECIPE.cluster)
    lr_key = RECIPE.dtensor_lr if dtensor_backend(cfg) else RECIPE.lr  # NeMo RL's optimizer of each backend
    lr = read(cfg, lr_key)
    if not (math.isfinite(lr) and lr > 0):
        raise ConfigError(f"{lr_key.key}={lr!r} must be a positive, finite number")
    log_dir = check_type(RECIPE.log_dir.key, lookup(cfg, RECIPE.log_dir.key) or f"results/{Path(path).stem}", str)
    return dict(grpo=grpo, async_grpo=async_grpo, loss=loss, generation=generation, task=task, ray=ray,
                cluster=cluster, lr=lr, log_dir=log_dir)


def _check_async(s: Mapping[str, Any], colocated: bool, async_engine: bool, refit: RefitConfig) -> RefitConfig:
    """NeMo RL's rules for asynchronous GRPO; returns the refit with its KV policy."""
    a, loss = s["async_grpo"], s["loss"]
    k, v = "grpo.async_grpo.", "policy.generation.vllm_cfg.async_engine"
    if a.in_flight_weight_updates and not async_engine:
        raise ConfigError(f"{k}in_flight_weight_updates=true needs {v}=true: a synchronous engine cannot generate "
                          f"while its weights are updated")
    if not a.enabled:
        if a.in_flight_weight_updates:
            raise ConfigError(f"{k}in_flight_weight_updates=true needs {k}enabled=true: synchronous GRPO generates "
                              f"nothing while it refits")
        return refit
    if colocated:
        raise ConfigError(f"{k}enabled=true with policy.generation.colocated.enabled=true: colocated trainers and "
                          f"engines share devices, so generation cannot run while the policy trains")
    if not async_engine:
        raise ConfigError(f"{k}enabled=true needs {v}=true: the next step's requests must run while this step "
                          f"refits, which only vLLM's AsyncLLM allows")
    if not loss.use_importance_sampling_correction:
        raise ConfigError(f"{k}enabled=true needs loss_fn.use_importance_sampling_correction=true: samples of an "
                          f"older policy version are off-policy for the step that trains on them")
    recompute = a.recompute_kv_cache_after_weight_updates
    if refit.recompute_kv_cache_after_weight_updates and not recompute:
        raise ConfigError(f"policy.megatron_cfg.mcore_reshard.recompute_kv_cache_after_weight_updates=true "
                          f"contradicts {k}recompute_kv_cache_after_weight_updates=false (set one)")
    return replace(refit, recompute_kv_cache_after_weight_updates=recompute)


def _check_step(s: Mapping[str, Any], spec: ModelSpec, training: MegatronParallel) -> None:
    """The task, the sequence length and the batch against the model and the training layout."""
    task, generation, grpo = s["task"], s["generation"], s["grpo"]
    env = "env.target_tokens"
    if isinstance(task, ColourTaskSettings):
        env = "env.colour_squares"
        if spec.vision is None:
            raise ConfigError(f"env.colour_squares: its prompts carry images, and {spec.family.title} "
                              f"({spec.name or spec.arch}) has no vision tower (a vision-language policy: tiny-llava)")
        if s["async_grpo"].enabled:
            raise ConfigError("env.colour_squares with grpo.async_grpo.enabled=true: asynchronous GRPO with images "
                              "is not built (synchronous GRPO is)")
    else:
        n = task.target_ids(spec.vocab)
        if not 1 <= n < spec.vocab:
            raise ConfigError(f"env.target_tokens.target_fraction={task.target_fraction!r} rewards {n} of the "
                              f"{spec.vocab} token ids: it must reward at least one and not all")
    ctx = (spec.hf_config or {}).get("max_position_embeddings") or \
        (spec.hf_config.get("text_config") or {}).get("max_position_embeddings")
    length = task.prompt_length + (getattr(spec.vision, "patches", 0) if env.endswith("squares") else 0)
    if isinstance(ctx, int) and length + generation.max_new_tokens > ctx:
        raise ConfigError(f"{env}.prompt_length={task.prompt_length} + policy.generation.max_new_tokens="
                          f"{generation.max_new_tokens} exceeds the model's max_position_embeddings={ctx}")
    if grpo.samples_per_step % training.dp:
        raise ConfigError(f"grpo.num_prompts_per_step*num_generations_per_prompt={grpo.samples_per_step} samples "
                          f"do not split evenly over the {training.dp} training data-parallel ranks")


def _freeze(cfg: Mapping[str, Any], spec: ModelSpec) -> dict[str, bool]:
    """``freeze_vision_model`` / ``freeze_vision_projection``, refused in one line on a text model."""
    out = {"freeze_vision_model": read(cfg, RECIPE.freeze_vision_model),
           "freeze_vision_projection": read(cfg, RECIPE.freeze_vision_projection)}
    if any(out.values()) and spec.vision is None:
        key = RECIPE.freeze_vision_model.key if out["freeze_vision_model"] else RECIPE.freeze_vision_projection.key
        raise ConfigError(f"{key}=true: {spec.family.title} ({spec.name or spec.arch}) has no vision tower to freeze")
    return out


def _weights(cfg: Mapping[str, Any]) -> str:
    """The model the loop loads weights from: ``policy.model_name`` (``model_config`` only
    describes a hub model's shapes; a local model describes itself)."""
    name, stand_in = RECIPE.model_name.key, lookup(cfg, RECIPE.model_config.key)
    model = check_type(name, lookup(cfg, name) or stand_in, str)
    if stand_in is not None and stand_in != model and (model in TINY_MODELS or is_checkpoint_dir(model)):
        raise ConfigError(f"policy.model_config={stand_in!r} contradicts policy.model_name={model!r}: a local model "
                          f"describes itself (drop policy.model_config)")
    return model


def load_grpo_recipe(path: str | Path, overrides: Sequence[str] = ()) -> GrpoRecipe:
    """The recipe at ``path`` with ``overrides`` applied, every setting checked.

    Reads the file, applies the overrides, resolves ``${...}`` interpolations, maps the
    policy onto layouts with ``from_policy_config`` and checks the GRPO sections; starts
    nothing and writes nothing. Raises ``ConfigError`` (one line naming the key).
    """
    cfg = load_recipe(path, overrides, what=f"recipe {str(path)!r}")
    layout = from_policy_config(cfg)
    training, vllm, spec = layout.training, layout.vllm, layout.spec
    check_world(training.world_size, vllm.world_size)
    s = _loop_settings(cfg, path)
    r = "policy.generation.colocated.resources."
    colocated = read(cfg, RECIPE.colocated)  # the same field and default as from_policy_config
    async_engine = read(cfg, RECIPE.async_engine)
    refit = _check_async(s, colocated, async_engine, layout.refit)
    if not colocated:  # colocated: both sides on every GPU (from_policy_config checked the sizes)
        _check_placement(s["cluster"], lookup(cfg, r + "num_nodes"), lookup(cfg, r + "gpus_per_node"), training, vllm)
    _check_step(s, spec, training)
    model = _weights(cfg)
    impl = "local" if dtensor_backend(cfg) else read(cfg, RECIPE.transformer_impl)
    return GrpoRecipe(path=str(path), model=model, spec=spec, dtype=spec.dtype, training=training, vllm=vllm,
                      refit=refit, colocated=colocated, async_engine=async_engine, **s,
                      local_problem=_lora_problem(layout.peft, spec) or local_train_problem(spec, model)
                      or _local_problem(model, spec.dtype, impl, training, vllm),
                      peft=layout.peft, speculative=layout.speculative, **_freeze(cfg, spec))
