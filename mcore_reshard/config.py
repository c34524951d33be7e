"""Hydra configs of the CLI: compose ``configs/<command>.yaml`` with command-line overrides
and turn the result into the typed objects the library takes.

Every bad setting -- a key the config does not have, a value of the wrong type, a size out of
range, a layout the rules or the planner reject -- raises before anything starts or is written:
:class:`~mcore_reshard.errors.ConfigError` for settings, ``LayoutError`` / ``PlanError`` for
layouts (all three are ``ValueError``; the CLI prints each as one ``error:`` line, exit 2).

* :func:`load_plan` / :func:`load_recipe_file`: the ``RecipeLayout`` of ``mcore-reshard plan``;
* :func:`load_refit_job`: the validated :class:`RefitJob` of ``mcore-reshard refit``;
* :func:`plan_layouts`: both layouts from the rules and the plan, with the same checks.
"""

from __future__ import annotations

import enum
import math
import os
import types
import typing
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Mapping, Sequence

from .adapters.megatron.rules import MegatronParallel
from .adapters.vllm.rules import VllmParallel
from .errors import ConfigError
from .layout import DTYPE_BYTES, LayoutError, ModelSpec, SideLayout, load_model_spec
from .policy import RecipeLayout, RefitConfig
from .protocol import one_line as _one_line

__all__ = [
    "CONFIG_DIR",
    "ConfigError",
    "compose",
    "check_type",
    "resolve_model",
    "build_dataclass",
    "recipe_from_config",
    "load_plan",
    "load_recipe_file",
    "read_recipe_file",
    "resolve_recipe",
    "local_cpu_problem",
    "is_checkpoint_dir",
    "plan_layouts",
    "RefitJob",
    "load_refit_job",
    "TINY_MODELS",
    "LOCAL_DTYPES",
    "MAX_WORLD",
    "MAX_LOCAL_PROCESSES",
    "MAX_PLAN_TRANSFERS",
]

#: Top-level ``configs/`` of the repository (override with MCORE_RESHARD_CONFIG_DIR).
CONFIG_DIR = Path(os.environ.get("MCORE_RESHARD_CONFIG_DIR", Path(__file__).resolve().parents[1] / "configs"))

#: Built-in random-weight models of the local job -> their family in ``mcore_reshard.checkpoint``
#: (written by the job at run time; here only their spec is built, from the same config dict).
TINY_MODELS: dict[str, str] = {"tiny-moe": "qwen3_moe", "tiny-dense": "qwen3", "tiny-llama": "llama",
                               "tiny-qwen2": "qwen2", "tiny-deepseek-v3": "deepseek_v3"}
#: Dtypes the local CPU job can train and serve in.
LOCAL_DTYPES = ("float32", "bfloat16")  # what the CPU training stack builds (TrainSettings)
#: Ranks per side the metadata planner describes. Layouts are built rank by rank in memory
#: (about 1.6k pieces per rank for a large MoE), so a typo such as ``training.dp=100000000``
#: would exhaust memory; 4096 is 16x the largest layout benchmarked (256 ranks).
MAX_WORLD = 4096
#: Trainer processes + vLLM workers the local job may start on this machine.
MAX_LOCAL_PROCESSES = 32
#: Transfers a plan may hold. The planner cuts every piece into bucket-sized transfers, so
#: their number is at least (bytes each destination receives / bucket); each costs about 1 KB
#: of plan memory (Qwen3-30B-A3B: 304k transfers, 0.3 GB) and one message per refit. 2M is 6x
#: the largest plan benchmarked (328k); beyond it a ``refit.buffer_bytes`` too small for the
#: model would take gigabytes to plan (the default plan with 64 KiB buffers: 15M transfers).
MAX_PLAN_TRANSFERS = 2_000_000

