"""``mcore-reshard grpo --dry-run``: what a GRPO recipe would place, move and cost, from
metadata alone (no process, no Ray, no torch tensors).

Placement follows NeMo RL's split of a non-colocated cluster; the plan is the one the refits
would run on that placement (planned once, from ``config.side_layouts``); the refit time is a
model, not a measurement: the busiest rank's bytes over one link, with the bandwidths stated
next to it, and NeMo RL's published figure for the same layout beside it where one exists.
"""

from __future__ import annotations

import math
from typing import Any
from dataclasses import asdict, dataclass, field, replace

from ...layout.mtp import draft_tensors
from ...settings import RecipeLayout
from ...settings.config import held_bytes, lora_report, side_layouts, with_drafts
from ...errors import ConfigError
from ...layout import ModelSpec
from ...plan.planner import gc_paused
from ...plan.report import PlanReport, format_bytes, plan_report
from ...plan.cache import get_plan
from ...plan.placed import Links, placement_report, plan_for_placement
from ...plan.refit_plans import without_tensors
from ...settings import resolve_model
from ...settings.topology import TopologyConfig
from .recipe import GrpoRecipe

__all__ = ["Placement", "PublishedFigure", "DryRunReport", "placement", "modelled_refit_seconds",
           "published_figure", "dry_run", "PUBLISHED"]


@dataclass(frozen=True)
class Placement:
    """Ranks and nodes of each side. One node: both sides share it (training takes the slots
    generation leaves); several nodes: each side takes whole nodes."""

    num_nodes: int
    gpus_per_node: int
    training_ranks: int
    generation_ranks: int
    engines: int
    training_nodes: int
    generation_nodes: int
    colocated: bool = False  # both sides share every GPU (NeMo RL's colocated mode)

    @property
    def slots(self) -> int:
        return self.num_nodes * self.gpus_per_node

    @property
    def shared_node(self) -> bool:
        """Trainers and engines on one node: the refit stays inside it (NVLink / shared memory)."""
        return self.num_nodes == 1

    @property
    def nodes_used(self) -> int:
        if self.colocated:
            return self.training_nodes
        return 1 if self.shared_node else self.training_nodes + self.generation_nodes


