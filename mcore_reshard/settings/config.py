"""The CLI's jobs from its Hydra configs: ``configs/<command>.yaml`` + command-line overrides
read through the settings schema (``settings``) into the typed objects the library takes, and
planned once.

Every bad setting -- a key the config does not have, a value of the wrong type, a size out of
range, a layout the rules or the planner reject -- raises before anything starts or is written:
:class:`~mcore_reshard.errors.ConfigError` for settings, ``LayoutError`` / ``PlanError`` for
layouts (all three are ``ValueError``; the CLI prints each as one ``error:`` line, exit 2).

* :func:`load_plan`: the ``RecipeLayout`` of ``mcore-reshard plan`` (``policy.load_recipe_file``
  reads ``--recipe``), :func:`plan_recipe` its one plan;
* :func:`load_refit_job`: the validated :class:`RefitJob` of ``mcore-reshard refit``;
* :func:`side_layouts` / :func:`plan_layouts`: both layouts from the rules (and the plan), checked.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any, Mapping, Sequence

from ..adapters.megatron.lora_rules import megatron_lora_layout
from ..adapters.megatron.mtp_rules import megatron_mtp_rank_params
from ..adapters.vllm.mtp_rules import vllm_draft_rank_params
from ..adapters.megatron.rules import MegatronParallel, megatron_layout
from ..adapters.vllm.lora_rules import vllm_lora_layout
from ..adapters.vllm.rules import VllmParallel, vllm_layout
from ..layout import DTYPE_BYTES, LayoutError, ModelSpec, SideLayout, dtensor_report, dtensor_summary
from ..layout.mtp import draft_tensors, with_draft
from ..layout.quant import fp8_sides
from ..plan import check_sides, get_plan, plan_report
from ..plan.cache import derived_from, get_layouts
from ..plan.planner import gc_paused
from ..plan.report import PlanReport, format_bytes
from ..plan.placed import PlacementReport, placement_report, plan_for_placement
from ..wire.protocol import one_line
from .models import megatron_build_problem
from . import (CONFIG_DIR, LOCAL_DTYPES, MAX_LOCAL_PROCESSES, MAX_PLAN_TRANSFERS, MAX_WORLD, PLAN_CONFIG,
                       REFIT_CONFIG, TINY_MODELS, ConfigError, RecipeLayout, RefitConfig, build_dataclass, check_type,
                       check_world, compose, container, is_checkpoint_dir, load_config, load_spec, local_cpu_problem,
                       local_train_problem, read, read_recipe_file, read_section, resolve_model, resolve_recipe, sections, tiny_spec)

__all__ = [
    "CONFIG_DIR",
    "ConfigError",
    "compose",
    "check_type",
    "resolve_model",
    "build_dataclass",
    "recipe_from_config",
    "load_plan",
    "read_recipe_file",
    "resolve_recipe",
    "local_cpu_problem",
    "is_checkpoint_dir",
    "side_layouts",
    "plan_layouts",
    "plan_from_recipe",
    "PlannedRecipe",
    "plan_recipe",
    "RefitJob",
    "load_refit_job",
    "TINY_MODELS",
    "LOCAL_DTYPES",
    "MAX_WORLD",
    "MAX_LOCAL_PROCESSES",
    "MAX_PLAN_TRANSFERS",
]


# --------------------------------------------------------------------------- plan


def recipe_from_config(cfg: Any) -> RecipeLayout:
    """The ``RecipeLayout`` of a composed ``configs/plan.yaml``."""
    data = container(cfg, "configs/plan.yaml")
    k = PLAN_CONFIG
    dtype, model, vllm_model = read(data, k.dtype), read(data, k.model), read(data, k.vllm_model)
    training, vllm, refit = read_section(data, k.training), read_section(data, k.vllm), read_section(data, k.refit)
    check_world(training.world_size, vllm.world_size)
    spec = resolve_model(model, dtype=dtype)
    vllm_spec = resolve_model(vllm_model, dtype=dtype, what="vllm_model") if vllm_model else None
    peft = read_section(data, k.peft)
    speculative = read_section(data, k.speculative)
    return RecipeLayout(spec, training, vllm, refit, vllm_spec, read_section(data, k.topology),
                        peft if peft.enabled else None, speculative if speculative.method else None)


def load_plan(overrides: Sequence[str] = ()) -> RecipeLayout:
    """``configs/plan.yaml`` + overrides, every setting checked (``mcore-reshard plan``)."""
    return recipe_from_config(compose("plan", overrides, open_sections=sections(PLAN_CONFIG)))


def _min_transfers(dst: SideLayout, bucket_bytes: int) -> int:
    """A lower bound of the plan's transfers: every destination piece is cut into buckets."""
    n = 0
    for p in dst.params:
        itemsize = DTYPE_BYTES.get(p.dtype, 1)
        for piece in p.pieces:
            n += -(-piece.box.numel * itemsize // bucket_bytes)
    return n


def side_layouts(spec: ModelSpec, training: MegatronParallel, vllm: VllmParallel, refit: RefitConfig,
                 vllm_spec: ModelSpec | None = None) -> tuple[SideLayout, SideLayout]:
    """(training layout, vLLM layout) from metadata alone, checked as plannable: what the rules
    or the planner reject raises here (``LayoutError`` prefixed with the side, ``PlanError``,
    ``ConfigError``), before a placement is checked or a plan is made."""
    with gc_paused():  # the rules make an object or three per piece, ~300k of them, and free none
        return _side_layouts(spec, training, vllm, refit, vllm_spec)


def _side_layouts(spec: ModelSpec, training: MegatronParallel, vllm: VllmParallel, refit: RefitConfig,
                  vllm_spec: ModelSpec | None) -> tuple[SideLayout, SideLayout]:
    check_world(training.world_size, vllm.world_size)
    # the rules are pure: the same settings give the same layouts (and a plan or report cached
    # by their identity is found again without re-digesting ~300k pieces)
    src, dst = get_layouts((spec, training, vllm_spec or spec, vllm), lambda: _rule_layouts(spec, training, vllm,
                                                                                             vllm_spec))
    n = _min_transfers(dst, refit.bucket_bytes)
    if n > MAX_PLAN_TRANSFERS:
        raise ConfigError(
            f"refit.buffer_bytes={refit.buffer_bytes} is too small for this model and layout: buckets of "
            f"{refit.bucket_bytes} bytes cut the refit into >= {n} transfers (at most {MAX_PLAN_TRANSFERS})"
        )
    try:
        sent, dst_in, _ = fp8_sides(src, dst)  # into an FP8 engine: the senders quantize (as the planner does)
    except LayoutError as exc:
        raise LayoutError(f"training layout: {one_line(exc)}") from None
    check_sides(sent, dst_in, allow_cast=refit.allow_cast)  # the planner's first check, named before the placement's
    return src, dst


def training_layout(spec: ModelSpec, training: Any) -> SideLayout:
    """The training side's layout from its sizes: megatron-core's rules, or a DTensor policy's."""
    from ..adapters.dtensor.parallel import DTensorParallel

    if isinstance(training, DTensorParallel):
        from ..adapters.dtensor.rules import dtensor_layout

        return dtensor_layout(spec, training)
    return megatron_layout(spec, training)


def _rule_layouts(spec: ModelSpec, training: MegatronParallel, vllm: VllmParallel,
                  vllm_spec: ModelSpec | None) -> tuple[SideLayout, SideLayout]:
    try:
        src = training_layout(spec, training)
    except LayoutError as exc:
        raise LayoutError(f"training layout: {one_line(exc)}") from None
    try:
        dst = vllm_layout(vllm_spec or spec, vllm)
    except LayoutError as exc:
        raise LayoutError(f"vllm layout: {one_line(exc)}") from None
    return src, dst


def plan_layouts(spec: ModelSpec, training: MegatronParallel, vllm: VllmParallel, refit: RefitConfig,
                 vllm_spec: ModelSpec | None = None):
    """(training layout, vLLM layout, direct plan) from metadata alone (see :func:`side_layouts`)."""
    src, dst = side_layouts(spec, training, vllm, refit, vllm_spec)
    return src, dst, get_plan(src, dst, bucket_bytes=refit.bucket_bytes, allow_cast=refit.allow_cast)


def plan_from_recipe(recipe: RecipeLayout):
    """(training layout, vLLM layout, direct plan) of ``recipe`` (no placement)."""
    return plan_layouts(recipe.spec, recipe.training, recipe.vllm, recipe.refit, recipe.vllm_spec)


@dataclass(frozen=True)
class PlannedRecipe:
    """A recipe's layouts and the one plan its refits run: on its placement where it has a
    topology (fan-out relays where they help), else direct. What ``mcore-reshard plan`` prints."""

    recipe: RecipeLayout
    src: SideLayout
    dst: SideLayout
    plan: Any  # TransferPlan
    report: PlanReport
    placed: PlacementReport | None
    #: A LoRA policy's adapter refit (every refit after the first): its plan's report.
    lora: PlanReport | None = None

    @cached_property
    def forms(self) -> dict[str, dict[str, Any]]:
        """side -> {tensor: its DTensor form}: worked out when first printed (every tensor of
        both sides: a tenth of a full-size command), once for the table and the JSON alike."""
        with gc_paused():  # ~300k pieces walked, a few objects each: nothing to collect
            return {"training": dtensor_report(self.src), "vllm": dtensor_report(self.dst)}

    def destination(self) -> dict[str, Any]:
        """What ``bytes_min`` counts: every rank of every engine. ``vllm.replicas`` independent
        engines (default 8 in ``configs/plan.yaml``, kept when ``vllm.dp``/``pp``/``tp`` are
        overridden), each of ``dp x pp x tp`` ranks (``vllm.dp`` is vLLM's data_parallel_size
        inside one engine, not a count of engines); the engines hold the same layout, so one
        engine's minimum is ``bytes_min / replicas``."""
        v = self.recipe.vllm
        return {"engines": v.replicas, "ranks_per_engine": v.dp * v.pp * v.tp, "ranks": self.dst.world_size,
                "bytes_min_per_engine": self.report.bytes_min // v.replicas,
                "bytes_min_counts": "every destination rank of every engine, summed "
                                    "(vllm.replicas x vllm.dp x vllm.pp x vllm.tp ranks)"}

    def to_json(self, dtensor_forms: bool = False) -> dict:
        out = self.report.to_json()
        out["destination"] = self.destination()
        if self.placed is not None:
            out.update(self.placed.to_json())
        out["dtensor"] = {side: dtensor_summary(r) for side, r in self.forms.items()}
        if dtensor_forms:
            out["dtensor_forms"] = self.forms
        if self.lora is not None:
            out["lora"] = self.lora_json()
        if self.recipe.speculative is not None:
            out["draft"] = self.draft_json()
        return out

    def draft_json(self) -> dict:
        """The MTP draft's part of the refit (its bytes at every destination rank)."""
        sp = self.recipe.speculative
        draft = draft_tensors(self.recipe.vllm_spec or self.recipe.spec)
        held = held_bytes(self.dst, draft)
        return {"method": sp.method, "num_speculative_tokens": sp.num_speculative_tokens, "tensors": len(draft),
                "bytes_min": held, "fraction_of_refit": held / self.report.bytes_min}

    def lora_json(self) -> dict:
        """The adapter refit against the full one (the first refit of a LoRA policy)."""
        p, rep = self.recipe.peft, self.lora
        assert p is not None and rep is not None
        return {"dim": p.dim, "alpha": p.alpha, "modules": list(p.modules), "slot": p.slot,
                "max_lora_rank": p.engine_rank, "max_loras": p.max_loras, "bytes_min": rep.bytes_min,
                "bytes_planned": rep.bytes_planned, "num_transfers": rep.num_transfers,
                "fraction_of_full_refit": rep.bytes_min / self.report.bytes_min, "digest": rep.digest}

    def table(self, dtensor_forms: bool = False) -> str:
        spec = self.recipe.spec
        title = f"refit plan: {spec.name} ({spec.dtype}), training {self.src.name} -> vLLM {self.dst.name}"
        d, v = self.destination(), self.recipe.vllm
        lines = [self.report.table(title),
                 f"vLLM ranks: {d['engines']} engine(s) (vllm.replicas) x {d['ranks_per_engine']} rank(s) each "
                 f"(dp={v.dp} x pp={v.pp} x tp={v.tp}); theoretical minimum per engine "
                 f"{format_bytes(d['bytes_min_per_engine'])}",
                 *(self.placed.lines() if self.placed is not None else ())]
        for side, r in self.forms.items():
            lines.append(f"{side} {dtensor_summary(r)}")
            if dtensor_forms:
                lines.extend(f"  {name}: {form}" for name, form in r.items())
        if self.recipe.speculative is not None:
            j = self.draft_json()
            lines.append(f"mtp draft (speculative_config.method={j['method']}, {j['num_speculative_tokens']} token(s)): "
                         f"{j['tensors']} tensors, {format_bytes(j['bytes_min'])} of the refit's minimum "
                         f"({100 * j['fraction_of_refit']:.2f} %), moved and voted on with the target")
        if self.lora is not None:
            j = self.lora_json()
            lines.append(f"lora adapter refits (every refit after the first): r={j['dim']} alpha={j['alpha']:g} on "
                         f"{', '.join(j['modules'])} into slot {j['slot']} of max_loras={j['max_loras']}: "
                         f"{format_bytes(j['bytes_min'])} at the minimum, {100 * j['fraction_of_full_refit']:.3f} % "
                         f"of a full refit ({j['num_transfers']} transfers)")
        return "\n".join(lines)


def plan_recipe(recipe: RecipeLayout) -> PlannedRecipe:
    """Plan ``recipe`` once (``mcore-reshard plan``)."""
    with gc_paused():  # layouts, plan, reports and DTensor forms: nothing of it to collect
        return _plan_recipe(recipe)


def _plan_recipe(recipe: RecipeLayout) -> PlannedRecipe:
    # The adapter's plan first: it is small, and a LoRA policy the rules cannot describe is
    # refused in one line before seconds of full-size planning.
    lora = lora_report(recipe)
    src, dst = side_layouts(recipe.spec, recipe.training, recipe.vllm, recipe.refit, recipe.vllm_spec)
    if recipe.speculative is not None:  # the MTP draft: the same refit, the same vote
        src, dst = with_drafts(recipe, src, dst)
    r, topology, placed = recipe.refit, recipe.topology, None
    if topology is None:
        plan = get_plan(src, dst, bucket_bytes=r.bucket_bytes, allow_cast=r.allow_cast)
    else:
        where = topology.place(src.world_size, dst.world_size)
        plan = plan_for_placement(src, dst, where, topology.links, bucket_bytes=r.bucket_bytes,
                                  allow_cast=r.allow_cast)
        placed = placement_report(plan, src, dst, where, topology.links)
    return PlannedRecipe(recipe, src, dst, plan, plan_report(plan), placed, lora)


def with_drafts(recipe: RecipeLayout, src: SideLayout, dst: SideLayout) -> tuple[SideLayout, SideLayout]:
    """Both layouts with the MTP draft's parameters (``layout.mtp``): megatron's MTP block, the
    draft vLLM's speculative decoding builds on every worker."""
    spec, vspec, t, v = recipe.spec, recipe.vllm_spec or recipe.spec, recipe.training, recipe.vllm
    try:
        drafted = with_draft(src, [p for r in range(t.world_size) for p in megatron_mtp_rank_params(spec, t, r)], spec)
    except LayoutError as exc:
        raise LayoutError(f"training layout: {one_line(exc)}") from None
    try:
        dst_drafted = with_draft(dst, [p for r in range(v.world_size) for p in vllm_draft_rank_params(vspec, v, r)],
                                 vspec)
    except LayoutError as exc:
        raise LayoutError(f"vllm layout: {one_line(exc)}") from None
    # pure functions of the settings that described src and dst (when they were): keyed by them
    return (derived_from(drafted, src, ("mtp draft", spec, t)),
            derived_from(dst_drafted, dst, ("mtp draft", vspec, v)))


def lora_report(recipe: RecipeLayout) -> PlanReport | None:
    """A LoRA policy's adapter refit, planned direct (``layout.lora``; None: not a LoRA policy)."""
    if recipe.peft is None:
        return None
    src = megatron_lora_layout(recipe.spec, recipe.training, recipe.peft)
    dst = vllm_lora_layout(recipe.vllm_spec or recipe.spec, recipe.vllm, recipe.peft)
    return plan_report(get_plan(src, dst, bucket_bytes=recipe.refit.bucket_bytes))


def held_bytes(side: SideLayout, tensors: Mapping[str, tuple]) -> int:
    """Bytes of ``tensors`` that ``side``'s ranks hold, every copy counted (their share of a
    refit's minimum)."""
    return sum(q.box.numel * DTYPE_BYTES[tensors[q.canonical][1]] for q in side.pieces() if q.canonical in tensors)


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
    #: The engines run vLLM's AsyncLLM (as ``vllm serve`` does) instead of the offline ``LLM``.
    async_engine: bool = False
    #: The HF checkpoint directory; None for the built-in tiny models (written at run time).
    checkpoint: Path | None = None
    #: ``vllm.speculative_config``: the engines draft with the model's MTP layers, the trainers
    #: build megatron's MTP block, and every refit moves both in one vote (None: no draft).
    speculative: Any = None
    #: One line: what was chosen for the draft where the overrides named nothing ("": nothing).
    chose: str = ""
    src: SideLayout | None = field(default=None, repr=False, compare=False)
    dst: SideLayout | None = field(default=None, repr=False, compare=False)
    plan: Any = field(default=None, repr=False, compare=False)

    @property
    def tiny(self) -> bool:
        return self.model in TINY_MODELS


def _job_section(data: Mapping[str, Any]) -> dict[str, Any]:
    """``job:`` of ``configs/refit.yaml``: the steps, learning rate and tokens of the check."""
    job, k = data.get("job"), REFIT_CONFIG
    if not isinstance(job, Mapping):
        raise ConfigError(f"job={job!r} is not a mapping of settings")
    steps = read(data, k.steps)
    if steps < 1:
        raise ConfigError(f"job.steps={steps}: the job takes at least one optimizer step between its refits")
    lr = read(data, k.lr)
    if not (math.isfinite(lr) and lr > 0):
        raise ConfigError(f"job.lr={lr!r} must be a positive, finite number")
    tokens = read(data, k.tokens)
    if not tokens:
        raise ConfigError("job.tokens is empty: the logprob check needs at least one token id")
    compare_hf = read(data, k.compare_hf)
    workdir_s = read(data, k.workdir)
    workdir = Path(workdir_s) if workdir_s else None
    if workdir is not None and workdir.exists() and not workdir.is_dir():
        raise ConfigError(f"job.workdir={workdir_s!r} exists and is not a directory")
    return dict(steps=steps, lr=lr, tokens=tokens, compare_hf=compare_hf, workdir=workdir,
                async_engine=read(data, k.async_engine))


def _job_model(model: str, dtype: str) -> tuple[ModelSpec, Path | None]:
    """(spec, checkpoint directory) of a built-in tiny model (no checkpoint yet) or a HF checkpoint."""
    if model in TINY_MODELS:
        return tiny_spec(model, dtype), None
    checkpoint = Path(model)
    if not is_checkpoint_dir(checkpoint):
        raise ConfigError(f"model={model!r} is neither one of {list(TINY_MODELS)} nor a HF checkpoint "
                          f"directory (config.json + *.safetensors)")
    return load_spec(checkpoint, dtype, "model", model), checkpoint


def load_refit_job(overrides: Sequence[str] = ()) -> RefitJob:
    """``configs/refit.yaml`` + overrides as a validated :class:`RefitJob`.

    Checks everything ``plan`` checks (types, sizes, both layouts from the rules, the plan)
    and the local job's limits; starts no process and writes no file.
    """
    data, k = load_config("refit", overrides, open_sections=sections(REFIT_CONFIG)), REFIT_CONFIG
    chosen = draft_defaults(data, overrides) + fp8_defaults(data, overrides)
    if chosen:  # what a draft or an FP8 engine needs, where the overrides left the default job's own
        overrides = [*overrides, *chosen]
        data = load_config("refit", overrides, open_sections=sections(REFIT_CONFIG))
    model, dtype, seed = read(data, k.model), read(data, k.dtype), read(data, k.seed)
    if not 0 <= seed < 2**63:
        raise ConfigError(f"seed={seed} must be in [0, 2**63)")
    training, vllm, refit = read_section(data, k.training), read_section(data, k.vllm), read_section(data, k.refit)
    if not refit.enabled:
        raise ConfigError("refit.enabled is false: nothing to run")
    job = _job_section(data)
    problem = local_cpu_problem(training, vllm)  # the rules and the planner accept more
    if problem is not None:
        raise ConfigError(problem)
    spec, checkpoint = _job_model(model, dtype)
    build = megatron_build_problem(spec)
    if build is not None:
        raise ConfigError(f"model={model!r}: {build}")
    problem = local_train_problem(spec, model)
    if problem is not None:
        raise ConfigError(problem)
    for i, t in enumerate(job["tokens"]):
        if not 0 <= t < spec.vocab:
            raise ConfigError(f"job.tokens[{i}]={t} is out of range: token ids are 0 <= t < {spec.vocab} "
                              f"(vocab of {model})")
    speculative = read_section(data, k.speculative)
    speculative = speculative if speculative.method else None
    src, dst, plan = plan_layouts(spec, training, vllm, refit)
    if speculative is not None:  # the draft's layouts, planned with the target's: one refit
        if job["compare_hf"]:
            raise ConfigError("job.compare_hf=true with vllm.speculative_config: the HF-broadcast baseline loads the "
                              "target through vLLM's loader and would leave the draft stale (set job.compare_hf=false)")
        if vllm.tp != 1 or training.pp != 1:
            raise ConfigError(f"vllm.speculative_config.method={speculative.method}: the local job drafts with "
                              f"vllm.tp=1 and training.pp=1 (vLLM's DeepSeekMTP draft layout is described for pp=1)")
        src, dst = with_drafts(RecipeLayout(spec, training, vllm, refit, speculative=speculative), src, dst)
        plan = get_plan(src, dst, bucket_bytes=refit.bucket_bytes, allow_cast=refit.allow_cast)
    chose = ""
    if chosen and speculative is not None:
        chose = (f"vllm.speculative_config.method={speculative.method}: chose {', '.join(chosen)} (the draft runs "
                 f"on a model with MTP layers, at vllm.tp=1 and training.pp=1; the HF baseline would leave it stale)")
    elif chosen:
        chose = (f"vllm.quantization={vllm.quantization}: chose {', '.join(chosen)} (every shard whole 128x128 "
                 f"blocks, so each training rank quantizes what it owns)")
    return RefitJob(model=model, spec=spec, dtype=dtype, seed=seed, training=training, vllm=vllm, refit=refit,
                    checkpoint=checkpoint, src=src, dst=dst, plan=plan, speculative=speculative, chose=chose, **job)


def fp8_defaults(data: Mapping[str, Any], overrides: Sequence[str]) -> list[str]:
    """With ``vllm.quantization`` set: a built-in model whose shards on both sides are whole
    128x128 blocks (``tiny-moe-128``) where the overrides name none and the default one's
    32-wide heads would cut them (a model the user named keeps it, and a cut block is refused
    in one line as before)."""
    vllm = data.get("vllm") or {}
    if not vllm.get("quantization") or (vllm.get("speculative_config") or {}).get("method"):
        return []
    given = {o.split("=", 1)[0].lstrip("+~") for o in overrides}
    return ["model=tiny-moe-128"] if "model" not in given and data.get("model") in ("tiny-moe", "tiny-dense") else []


def draft_defaults(data: Mapping[str, Any], overrides: Sequence[str]) -> list[str]:
    """With ``vllm.speculative_config.method`` set: the overrides that make the job able to
    draft -- a model with MTP layers (``tiny-deepseek-v3-mtp``), ``vllm.tp=1``,
    ``training.pp=1``, ``job.compare_hf=false`` -- for each key the overrides do not name
    (a key the user named keeps its value, and a conflict is refused in one line as before)."""
    vllm = data.get("vllm") or {}
    if not (vllm.get("speculative_config") or {}).get("method"):
        return []
    given = {o.split("=", 1)[0].lstrip("+~") for o in overrides}
    out = []
    model = data.get("model")
    if "model" not in given and model in TINY_MODELS and not tiny_spec(model, "float32").mtp_layers:
        out.append("model=tiny-deepseek-v3-mtp")
    for key, value, want in (("vllm.tp", vllm.get("tp"), 1), ("training.pp", (data.get("training") or {}).get("pp"), 1),
                             ("job.compare_hf", (data.get("job") or {}).get("compare_hf"), False)):
        if key not in given and value != want:
            out.append(f"{key}={str(want).lower()}")
    return out