_MINIMUM: dict[type, dict[str, int]] = {
    MegatronParallel: dict(tp=1, pp=1, ep=1, etp=1, cp=1, dp=1, vpp=1, first_stage_layers=0, last_stage_layers=0,
                           make_vocab_size_divisible_by=1, vocab_padded=1),
    VllmParallel: dict(tp=1, pp=1, dp=1, replicas=1, num_redundant_experts=0),
}
_CHOICES: dict[type, dict[str, tuple[str, ...]]] = {
    MegatronParallel: dict(layer_spec=("local", "te"), experts=("sequential", "grouped")),
    VllmParallel: dict(expert_placement=("linear", "round_robin")),
}


# --------------------------------------------------------------------------- Hydra


def _hydra_message(exc: BaseException, config_name: str, overrides: Sequence[str]) -> str:
    import re

    text = f"{exc}\n{exc.__cause__ or ''}"
    m = re.search(r"Could not override '([^']+)'", text)
    if m and "not in struct" in text:
        return f"unknown setting {m.group(1)}: configs/{config_name}.yaml has no such key"
    m = re.search(r"An item is already at '([^']+)'", text)
    if m:
        return f"{m.group(1)} is already a setting: drop the '+' (+{m.group(1)}=...)"
    if type(exc).__name__ == "OverrideParseException":
        from hydra.core.override_parser.overrides_parser import OverridesParser

        parser = OverridesParser.create()
        for o in overrides:  # name the override hydra could not parse
            try:
                parser.parse_overrides([o])
            except Exception as inner:  # noqa: BLE001
                return f"cannot parse override {o!r}: {_one_line(inner)}"
    return f"configs/{config_name}.yaml: {_one_line(exc)}"


def _check_keys(cfg: Any, base: Any, prefix: str, config_name: str, open_sections: Sequence[str]) -> None:
    """Keys added with ``+`` that the YAML does not have, and keys removed with ``~``."""
    from omegaconf import DictConfig

    for key in cfg:
        path = f"{prefix}{key}"
        if key not in base:
            if prefix.rstrip(".") in open_sections:
                continue  # a dataclass section: build_dataclass names unknown fields
            raise ConfigError(f"unknown setting {path}: configs/{config_name}.yaml has no such key "
                              f"(known here: {sorted(str(k) for k in base)})")
        if isinstance(cfg[key], DictConfig) and isinstance(base[key], DictConfig):
            _check_keys(cfg[key], base[key], path + ".", config_name, open_sections)
    for key in base:
        if key != "defaults" and key not in cfg:
            path = f"{prefix}{key}"
            raise ConfigError(f"{path} was removed (~{path}): configs/{config_name}.yaml needs every key it lists")


def compose(config_name: str, overrides: Sequence[str] = (), *, open_sections: Sequence[str] = ()) -> Any:
    """Hydra compose (struct mode: an unknown key is an error, not a silent no-op).

    A key added with ``+`` must exist in the YAML too, except inside ``open_sections`` (the
    sections :func:`build_dataclass` turns into a dataclass, which names unknown fields).
    """
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from omegaconf import OmegaConf

    path = CONFIG_DIR / f"{config_name}.yaml"
    try:
        with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base=None):
            cfg = hydra_compose(config_name=config_name, overrides=list(overrides))
        base = OmegaConf.load(path)
    except Exception as exc:  # noqa: BLE001 - hydra/omegaconf errors are bad input
        if type(exc).__module__.split(".")[0] in ("hydra", "omegaconf", "yaml"):
            raise ConfigError(_hydra_message(exc, config_name, overrides)) from None
        raise
    OmegaConf.set_struct(cfg, True)
    _container(cfg, f"configs/{config_name}.yaml")  # interpolations resolve, or the key is named
    _check_keys(cfg, base, "", config_name, open_sections)
    return cfg


def _container(node: Any, what: str) -> Any:
    """A plain dict / list / value from an OmegaConf node (interpolations resolved)."""
    from omegaconf import DictConfig, ListConfig, OmegaConf

    if isinstance(node, (DictConfig, ListConfig)):
        try:
            return OmegaConf.to_container(node, resolve=True)
        except Exception as exc:  # noqa: BLE001 - interpolation errors are bad input
            key = getattr(exc, "full_key", None)
            raise ConfigError(f"{what}: {key + ': ' if key else ''}{_one_line(exc)}") from None
    return node