def placement(recipe: GrpoRecipe) -> Placement:
    """Where the ranks go; ``ConfigError`` when they do not fit the cluster."""
    c, t, g = recipe.cluster, recipe.training.world_size, recipe.vllm.world_size
    gpn = c.gpus_per_node
    if recipe.colocated:  # both sides on the same GPUs
        nodes = -(-t // gpn)
        p = Placement(c.num_nodes, gpn, t, g, recipe.vllm.replicas, training_nodes=nodes, generation_nodes=nodes,
                      colocated=True)
        if max(t, g) > p.slots:
            raise ConfigError(f"placement: {t} training and {g} generation ranks on the same GPUs do not fit "
                              f"cluster.num_nodes*cluster.gpus_per_node={c.num_nodes}*{gpn}")
        return p
    p = Placement(c.num_nodes, gpn, t, g, recipe.vllm.replicas,
                  training_nodes=1 if c.num_nodes == 1 else -(-t // gpn),
                  generation_nodes=1 if c.num_nodes == 1 else -(-g // gpn))
    if t + g > p.slots or p.nodes_used > c.num_nodes:
        raise ConfigError(f"placement: {t} training + {g} generation ranks on {p.nodes_used} node(s) do not fit "
                          f"cluster.num_nodes*cluster.gpus_per_node={c.num_nodes}*{gpn}")
    return p


def modelled_refit_seconds(busiest_rank_bytes: int, gbps: float) -> float:
    """A refit's time if every rank moves its bytes at once over its own ``gbps`` GB/s
    (10^9 bytes/s) link: the busiest rank finishes last. A floor: no per-message cost, no
    contention, no overlap with packing."""
    if not (math.isfinite(gbps) and gbps > 0):
        raise ConfigError(f"bandwidth {gbps!r} GB/s must be a positive, finite number")
    return busiest_rank_bytes / (gbps * 1e9)


@dataclass(frozen=True)
class PublishedFigure:
    """A refit time someone published (``shared/reference/peers-and-numbers.md``)."""

    system: str
    what: str  # model, layout, hardware
    seconds: str  # as published (a range or a share of a step)
    source: str


def _qwen3_30b_a3b(spec: ModelSpec) -> bool:
    ref = resolve_model("qwen3-30b-a3b", dtype="bfloat16")
    return replace(spec, name="") == replace(ref, name="")


#: (match, figure): ``match(recipe)`` says whether the figure is for this recipe's layout.
PUBLISHED: tuple = (
    (lambda r: _qwen3_30b_a3b(r.spec) and (r.training.tp, r.training.pp, r.training.ep, r.training.cp) == (1, 2, 8, 1)
     and (r.vllm.tp, r.vllm.pp) == (8, 1) and r.vllm.replicas * r.vllm.dp == 2,
     PublishedFigure("NeMo RL nccl_reshard", "Qwen3-30B-A3B bf16, EP8xPP2 -> TP8xDP2, H100", "0.74-1.00 s",
                     "NeMo RL docs/design-docs/nccl-reshard-refit.md")),
    (lambda r: _qwen3_30b_a3b(r.spec) and (r.cluster.num_nodes, r.cluster.gpus_per_node) == (8, 8),
     PublishedFigure("NeMo RL GRPO step table", "Qwen3-30B-A3B Megatron, 8 nodes x 8 GPUs (its own layout and "
                     "refit path, not this recipe's)", "refit 12 s of a 167 s step", "NeMo RL performance table")),
)


def published_figure(recipe: GrpoRecipe) -> PublishedFigure | None:
    """NeMo RL's published refit figure for this recipe's model and layout, if there is one."""
    if recipe.dtype != "bfloat16":
        return None
    return next((fig for match, fig in PUBLISHED if match(recipe)), None)


@dataclass(frozen=True)
class DryRunReport:
    recipe: str
    model: str
    dtype: str
    placement: Placement
    training_layout: str
    vllm_layout: str
    plan: PlanReport
    busiest_dst_rank: int
    busiest_dst_bytes: int
    #: max over both sides of the bytes one rank sends or receives (what its link carries).
    busiest_rank_bytes: int
    buffer_bytes_per_rank: int
    transport: str  # refit.transport: which of the two modelled times the loop's refits take
    link: str  # "intra-node" | "inter-node"
    link_gbps: float
    intra_node_gbps: float
    inter_node_gbps: float
    modelled_refit_seconds: float
    modelled_hf_broadcast_seconds: float
    bytes_inter_node: int
    bytes_inter_node_min: int  # one copy per inference node
    bytes_same_device: int
    bytes_hf_ipc: int  # NeMo RL's colocated path: every inference rank gets the full model over IPC
    published: PublishedFigure | None
    samples_per_step: int
    max_num_steps: int
    local_problem: str | None
    #: ``grpo.async_grpo`` as read (its ``enabled`` false: synchronous GRPO).
    async_grpo: dict = field(default_factory=dict)
    #: ``refit.overlap``: each vLLM worker receives into shadow weights, about what it receives.
    overlap: bool = False
    #: A LoRA policy: the bytes of every refit after the first (the adapter only, at the minimum).
    lora_refit_bytes: int | None = None
    #: Speculative decoding's MTP draft: its bytes of the refit's minimum (moved with the target).
    draft_bytes: int | None = None
    #: A frozen vision tower (projector): the bytes of every refit after the first, without it.
    frozen_refit_bytes: int | None = None
    #: The training rank that sends the most, its bytes, and the mean over training ranks.
    busiest_src_rank: int = 0
    busiest_src_bytes: int = 0
    mean_src_bytes: float = 0.0

    def to_json(self) -> dict:
        p = self.placement
        out = {k: v for k, v in asdict(self).items() if k not in ("placement", "plan", "published")}
        out.update(
            num_nodes=p.num_nodes, gpus_per_node=p.gpus_per_node, slots=p.slots, training_ranks=p.training_ranks,
            generation_ranks=p.generation_ranks, engines=p.engines, training_nodes=p.training_nodes,
            generation_nodes=p.generation_nodes, nodes_used=p.nodes_used, shared_node=p.shared_node,
            colocated=p.colocated,
            bytes_min=self.plan.bytes_min, bytes_planned=self.plan.bytes_planned,
            bytes_hf_broadcast=self.plan.bytes_hf_broadcast,
            buffer_bytes_training=self.buffer_bytes_per_rank * p.training_ranks,
            buffer_bytes_generation=self.buffer_bytes_per_rank * p.generation_ranks,
            published=asdict(self.published) if self.published else None,
            plan=self.plan.to_json(),
        )
        return out

    def table(self) -> str:
        p, r = self.placement, self.plan
        title = f"GRPO dry run: {self.recipe} ({self.model}, {self.dtype})"
        share = (f"the same {p.training_nodes} of {p.num_nodes} node(s), GPU i shared (colocated)" if p.colocated
                 else f"{p.nodes_used} node shared" if p.shared_node
                 else f"{p.training_nodes} + {p.generation_nodes} of {p.num_nodes} nodes")
        pub = (f"{self.published.seconds}  ({self.published.system}: {self.published.what}; {self.published.source})"
               if self.published else "no published figure for this layout")
        rows = [
            ("cluster", f"{p.num_nodes} node(s) x {p.gpus_per_node} slots = {p.slots}"),
            ("placement", f"{p.training_ranks} training + {p.generation_ranks} generation ranks "
                          f"({p.engines} engine(s)) on {share}"),
            ("training -> vLLM", f"{self.training_layout} -> {self.vllm_layout}"),
            ("step", f"{self.samples_per_step} samples, {self.max_num_steps} steps"),
            ("GRPO", self._mode()),
            ("refit bytes moved", format_bytes(r.bytes_planned) + ("  (= minimum)" if r.bytes_planned == r.bytes_min
                                                                   else f"  (minimum {format_bytes(r.bytes_min)})")
             + ("  (the base weights: the first refit moves them and the adapter)"
                if self.lora_refit_bytes is not None else "")),
            *([("MTP draft", f"{format_bytes(self.draft_bytes)} of it  ({100 * self.draft_bytes / max(r.bytes_min, 1):.2f} "
                             f"%: moved and voted on with the target)")] if self.draft_bytes is not None else []),
            *([("frozen tower refits", f"{format_bytes(self.frozen_refit_bytes)}  (every refit after the first, "
                                       f"without the frozen tensors: {100 * (1 - self.frozen_refit_bytes / max(r.bytes_planned, 1)):.1f} "
                                       f"% saved; the first moves them once)")]
              if self.frozen_refit_bytes is not None else []),
            *([("adapter refits (LoRA)", f"{format_bytes(self.lora_refit_bytes)}  (every refit after the first: "
                                         f"{100 * self.lora_refit_bytes / max(r.bytes_planned, 1):.3f} % of the base)")]
              if self.lora_refit_bytes is not None else []),
            *([("FP8 rollout", f"quantized at the sender (block FP8 128x128): {len(r.quantized)} tensors, "
                               f"{format_bytes(r.quantized_bytes)} of codes + scales for "
                               f"{format_bytes(r.quantized_bytes_unquantized)} in {r.quantized[0]['from']}")]
              if r.quantized else []),
            ("HF-broadcast baseline bytes", f"{format_bytes(r.bytes_hf_broadcast)}  "
                                            f"({r.bytes_hf_broadcast / max(r.bytes_planned, 1):.1f}x moved)"),
            ("busiest training rank", f"rank {self.busiest_src_rank}: {format_bytes(self.busiest_src_bytes)} sent  "
                                      f"(mean {format_bytes(int(self.mean_src_bytes))})"),
            ("busiest destination rank", f"rank {self.busiest_dst_rank}: {format_bytes(self.busiest_dst_bytes)}"),
            ("busiest rank, either side", format_bytes(self.busiest_rank_bytes)),
            ("refit buffer per rank", f"{format_bytes(self.buffer_bytes_per_rank)}  (at most; "
                                      f"{format_bytes(r.bucket_bytes)} buckets, {r.num_buckets} rounds)"),
            ("bytes over the fabric", f"{format_bytes(self.bytes_inter_node)}  (floor: one copy per inference "
                                      f"node, {format_bytes(self.bytes_inter_node_min)})"),
            *([("bytes on the same GPU", f"{format_bytes(self.bytes_same_device)}  (NeMo RL's colocated path sends "
                                         f"{format_bytes(self.bytes_hf_ipc)} over IPC)")] if self.placement.colocated
              else []),
            ("modelled refit time", f"{_seconds(self.modelled_refit_seconds)}  (" + (
                f"busiest rank / {self.link} {self.link_gbps:g} GB/s" if self.link == "intra-node" else
                f"slowest rank's links: {self.intra_node_gbps:g} GB/s intra-node, {self.inter_node_gbps:g} GB/s "
                f"inter-node") + ")" + ("" if self.transport == "reshard" else
                                                                   "  (not used: transport hf_broadcast)")),
            ("modelled HF broadcast", f"{_seconds(self.modelled_hf_broadcast_seconds)}  (one root sends every copy "
                                      f"at {self.link_gbps:g} GB/s)"),
            ("bandwidths assumed", f"intra-node {self.intra_node_gbps:g} GB/s, inter-node {self.inter_node_gbps:g} GB/s"),
            ("published", pub),
            ("runs on this machine", "yes" if self.local_problem is None else f"no: {self.local_problem}"),
        ]
        width = max(len(k) for k, _ in rows)
        return "\n".join([title, "-" * len(title)] + [f"{k.ljust(width)}  {v}" for k, v in rows])

    def _mode(self) -> str:
        """How steps and refits overlap (the table's "GRPO" row)."""
        a = self.async_grpo
        refits = "overlapped refits" if self.overlap else "blocking refits"
        shadow = f"; shadow weights up to {format_bytes(self.busiest_dst_bytes)} per vLLM rank" if self.overlap else ""
        if not a.get("enabled"):
            return f"synchronous, {refits}{shadow}"
        return (f"asynchronous: max trajectory age {a['max_trajectory_age_steps']} step(s), "
                f"{'in-flight' if a['in_flight_weight_updates'] else 'drained'} {refits}, KV "
                f"{'recomputed' if a['recompute_kv_cache_after_weight_updates'] else 'kept'} across a swap{shadow}")


def _seconds(s: float) -> str:
    return f"{s:.3f} s" if s >= 0.1 else f"{s * 1e3:.3f} ms"


def dry_run(recipe: GrpoRecipe, *, intra_node_gbps: float = 450.0, inter_node_gbps: float = 50.0) -> DryRunReport:
    """Placement, plan and modelled refit time of ``recipe`` (bandwidths in GB/s per rank).

    Trainers and engines on separate nodes refit over the inter-node link; on one shared
    node, over the intra-node one. Raises ``ConfigError`` / ``LayoutError`` / ``PlanError``
    (one line) where the layouts cannot be planned.
    """
    with gc_paused():  # layouts, plan and reports: ~300k objects each, nothing of it to collect
        return _dry_run(recipe, intra_node_gbps, inter_node_gbps)


def _dry_run(recipe: GrpoRecipe, intra_node_gbps: float, inter_node_gbps: float) -> DryRunReport:
    for g in (intra_node_gbps, inter_node_gbps):  # both checked, whichever the placement uses
        modelled_refit_seconds(0, g)
    place = placement(recipe)
    src, dst = side_layouts(recipe.spec, recipe.training, recipe.vllm, recipe.refit)
    layout = RecipeLayout(recipe.spec, recipe.training, recipe.vllm, recipe.refit, peft=recipe.peft,
                          speculative=recipe.speculative)
    # the adapter's plan before the full-size one: small, and a LoRA policy the rules cannot
    # describe is refused in one line before seconds of planning
    lora_bytes = None if recipe.peft is None else lora_report(layout).bytes_planned
    if recipe.speculative is not None:  # the MTP draft: the same plan, the same vote
        src, dst = with_drafts(layout, src, dst)
    # The one plan, the one the job runs on this placement (fan-out relays where they lower
    # the modelled time), and its modelled time over both link classes.
    where = TopologyConfig(gpus_per_node=recipe.cluster.gpus_per_node,
                           placement="colocated" if recipe.colocated else "separate").place(src.world_size,
                                                                                            dst.world_size)
    links = Links(intra_node_gbps, inter_node_gbps)
    plan = plan_for_placement(src, dst, where, links, bucket_bytes=recipe.refit.bucket_bytes,
                              allow_cast=recipe.refit.allow_cast)
    placed = placement_report(plan, src, dst, where, links)
    report = plan_report(plan)
    recv = plan.recv_bytes()
    busiest_dst = max(range(len(recv)), key=recv.__getitem__) if recv else 0
    sent = plan.send_bytes()
    busiest_src = max(range(len(sent)), key=sent.__getitem__) if sent else 0
    busiest = max(report.max_send_bytes, report.max_recv_bytes)
    link, gbps = (("colocated", intra_node_gbps) if recipe.colocated else
                  ("intra-node", intra_node_gbps) if place.shared_node else ("inter-node", inter_node_gbps))
    v = recipe.vllm
    vllm_name = (f"vllm(tp={v.tp},pp={v.pp},dp={v.dp},replicas={v.replicas}{',ep' if v.enable_ep else ''}"
                 f"{',' + v.quantization if v.quantization else ''})")
    return DryRunReport(
        recipe=recipe.path, model=recipe.model, dtype=recipe.dtype, placement=place, training_layout=src.name,
        vllm_layout=vllm_name, plan=report, busiest_dst_rank=busiest_dst,
        busiest_dst_bytes=recv[busiest_dst] if recv else 0, busiest_rank_bytes=busiest,
        busiest_src_rank=busiest_src, busiest_src_bytes=sent[busiest_src] if sent else 0,
        mean_src_bytes=sum(sent) / len(sent) if sent else 0.0,
        buffer_bytes_per_rank=recipe.refit.buffer_bytes, transport=recipe.refit.transport, link=link, link_gbps=float(gbps),
        intra_node_gbps=float(intra_node_gbps), inter_node_gbps=float(inter_node_gbps),
        modelled_refit_seconds=placed.modelled_seconds if (recipe.colocated or not place.shared_node)
        else modelled_refit_seconds(busiest, gbps),
        bytes_same_device=placed.bytes_same_device, bytes_hf_ipc=placed.bytes_hf_ipc,
        bytes_inter_node=placed.bytes_inter_node, bytes_inter_node_min=placed.bytes_inter_node_min,
        modelled_hf_broadcast_seconds=modelled_refit_seconds(report.bytes_hf_broadcast, gbps),
        published=published_figure(recipe), samples_per_step=recipe.grpo.samples_per_step,
        max_num_steps=recipe.grpo.max_num_steps, local_problem=recipe.local_problem,
        async_grpo=asdict(recipe.async_grpo), overlap=recipe.refit.overlap,
        lora_refit_bytes=lora_bytes,
        draft_bytes=None if recipe.speculative is None else held_bytes(dst, draft_tensors(recipe.spec)),
        frozen_refit_bytes=_frozen_bytes(recipe, src, dst),
    )


def _frozen_bytes(recipe: GrpoRecipe, src: Any, dst: Any) -> int | None:
    """A policy with a frozen tower: the bytes of its refits after the first (planned without
    the frozen tensors, at the minimum), or None."""
    frozen = recipe.frozen & frozenset(dst.tensors)
    if not frozen:
        return None
    plan = get_plan(without_tensors(src, frozen), without_tensors(dst, frozen), bucket_bytes=recipe.refit.bucket_bytes,
                    allow_cast=recipe.refit.allow_cast)
    return plan.bytes_planned
