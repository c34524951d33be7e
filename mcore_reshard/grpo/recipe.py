"""GRPO recipes: a NeMo-RL-shaped YAML file (plus ``a.b.c=value`` overrides) as one checked
:class:`GrpoRecipe`.

The layouts and the refit settings come from :func:`mcore_reshard.policy.from_policy_config`
(the same reading as ``mcore-reshard plan --recipe``); this module adds the loop's own
sections (``grpo``, ``loss_fn``, ``policy.generation``, ``env.target_tokens``, ``ray``) and the
checks that tie them together. Every bad setting raises
:class:`~mcore_reshard.errors.ConfigError` with one line naming the recipe key, before any
process starts: the loop can trust what it is given.
"""

from __future__ import annotations

import math
from dataclasses import MISSING, dataclass, fields
from pathlib import Path
from typing import Any, Mapping, Sequence

from ..adapters.megatron.rules import MegatronParallel
from ..adapters.vllm.rules import VllmParallel
from ..errors import ConfigError
from ..layout import ModelSpec
from ..policy import RefitConfig

__all__ = [
    "GrpoSettings",
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


def _check(ok: bool, msg: str) -> None:
    if not ok:
        raise ConfigError(msg)


def _finite(x: float) -> bool:
    return math.isfinite(x)


@dataclass(frozen=True)
class GrpoSettings:
    """``grpo:``: how many samples a step draws and how many steps run."""

    num_prompts_per_step: int
    #: >= 2: advantages are normalised within each prompt's group of samples.
    num_generations_per_prompt: int
    max_num_steps: int
    seed: int = 0
    normalize_rewards: bool = True
    use_leave_one_out_baseline: bool = False
    #: 0: never; N: every N-th step's refit runs with verify=full (a bitwise check of every tensor).
    verify_full_every_n_steps: int = 0

    def __post_init__(self) -> None:
        _check(self.num_prompts_per_step >= 1, f"grpo.num_prompts_per_step={self.num_prompts_per_step} must be >= 1")
        _check(self.num_generations_per_prompt >= 2,
               f"grpo.num_generations_per_prompt={self.num_generations_per_prompt} must be >= 2: group-normalised "
               f"advantages compare the samples of one prompt")
        _check(self.max_num_steps >= 1, f"grpo.max_num_steps={self.max_num_steps} must be >= 1")
        _check(0 <= self.seed < 2**63, f"grpo.seed={self.seed} must be in [0, 2**63)")
        _check(self.verify_full_every_n_steps >= 0,
               f"grpo.verify_full_every_n_steps={self.verify_full_every_n_steps} must be >= 0 (0: never)")

    @property
    def samples_per_step(self) -> int:
        return self.num_prompts_per_step * self.num_generations_per_prompt


@dataclass(frozen=True)
class LossSettings:
    """``loss_fn:``: NeMo RL's clipped-ratio policy loss with an optional KL to the reference."""

    reference_policy_kl_penalty: float = 0.0
    ratio_clip_min: float = 0.2
    ratio_clip_max: float = 0.2

    def __post_init__(self) -> None:
        k = self.reference_policy_kl_penalty
        _check(_finite(k) and k >= 0, f"loss_fn.reference_policy_kl_penalty={k!r} must be a finite number >= 0")
        for name in ("ratio_clip_min", "ratio_clip_max"):
            v = getattr(self, name)
            _check(_finite(v) and v >= 0, f"loss_fn.{name}={v!r} must be a finite number >= 0")
        _check(self.ratio_clip_min < 1,
               f"loss_fn.ratio_clip_min={self.ratio_clip_min!r} must be < 1 (the ratio is clipped at 1 - it)")


@dataclass(frozen=True)
class GenerationSettings:
    """``policy.generation`` sampling (``vllm_cfg`` / ``colocated`` are the layout's)."""

    max_new_tokens: int
    temperature: float = 1.0

    def __post_init__(self) -> None:
        _check(self.max_new_tokens >= 1, f"policy.generation.max_new_tokens={self.max_new_tokens} must be >= 1")
        t = self.temperature
        _check(_finite(t) and t > 0, f"policy.generation.temperature={t!r} must be a positive, finite number")


@dataclass(frozen=True)
class TaskSettings:
    """``env.target_tokens``: the built-in verifiable task. A prompt is ``prompt_length`` random
    token ids; the reward is the fraction of generated ids below ``round(vocab * target_fraction)``
    (learnable from any start, checkable without a tokenizer or a data set)."""

    prompt_length: int = 8
    target_fraction: float = 0.125

    def __post_init__(self) -> None:
        _check(self.prompt_length >= 1, f"env.target_tokens.prompt_length={self.prompt_length} must be >= 1")
        f = self.target_fraction
        _check(_finite(f) and 0 < f < 1, f"env.target_tokens.target_fraction={f!r} must be in (0, 1)")

    def target_ids(self, vocab: int) -> int:
        """Token ids ``0 <= t < target_ids(vocab)`` are rewarded."""
        return round(vocab * self.target_fraction)


@dataclass(frozen=True)
class ClusterSettings:
    """``cluster:``: nodes x device slots (GPUs; CPU slots for a local run)."""

    num_nodes: int
    gpus_per_node: int

    @property
    def slots(self) -> int:
        return self.num_nodes * self.gpus_per_node


@dataclass(frozen=True)
class RaySettings:
    """``ray:`` (ours, not NeMo RL's): where the Ray cluster comes from."""

    #: None: start an embedded local cluster; "auto" or "host:port": join a running one.
    address: str | None = None
    #: Embedded cluster only: logical CPUs (None: enough for the job).
    num_cpus: int | None = None

    def __post_init__(self) -> None:
        _check(self.address is None or bool(self.address.strip()),
               "ray.address='' is empty: null starts a local cluster, 'auto' or 'host:port' joins one")
        _check(self.num_cpus is None or self.num_cpus >= 1, f"ray.num_cpus={self.num_cpus} must be >= 1")
        _check(self.num_cpus is None or self.address is None,
               f"ray.num_cpus={self.num_cpus} contradicts ray.address={self.address!r}: num_cpus sizes an embedded "
               f"cluster only")


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
    task: TaskSettings
    cluster: ClusterSettings
    ray: RaySettings
    lr: float  # policy.megatron_cfg.optimizer.lr
    log_dir: str  # logger.log_dir
    colocated: bool  # policy.generation.colocated.enabled
    #: None if this recipe runs on this CPU machine; else one line why not.
    local_problem: str | None

    @property
    def checkpoint_family(self) -> str | None:
        """The ``mcore_reshard.checkpoint`` family of a built-in tiny model, else None."""
        from ..config import TINY_MODELS

        return TINY_MODELS.get(self.model)


# --------------------------------------------------------------------------- overrides

#: Dotted keys a plain override (``a.b=v``) may set even when the recipe file lacks them:
#: the keys this loader reads. Anything else must exist in the file or be added with ``+a.b=v``,
#: so a typo is an error instead of a setting nobody reads.
KNOWN_KEYS: frozenset[str] = frozenset(
    [f"grpo.{f.name}" for f in fields(GrpoSettings)]
    + [f"loss_fn.{f.name}" for f in fields(LossSettings)]
    + [f"policy.generation.{f.name}" for f in fields(GenerationSettings)]
    + [f"env.target_tokens.{f.name}" for f in fields(TaskSettings)]
    + [f"ray.{f.name}" for f in fields(RaySettings)]
    + [f"cluster.{f.name}" for f in fields(ClusterSettings)]
    + [f"policy.megatron_cfg.mcore_reshard.{f.name}" for f in fields(RefitConfig)]
    + ["policy.model_name", "policy.model_config", "policy.precision", "logger.log_dir",
       "policy.megatron_cfg.enabled", "policy.megatron_cfg.optimizer.lr", "policy.megatron_cfg.transformer_impl",
       "policy.megatron_cfg.moe_grouped_gemm", "policy.megatron_cfg.sequence_parallel",
       "policy.megatron_cfg.make_vocab_size_divisible_by", "policy.generation.backend",
       "policy.generation.colocated.enabled", "policy.generation.colocated.resources.num_nodes",
       "policy.generation.colocated.resources.gpus_per_node"]
    + [f"policy.megatron_cfg.{k}_parallel_size" for k in
       ("tensor_model", "pipeline_model", "context", "expert_model", "expert_tensor", "virtual_pipeline_model")]
    + ["policy.megatron_cfg.num_layers_in_first_pipeline_stage", "policy.megatron_cfg.num_layers_in_last_pipeline_stage"]
    + [f"policy.generation.vllm_cfg.{k}" for k in
       ("tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size", "expert_parallel_size",
        "num_redundant_experts")]
)


def apply_overrides(data: Mapping[str, Any], overrides: Sequence[str]) -> dict:
    """``data`` with each ``a.b.c=value`` set (values parsed as YAML: ``3`` is an int, ``null``
    is None, ``${x.y}`` an interpolation resolved later). A key must be in the recipe or in
    :data:`KNOWN_KEYS`; ``+a.b.c=value`` adds a key the recipe does not have (Hydra's rule)."""
    import copy

    import yaml

    out = copy.deepcopy(dict(data))
    for o in overrides:
        add = o.startswith("+")
        key, sep, raw = (o[1:] if add else o).partition("=")
        parts = key.strip().split(".")
        if not sep or not all(p.strip() for p in parts):
            raise ConfigError(f"override {o!r} is not key.path=value (e.g. grpo.max_num_steps=3)")
        key = ".".join(p.strip() for p in parts)
        try:
            value = yaml.safe_load(raw)
        except yaml.YAMLError as exc:
            from ..protocol import one_line

            raise ConfigError(f"override {o!r}: the value is not YAML: {one_line(exc)}") from None
        node = out
        for i, p in enumerate(parts[:-1]):
            p = p.strip()
            here = ".".join(parts[: i + 1])
            if node.get(p) is None and (add or key in KNOWN_KEYS):
                node[p] = {}
            elif p not in node:
                raise ConfigError(f"unknown setting {key}: the recipe has no {here} (add it with +{key}=...)")
            if not isinstance(node[p], dict):
                raise ConfigError(f"override {o!r}: {here} is a {type(node[p]).__name__}, not a mapping")
            node = node[p]
        leaf = parts[-1].strip()
        if add and leaf in node:
            raise ConfigError(f"{key} is already a setting: drop the '+' (+{key}=...)")
        if not add and leaf not in node and key not in KNOWN_KEYS:
            raise ConfigError(f"unknown setting {key}: the recipe has no such key (add it with +{key}=...)")
        node[leaf] = value
    return out


# --------------------------------------------------------------------------- sections


def _node(cfg: Mapping[str, Any], path: str) -> Any:
    """``cfg[a][b]...``, None where a key is missing or null (a non-mapping on the way is named)."""
    node: Any = cfg
    seen: list[str] = []
    for key in path.split("."):
        if node is None:
            return None
        if not isinstance(node, Mapping):
            raise ConfigError(f"recipe: {'.'.join(seen)} is a {type(node).__name__}, not a mapping")
        seen.append(key)
        node = node.get(key)
    return node


def _section(cfg: Mapping[str, Any], path: str, cls: type, *, required: bool,
             only: Sequence[str] | None = None) -> Any:
    """``cls`` from the mapping at ``path``: unknown keys (unless ``only`` picks the keys to
    read), missing required fields and wrong types are named as ``<path>.<key>``."""
    from ..config import build_dataclass

    node = _node(cfg, path)
    if node is None:
        if required:
            raise ConfigError(f"recipe: {path} is missing")
        node = {}
    if not isinstance(node, Mapping):
        raise ConfigError(f"recipe: {path} is a {type(node).__name__}, not a mapping")
    data = dict(node)
    if only is not None:
        data = {k: data[k] for k in only if data.get(k) is not None}
    for f in fields(cls):
        if f.default is MISSING and f.default_factory is MISSING and data.get(f.name) is None:
            raise ConfigError(f"recipe: {path}.{f.name} is missing")
    return build_dataclass(cls, data, path)


def _positive_float(cfg: Mapping[str, Any], path: str) -> float:
    from ..config import check_type

    value = _node(cfg, path)
    if value is None:
        raise ConfigError(f"recipe: {path} is missing")
    value = check_type(path, value, float)
    _check(_finite(value) and value > 0, f"{path}={value!r} must be a positive, finite number")
    return value


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
    need = training.etp_size * training.ep * training.pp
    if (training.tp * training.cp * training.dp) % (training.etp_size * training.ep):
        raise ConfigError(
            f"cluster.num_nodes*cluster.gpus_per_node={cluster.slots} minus {vllm.world_size} generation slots leaves "
            f"a training world of {training.world_size}, not a multiple of policy.megatron_cfg.expert_model_parallel_size"
            f"*expert_tensor_parallel_size*pipeline_model_parallel_size={need} (cluster too small for training + "
            f"generation?)"
        )


def _local_problem(model: str, dtype: str, impl: str, training: MegatronParallel, vllm: VllmParallel) -> str | None:
    """Why this recipe cannot run on this CPU machine (the limits of ``mcore-reshard refit``)."""
    from ..config import LOCAL_DTYPES, TINY_MODELS, is_checkpoint_dir, local_cpu_problem

    v = "policy.generation.vllm_cfg."
    problem = local_cpu_problem(training, vllm, labels={
        "layer_spec": f"policy.megatron_cfg.transformer_impl={impl!r}",
        "experts": "policy.megatron_cfg.moe_grouped_gemm=true",
        "vllm_pp_dp": f"{v}pipeline_parallel_size={vllm.pp}, {v}data_parallel_size={vllm.dp}",
        "enable_ep": f"{v}expert_parallel_size={vllm.tp * vllm.dp}",
    })
    if problem is not None:
        return problem
    if dtype not in LOCAL_DTYPES:
        return f"policy.precision={dtype!r}: the local CPU job trains and serves in {list(LOCAL_DTYPES)}"
    if model not in TINY_MODELS and not is_checkpoint_dir(model):
        return (f"policy.model_name={model!r} is neither one of {list(TINY_MODELS)} nor a local HF checkpoint "
                f"directory (config.json + *.safetensors): plan it with --dry-run")
    return None


# --------------------------------------------------------------------------- loading


def load_grpo_recipe(path: str | Path, overrides: Sequence[str] = ()) -> GrpoRecipe:
    """The recipe at ``path`` with ``overrides`` applied, every setting checked.

    Reads the file, applies the overrides, resolves ``${...}`` interpolations, maps the
    policy onto layouts with ``from_policy_config`` and checks the GRPO sections; starts
    nothing and writes nothing. Raises ``ConfigError`` (one line naming the key).
    """
    from ..config import TINY_MODELS, _check_world, check_type, is_checkpoint_dir, read_recipe_file, resolve_recipe
    from ..policy import from_policy_config

    what = f"recipe {str(path)!r}"
    raw = apply_overrides(read_recipe_file(path, what), overrides)
    cfg = resolve_recipe(raw, what)
    layout = from_policy_config(cfg)
    training, vllm = layout.training, layout.vllm
    _check_world(training.world_size, vllm.world_size)

    grpo = _section(cfg, "grpo", GrpoSettings, required=True)
    loss = _section(cfg, "loss_fn", LossSettings, required=False)
    generation = _section(cfg, "policy.generation", GenerationSettings, required=True,
                          only=[f.name for f in fields(GenerationSettings)])
    env = _node(cfg, "env") or {}
    if not isinstance(env, Mapping):
        raise ConfigError(f"recipe: env is a {type(env).__name__}, not a mapping")
    unknown = sorted(str(k) for k in env if k != "target_tokens")
    if unknown:
        raise ConfigError(f"unknown environment(s) {', '.join(f'env.{k}' for k in unknown)}: this loop has only "
                          f"env.target_tokens")
    task = _section(cfg, "env.target_tokens", TaskSettings, required=False)
    ray = _section(cfg, "ray", RaySettings, required=False)
    cluster = _section(cfg, "cluster", ClusterSettings, required=True, only=["num_nodes", "gpus_per_node"])
    lr = _positive_float(cfg, "policy.megatron_cfg.optimizer.lr")
    log_dir = check_type("logger.log_dir", _node(cfg, "logger.log_dir") or f"results/{Path(path).stem}", str)

    r = "policy.generation.colocated.resources."
    colocated = bool(_node(cfg, "policy.generation.colocated.enabled"))
    if not colocated:  # colocated: both sides on every GPU (from_policy_config checked the sizes)
        _check_placement(cluster, _node(cfg, r + "num_nodes"), _node(cfg, r + "gpus_per_node"), training, vllm)
    spec = layout.spec
    n = task.target_ids(spec.vocab)
    _check(1 <= n < spec.vocab, f"env.target_tokens.target_fraction={task.target_fraction!r} rewards {n} of the "
                                f"{spec.vocab} token ids: it must reward at least one and not all")
    ctx = (spec.hf_config or {}).get("max_position_embeddings")
    if isinstance(ctx, int) and task.prompt_length + generation.max_new_tokens > ctx:
        raise ConfigError(f"env.target_tokens.prompt_length={task.prompt_length} + policy.generation.max_new_tokens="
                          f"{generation.max_new_tokens} exceeds the model's max_position_embeddings={ctx}")
    if grpo.samples_per_step % training.dp:
        raise ConfigError(f"grpo.num_prompts_per_step*num_generations_per_prompt={grpo.samples_per_step} samples "
                          f"do not split evenly over the {training.dp} training data-parallel ranks")

    model = _node(cfg, "policy.model_name") or _node(cfg, "policy.model_config")
    model = check_type("policy.model_name", model, str)
    stand_in = _node(cfg, "policy.model_config")
    if stand_in is not None and stand_in != model and (model in TINY_MODELS or is_checkpoint_dir(model)):
        # the spec comes from model_config, the weights the loop loads from model_name
        raise ConfigError(f"policy.model_config={stand_in!r} contradicts policy.model_name={model!r}: a local model "
                          f"describes itself (drop policy.model_config)")
    impl = _node(cfg, "policy.megatron_cfg.transformer_impl") or "transformer_engine"
    return GrpoRecipe(
        path=str(path), model=model, spec=spec, dtype=spec.dtype, training=training, vllm=vllm,
        refit=layout.refit, grpo=grpo, loss=loss, generation=generation, task=task, cluster=cluster, ray=ray,
        lr=lr, log_dir=log_dir, colocated=colocated,
        local_problem=_local_problem(model, spec.dtype, impl, training, vllm),
    )