# --------------------------------------------------------------------------- types


def _describe(tp: Any) -> str:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        named = [_describe(a) for a in args if a is not type(None)]
        return " or ".join(named) + (" or null" if type(None) in args else "")
    if tp is bool:
        return "a boolean (true or false)"
    if tp is int:
        return "an integer"
    if tp is float:
        return "a number"
    if tp is str:
        return "a string"
    if origin in (tuple, list, Sequence):
        inner = args[0] if args else Any
        return f"a list of {_describe(inner).split(' ', 1)[-1]}s" if inner is not Any else "a list"
    if origin in (dict, Mapping):
        return "a mapping"
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return f"one of {[m.value for m in tp]}"
    return getattr(tp, "__name__", str(tp))


def check_type(key: str, value: Any, tp: Any) -> Any:
    """``value`` checked against the annotation ``tp`` (and normalised: lists to tuples where
    the annotation says tuple, ints to floats where it says float, strings to enums); raises
    ``ConfigError`` naming ``key``, e.g. ``training.tp='two' is not an integer``.

    Ints must be ints (not bools, strings or floats), bools must be bools, floats may be ints.
    """
    if tp is Any or tp is object:
        return value
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if value is None:
            if type(None) in args:
                return None
            raise ConfigError(f"{key}=null is not {_describe(tp)}")
        options = [a for a in args if a is not type(None)]
        errors = []
        for a in options:
            try:
                return check_type(key, value, a)
            except ConfigError as exc:
                errors.append(exc)
        if len(errors) == 1:
            raise errors[0]
        raise ConfigError(f"{key}={value!r} is not {_describe(tp)}")
    if value is None:
        raise ConfigError(f"{key}=null is not {_describe(tp)}")
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        if isinstance(value, tp):
            return value
        parse = getattr(tp, "parse", None)
        if parse is not None:
            return parse(value, key)
        try:
            return tp(value)
        except ValueError:
            raise ConfigError(f"{key}={value!r} is not {_describe(tp)}") from None
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{key}={value!r} is not {_describe(tp)}")
        return value
    if tp is int:
        if not isinstance(value, int) or isinstance(value, bool):
            raise ConfigError(f"{key}={value!r} is not an integer")
        return value
    if tp is float:
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            raise ConfigError(f"{key}={value!r} is not a number")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{key}={value!r} is not a string")
        return value
    if origin in (tuple, list, Sequence):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{key}={value!r} is not {_describe(tp)}")
        if origin is tuple and args and not (len(args) == 2 and args[1] is Ellipsis):
            if len(value) != len(args):
                raise ConfigError(f"{key}={value!r} must have {len(args)} entries")
            items = [check_type(f"{key}[{i}]", v, a) for i, (v, a) in enumerate(zip(value, args))]
        else:
            inner = args[0] if args else Any
            items = [check_type(f"{key}[{i}]", v, inner) for i, v in enumerate(value)]
        return list(items) if origin is list else tuple(items)
    if origin in (dict, Mapping):
        if not isinstance(value, Mapping):
            raise ConfigError(f"{key}={value!r} is not a mapping")
        kt, vt = args if len(args) == 2 else (Any, Any)
        return {check_type(f"{key} key", k, kt): check_type(f"{key}.{k}", v, vt) for k, v in value.items()}
    if isinstance(tp, type) and not isinstance(value, tp):
        raise ConfigError(f"{key}={value!r} is not a {tp.__name__}")
    return value


def build_dataclass(cls: type, section: Any, what: str) -> Any:
    """``cls(**section)``: unknown keys and every value's type (against ``cls``'s annotations)
    checked and named as ``<what>.<key>``; sizes below their minimum and unknown choices of
    ``MegatronParallel`` / ``VllmParallel`` are named too."""
    data = _container(section, what)
    if not isinstance(data, Mapping):
        raise ConfigError(f"{what}={data!r} is not a mapping of settings")
    names = [f.name for f in fields(cls) if f.init]
    unknown = sorted(str(k) for k in set(data) - set(names))
    if unknown:
        raise ConfigError(f"unknown setting(s) {', '.join(f'{what}.{k}' for k in unknown)}; {what} takes {names}")
    hints = typing.get_type_hints(cls)
    kwargs = {k: check_type(f"{what}.{k}", v, hints[k]) for k, v in data.items()}
    for name, low in _MINIMUM.get(cls, {}).items():
        value = kwargs.get(name)
        if value is not None and value < low:
            raise ConfigError(f"{what}.{name}={value} must be >= {low}")
    for name, allowed in _CHOICES.get(cls, {}).items():
        if name in kwargs and kwargs[name] not in allowed:
            raise ConfigError(f"{what}.{name}={kwargs[name]!r} is not one of {list(allowed)}")
    try:
        return cls(**kwargs)
    except (ConfigError, LayoutError):
        raise
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{what}: {_one_line(exc)}") from None


# --------------------------------------------------------------------------- models


def _check_dtype(dtype: Any, key: str = "dtype", allowed: Sequence[str] | None = None) -> str:
    allowed = sorted(DTYPE_BYTES) if allowed is None else list(allowed)
    dtype = check_type(key, dtype, str)
    if dtype not in allowed:
        raise ConfigError(f"{key}={dtype!r} is not one of {allowed}")
    return dtype


def resolve_model(ref: str, dtype: str | None = None, *, what: str = "model") -> ModelSpec:
    """A model name under ``configs/models/`` or a path to a HF config (file or directory)."""
    if not isinstance(ref, str) or not ref:
        raise ConfigError(f"{what}={ref!r} is not a model name or a path")
    if dtype is not None:
        _check_dtype(dtype)
    candidate = CONFIG_DIR / "models" / f"{ref}.json"
    path = candidate if candidate.is_file() else Path(ref)
    if not path.exists():
        known = sorted(p.stem for p in (CONFIG_DIR / "models").glob("*.json"))
        raise ConfigError(f"{what}={ref!r} is neither a file nor one of {known}")
    return _load_spec(path, dtype, what, ref)


def _load_spec(path: Path, dtype: str | None, what: str, ref: str) -> ModelSpec:
    try:
        return load_model_spec(path, dtype=dtype)
    except KeyError as exc:
        raise ConfigError(f"{what}={ref!r}: the HF config has no {exc.args[0]!r}") from None
    except (LayoutError, OSError, UnicodeDecodeError, ValueError, TypeError, AttributeError) as exc:
        raise ConfigError(f"{what}={ref!r}: {_one_line(exc)}") from None


# --------------------------------------------------------------------------- plan


def recipe_from_config(cfg: Any) -> RecipeLayout:
    """The ``RecipeLayout`` of a composed ``configs/plan.yaml``."""
    data = _container(cfg, "configs/plan.yaml")
    dtype = check_type("dtype", data.get("dtype"), str | None)
    if dtype is not None:
        _check_dtype(dtype)
    model = check_type("model", data.get("model"), str)
    vllm_model = check_type("vllm_model", data.get("vllm_model"), str | None)
    training = build_dataclass(MegatronParallel, data.get("training"), "training")
    vllm = build_dataclass(VllmParallel, data.get("vllm"), "vllm")
    refit = build_dataclass(RefitConfig, data.get("refit"), "refit")
    _check_world(training.world_size, vllm.world_size)
    spec = resolve_model(model, dtype=dtype)
    vllm_spec = resolve_model(vllm_model, dtype=dtype, what="vllm_model") if vllm_model else None
    from .plan.topology import TopologyConfig

    topology = build_dataclass(TopologyConfig, data.get("topology"), "topology")
    return RecipeLayout(spec, training, vllm, refit, vllm_spec, topology)


def load_plan(overrides: Sequence[str] = ()) -> RecipeLayout:
    """``configs/plan.yaml`` + overrides, every setting checked (``mcore-reshard plan``)."""
    return recipe_from_config(compose("plan", overrides, open_sections=("training", "vllm", "refit", "topology")))


def read_recipe_file(path: str | Path, what: str | None = None) -> dict:
    """A recipe file as a plain dict, interpolations not yet resolved (so overrides can be
    applied first); ``what`` names the file in errors (default ``--recipe 'PATH'``)."""
    import yaml

    what = what or f"--recipe {str(path)!r}"
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"{what}: " + ("a directory, not a file" if p.is_dir() else "no such file"))
    try:
        loaded = yaml.safe_load(p.read_text())
    except (yaml.YAMLError, UnicodeDecodeError, OSError) as exc:
        raise ConfigError(f"{what} is not YAML: {_one_line(exc)}") from None
    if not isinstance(loaded, Mapping):
        kind = "empty" if loaded is None else f"a {type(loaded).__name__}"
        raise ConfigError(f"{what}: the top level is {kind}, not a mapping (policy:, cluster:, ...)")
    return dict(loaded)


def resolve_recipe(loaded: Mapping[str, Any], what: str) -> dict:
    """``loaded`` with its ``${...}`` interpolations resolved (NeMo RL recipes use them)."""
    from omegaconf import OmegaConf

    try:
        node = OmegaConf.create(dict(loaded))
    except Exception as exc:  # noqa: BLE001 - e.g. non-string keys
        raise ConfigError(f"{what}: {_one_line(exc)}") from None
    return _container(node, what)


def load_recipe_file(path: str | Path) -> RecipeLayout:
    """A GRPO recipe (NeMo RL shape) with ``policy.megatron_cfg.mcore_reshard`` on."""
    from .policy import from_policy_config

    what = f"--recipe {str(path)!r}"
    recipe = from_policy_config(resolve_recipe(read_recipe_file(path, what), what))
    _check_world(recipe.training.world_size, recipe.vllm.world_size)
    return recipe


def _check_world(training_world: int, vllm_world: int) -> None:
    for side, world in (("training", training_world), ("vllm", vllm_world)):
        if world > MAX_WORLD:
            raise ConfigError(f"{side} world of {world} ranks: the planner describes at most {MAX_WORLD} ranks "
                              f"per side (check the {side}.* sizes)")


def _min_transfers(dst: SideLayout, bucket_bytes: int) -> int:
    """A lower bound of the plan's transfers: every destination piece is cut into buckets."""
    n = 0
    for p in dst.params:
        itemsize = DTYPE_BYTES.get(p.dtype, 1)
        for piece in p.pieces:
            n += -(-piece.box.numel * itemsize // bucket_bytes)
    return n


def plan_layouts(spec: ModelSpec, training: MegatronParallel, vllm: VllmParallel, refit: RefitConfig,
                 vllm_spec: ModelSpec | None = None):
    """(training layout, vLLM layout, plan) from metadata alone: what the rules or the planner
    reject raises here (``LayoutError`` prefixed with the side, ``PlanError``, ``ConfigError``)."""
    from .adapters.megatron.rules import megatron_layout
    from .adapters.vllm.rules import vllm_layout
    from .plan import get_plan

    _check_world(training.world_size, vllm.world_size)
    try:
        src = megatron_layout(spec, training)
    except LayoutError as exc:
        raise LayoutError(f"training layout: {_one_line(exc)}") from None
    try:
        dst = vllm_layout(vllm_spec or spec, vllm)
    except LayoutError as exc:
        raise LayoutError(f"vllm layout: {_one_line(exc)}") from None
    n = _min_transfers(dst, refit.bucket_bytes)
    if n > MAX_PLAN_TRANSFERS:
        raise ConfigError(
            f"refit.buffer_bytes={refit.buffer_bytes} is too small for this model and layout: buckets of "
            f"{refit.bucket_bytes} bytes cut the refit into >= {n} transfers (at most {MAX_PLAN_TRANSFERS})"
        )
    plan = get_plan(src, dst, bucket_bytes=refit.bucket_bytes, allow_cast=refit.allow_cast)
    return src, dst, plan


# --------------------------------------------------------------------------- refit job


@dataclass(frozen=True)
class RefitJob:
    """``mcore-reshard refit``'s job, every field checked (``configs/refit.yaml``).

    ``src`` / ``dst`` / ``plan`` are the layouts and plan predicted by the rules (the running
    job plans again from what both sides describe; these prove the settings can be planned).
    """

    model: str  # a key of TINY_MODELS ("tiny-moe", "tiny-dense", ...) | a HF checkpoint directory
    spec: ModelSpec
    dtype: str
    seed: int
    training: MegatronParallel
    vllm: VllmParallel
    refit: RefitConfig
    steps: int  # optimizer steps between the two refits (>= 1)
    lr: float
    tokens: tuple[int, ...]  # each 0 <= t < spec.vocab
    compare_hf: bool
    workdir: Path | None  # where the tiny checkpoint goes (None: a temp dir)
    #: The HF checkpoint directory; None for the built-in tiny models (written at run time).
    checkpoint: Path | None = None
    src: SideLayout | None = field(default=None, repr=False, compare=False)
    dst: SideLayout | None = field(default=None, repr=False, compare=False)
    plan: Any = field(default=None, repr=False, compare=False)

    @property
    def tiny(self) -> bool:
        return self.model in TINY_MODELS


def _tiny_spec(model: str, dtype: str) -> ModelSpec:
    """The spec of a built-in tiny model from its config dict: no file is written."""
    from .layout import spec_from_hf_config

    try:
        from .checkpoint import tiny_config
    except ImportError:  # older layout: the dicts live in testing.tiny
        from .testing.tiny import TINY_DENSE, TINY_MOE

        if model not in ("tiny-moe", "tiny-dense"):
            raise ConfigError(f"model={model!r}: this checkout has only tiny-moe and tiny-dense") from None
        cfg = dict(TINY_MOE if model == "tiny-moe" else TINY_DENSE)
    else:
        cfg = tiny_config(TINY_MODELS[model])
    return spec_from_hf_config(cfg, dtype=dtype, name=model)


def local_cpu_problem(training: MegatronParallel, vllm: VllmParallel, *,
                      labels: Mapping[str, str] | None = None) -> str | None:
    """The first thing of these layouts the local CPU job cannot run (one line), or None.

    One place for the local job's limits, shared by ``mcore-reshard refit`` and GRPO recipes.
    ``labels`` spell the settings the caller's config uses (``layer_spec``, ``experts``,
    ``vllm_pp_dp``, ``enable_ep``); the defaults are ``configs/refit.yaml``'s keys.
    """
    names = {
        "layer_spec": f"training.layer_spec={training.layer_spec!r}",
        "experts": f"training.experts={training.experts!r}",
        "vllm_pp_dp": f"vllm.pp={vllm.pp}, vllm.dp={vllm.dp}: vllm.pp/vllm.dp > 1",
        "enable_ep": "vllm.enable_ep=true",
        **(labels or {}),
    }
    if training.layer_spec != "local":
        return (f"{names['layer_spec']}: the local CPU job builds megatron-core's local layer spec "
                f"(Transformer Engine needs a GPU)")
    if training.experts != "sequential":
        return (f"{names['experts']}: the local CPU job runs sequential experts "
                f"(grouped GEMM needs Transformer Engine and a GPU)")
    if vllm.pp != 1 or vllm.dp != 1:
        return f"{names['vllm_pp_dp']}: one engine per replica with pp=dp=1 runs on this machine"
    if vllm.enable_ep:
        return (f"{names['enable_ep']}: vLLM's CPU fused-MoE kernel segfaults on an expert-parallel "
                f"forward; the local job runs the experts under TP")
    procs = training.world_size + vllm.world_size
    if procs > MAX_LOCAL_PROCESSES:
        return (f"training world {training.world_size} + vllm world {vllm.world_size} = {procs} processes: "
                f"the local job starts at most {MAX_LOCAL_PROCESSES} on this machine")
    return None


def is_checkpoint_dir(path: str | Path) -> bool:
    """A HF checkpoint directory the local job can load: config.json + *.safetensors."""
    p = Path(path)
    return (p / "config.json").is_file() and any(p.glob("*.safetensors"))


def load_refit_job(overrides: Sequence[str] = ()) -> RefitJob:
    """``configs/refit.yaml`` + overrides as a validated :class:`RefitJob`.

    Checks everything ``plan`` checks (types, sizes, both layouts from the rules, the plan)
    and the local job's limits; starts no process and writes no file.
    """
    cfg = compose("refit", overrides, open_sections=("training", "vllm", "refit"))
    data = _container(cfg, "configs/refit.yaml")
    model = check_type("model", data.get("model"), str)
    dtype = _check_dtype(data.get("dtype"), "dtype", LOCAL_DTYPES)
    seed = check_type("seed", data.get("seed"), int)
    if not 0 <= seed < 2**63:
        raise ConfigError(f"seed={seed} must be in [0, 2**63)")
    training = build_dataclass(MegatronParallel, data.get("training"), "training")
    vllm = build_dataclass(VllmParallel, data.get("vllm"), "vllm")
    refit = build_dataclass(RefitConfig, data.get("refit"), "refit")
    if not refit.enabled:
        raise ConfigError("refit.enabled is false: nothing to run")
    job = data.get("job")
    if not isinstance(job, Mapping):
        raise ConfigError(f"job={job!r} is not a mapping of settings")
    steps = check_type("job.steps", job.get("steps"), int)
    if steps < 1:
        raise ConfigError(f"job.steps={steps}: the job takes at least one optimizer step between its refits")
    lr = check_type("job.lr", job.get("lr"), float)
    if not (math.isfinite(lr) and lr > 0):
        raise ConfigError(f"job.lr={lr!r} must be a positive, finite number")
    tokens = check_type("job.tokens", job.get("tokens"), tuple[int, ...])
    if not tokens:
        raise ConfigError("job.tokens is empty: the logprob check needs at least one token id")
    compare_hf = check_type("job.compare_hf", job.get("compare_hf"), bool)
    workdir_s = check_type("job.workdir", job.get("workdir"), str | None)
    workdir = Path(workdir_s) if workdir_s else None
    if workdir is not None and workdir.exists() and not workdir.is_dir():
        raise ConfigError(f"job.workdir={workdir_s!r} exists and is not a directory")

    problem = local_cpu_problem(training, vllm)  # the rules and the planner accept more
    if problem is not None:
        raise ConfigError(problem)

    checkpoint: Path | None = None
    if model in TINY_MODELS:
        spec = _tiny_spec(model, dtype)
    else:
        checkpoint = Path(model)
        if not is_checkpoint_dir(checkpoint):
            raise ConfigError(f"model={model!r} is neither one of {list(TINY_MODELS)} nor a HF checkpoint "
                              f"directory (config.json + *.safetensors)")
        spec = _load_spec(checkpoint, dtype, "model", model)
    for i, t in enumerate(tokens):
        if not 0 <= t < spec.vocab:
            raise ConfigError(f"job.tokens[{i}]={t} is out of range: token ids are 0 <= t < {spec.vocab} "
                              f"(vocab of {model})")
    src, dst, plan = plan_layouts(spec, training, vllm, refit)
    return RefitJob(model=model, spec=spec, dtype=dtype, seed=seed, training=training, vllm=vllm, refit=refit,
                    steps=steps, lr=lr, tokens=tokens, compare_hf=compare_hf, workdir=workdir,
                    checkpoint=checkpoint, src=src, dst=dst, plan=plan)
