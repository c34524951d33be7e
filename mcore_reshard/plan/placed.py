"""The plan for a placement: direct, or with fan-out relays where they do not slow the refit.

The pieces live in their own modules -- where ranks sit (``placement``), the floor over the
fabric (``floor``), relay groups (``relays``), bytes per link class and the modelled time
(``report``) -- and are re-exported here, the module callers plan a placement through. Pure
metadata, like the planner: a full-size placement is checked on a laptop. Settings that
describe a cluster (and their errors) are not planned here: they build a ``RankPlacement``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace

from ..layout import SideLayout
from .cache import get_placed_plan, link_cost
from .extensions import Colocated
from .floor import hf_ipc_bytes, inter_node_minimum, over_floor, why_over
from .placement import LINK_CLASSES, Links, Location, RankPlacement, same_device_pairs
from .planner import SendersChosen, gc_paused, plan_senders
from .relays import Relays, misdelivered, piece_relays, relay_groups, spread
from .report import PlacementReport, modelled_seconds, placement_report
from .tags import relayed_tags_fit
from .types import PlanError, TransferPlan

__all__ = ["Location", "Links", "RankPlacement", "PlacementReport", "LINK_CLASSES",
           "placement_report", "inter_node_minimum", "hf_ipc_bytes", "relay_groups", "piece_relays",
           "same_device_pairs", "plan_for_placement"]


@dataclass(frozen=True)
class _Request:
    """What every candidate plan of one ``plan_for_placement`` call is planned from."""

    src: SideLayout
    dst: SideLayout
    placement: RankPlacement
    links: Links
    bucket_bytes: int
    allow_cast: bool
    not_direct: tuple[tuple[str, str], ...]

    def senders(self, dst: SideLayout, charges: tuple[tuple[int, str, tuple[int, ...]], ...] = ()) -> SendersChosen:
        """A candidate planned up to its buckets (``planner.plan_senders``): each candidate of
        one call is planned once, and only the chosen one is finished."""
        return plan_senders(self.src, dst, bucket_bytes=self.bucket_bytes, allow_cast=self.allow_cast,
                            not_direct=self.not_direct, link_cost=link_cost(self.placement), charges=charges)

    def report(self, plan: TransferPlan) -> PlacementReport:
        return placement_report(plan, self.src, self.dst, self.placement, self.links)


@dataclass(frozen=True)
class _Relayed:
    """A relayed candidate: its relays, its plan, and that plan's bytes on the links."""

    relays: Relays
    plan: TransferPlan
    report: PlacementReport

    def tags_fit(self) -> bool:
        """Whether the executor's message tags (gloo's are C ints, below 2**29) cover every
        (bucket, relay group) of the plan."""
        return relayed_tags_fit(self.plan.num_buckets, len(self.relays.groups))


def plan_for_placement(src: SideLayout, dst: SideLayout, placement: RankPlacement, links: Links = Links(), *,
                       bucket_bytes: int, allow_cast: bool = False,
                       not_direct: tuple[tuple[str, str], ...] = ()) -> TransferPlan:
    """The plan for a placement: direct, or with fan-out relays where that does not raise the
    modelled time. Relays (:func:`piece_relays`): every distinct box a node's inference ranks
    hold is sent over the fabric to one of its holders there, which forwards it to the
    others over the node's links -- so each element crosses into a node once, spread over the
    group's links. Where relays cannot meet that floor for some tensors (a rank holding a
    box twice), those keep the direct path and the notes say so: a performance miss never
    refuses a layout. Bytes delivered other than the destinations hold are a ``PlanError``.
    Cached (``plan.cache``): the same inputs give the same plan object."""
    req = _Request(src, dst, placement, links, bucket_bytes, allow_cast, not_direct)
    with gc_paused():  # relays and reports walk every transfer of every candidate, as planning does
        return get_placed_plan(src, dst, (placement, links, bucket_bytes, allow_cast, not_direct), lambda: _timed(req))


def _timed(req: _Request) -> TransferPlan:
    """:func:`_placed`, its ``plan_seconds`` the whole of it: every candidate planned, relayed
    and compared -- the planner's time a user weighs the command's own against."""
    t0 = time.perf_counter()
    plan = _placed(req)
    return replace(plan, plan_seconds=time.perf_counter() - t0)


def _placed(req: _Request) -> TransferPlan:
    """:func:`plan_for_placement`, uncached. The direct candidate is planned up to its buckets
    (its modelled time needs only its bytes per link, ``SendersChosen.link_bytes``) and
    finished only where it is the plan chosen; the relayed candidates are planned whole."""
    dst, placement = req.dst, req.placement
    direct = req.senders(dst)
    direct.check()  # refused as the made plan would be, before anything else is asked of it
    pairs = same_device_pairs(placement)
    relays = piece_relays(dst, placement)
    if relays is None:
        return _colocated(direct.finish(), pairs)

    def keep_direct(why: str) -> TransferPlan:
        plan = direct.finish()
        return replace(_colocated(plan, pairs), notes=plan.notes + (f"fan-out relays not used: {why}",))

    t_direct = modelled_seconds(direct.link_bytes(), req.src.world_size, dst.world_size, placement, req.links)
    first = _relay(req, relays, direct)
    if first.report.modelled_seconds > t_direct:
        return keep_direct(f"modelled {first.report.modelled_seconds:.4f} s with relays vs {t_direct:.4f} s direct")
    floored = _within_floor(req, direct, first, t_direct)
    if isinstance(floored, str):
        return keep_direct(floored)
    chosen, kept = _within_tags(req, direct, *floored, t_direct)
    if not chosen.tags_fit():
        return keep_direct(
            f"{chosen.plan.num_buckets} buckets x {len(chosen.relays.groups)} relay groups need more "
            f"message tags than gloo has (raise refit.buffer_bytes for fewer buckets); modelled {t_direct:.4f} s "
            f"direct vs {chosen.report.modelled_seconds:.4f} s with relays")
    groups = chosen.relays.groups
    n = len({m for members in groups for m in members})
    return replace(_colocated(chosen.plan, pairs), notes=chosen.plan.notes + (
        f"fan-out relays: {len(groups)} group(s) of inference ranks ({n} ranks) holding the same pieces on "
        f"shared nodes take each box over the fabric once and forward it inside the node; modelled "
        f"{chosen.report.modelled_seconds:.4f} s vs {t_direct:.4f} s direct",) + kept)


def _colocated(plan: TransferPlan, pairs: tuple[tuple[int, int], ...]) -> TransferPlan:
    """The ``placement`` pass: the plan with its same-device pairs recorded (none: as it is)."""
    return plan.extended(Colocated(pairs)) if pairs else plan


def _relay(req: _Request, relays: Relays, direct: SendersChosen) -> _Relayed:
    """Plan the reduced side, hand each relayed transfer to a member, and check the result
    delivers exactly what the direct plan does."""
    plan = req.senders(relays.reduced, relays.charges).finish()
    wire = relays.in_wire_units(plan.reinterpret, plan.itemsize)
    shell = direct.shell  # (what the destinations hold: the direct plan's, made or not)
    plan = replace(spread(plan, wire.groups, [wire.group_of(t) for t in plan.transfers], wire.sites),
                   bytes_min=shell.bytes_min, bytes_hf_broadcast=shell.bytes_hf_broadcast, padding=shell.padding)
    if plan.bytes_planned != shell.bytes_min:  # a lost or doubled box: never a performance matter
        raise PlanError(f"fan-out relays deliver {plan.bytes_planned} bytes, the destinations hold "
                        f"{shell.bytes_min}: {misdelivered(plan, direct.finish())}")
    return _Relayed(relays, plan, req.report(plan))


def _within_floor(req: _Request, direct: SendersChosen, first: _Relayed,
                  t_direct: float) -> tuple[_Relayed, tuple[str, ...]] | str:
    """``first``, or -- where it moves more than the floor into some node -- the relays with
    those (node, tensor) pairs kept direct, with the note saying so; a string: why the plan
    stays direct. Less than the floor is a ``PlanError`` (some box never reaches its node)."""
    rep = first.report
    if rep.bytes_inter_node < rep.bytes_inter_node_min:
        raise PlanError(f"fan-out relays move {rep.bytes_inter_node} bytes over the fabric, below the floor (one "
                        f"copy per inference node) of {rep.bytes_inter_node_min}: some box never reaches its node")
    if rep.bytes_inter_node == rep.bytes_inter_node_min:
        return first, ()
    over = over_floor(first.plan, req.src, req.dst, req.placement)
    why = f"({why_over(req.dst, req.placement, over)}), e.g. {_over_line(over[0])}"
    kept = (f"fan-out relays keep the direct path for {len(over)} (node, tensor) pair(s) they cannot take "
            f"into the node once {why}",)
    relays = piece_relays(req.dst, req.placement, direct=frozenset((node, name) for node, name, _, _ in over))
    if relays is None:
        return (f"nothing is left to relay once the {len(over)} (node, tensor) pair(s) they cannot "
                f"take into the node once keep the direct path {why}")
    second = _relay(req, relays, direct)
    if second.report.modelled_seconds > t_direct:
        return (f"modelled {second.report.modelled_seconds:.4f} s with relays (some tensors direct) vs "
                f"{t_direct:.4f} s direct")
    return second, kept


def _over_line(over: tuple[int, str, int, int]) -> str:
    node, name, nb, floor = over
    return f"{name} crosses into node {node} as {nb} bytes, its floor there is {floor}"


def _within_tags(req: _Request, direct: SendersChosen, chosen: _Relayed, kept: tuple[str, ...],
                 t_direct: float) -> tuple[_Relayed, tuple[str, ...]]:
    """``chosen``, or -- where its plan needs more message tags than gloo has and some of its
    boxes are held at different places by their members (those bring relay groups of their
    own) -- the relays with those boxes direct, if the rest then fit the tags without raising
    the modelled time."""
    relays = chosen.relays
    if chosen.tags_fit() or not relays.sites:
        return chosen, kept
    nodes = relays.nodes
    alias = relays.direct | {(nodes[site[0]], site[2]) for box in relays.sites for site in box}
    fewer = piece_relays(req.dst, req.placement, direct=frozenset(alias))
    if fewer is None:
        return chosen, kept
    candidate = _relay(req, fewer, direct)
    if not (candidate.tags_fit() and candidate.report.modelled_seconds <= t_direct):
        return chosen, kept
    return candidate, kept + (
        f"fan-out relays keep the direct path for {len(alias - relays.direct)} (node, tensor) pair(s) "
        f"their holders on a node hold at different places (e.g. redundant expert copies): relaying "
        f"them too needs {chosen.plan.num_buckets} buckets x {len(relays.groups)} relay groups, more "
        f"message tags than gloo has (raise refit.buffer_bytes for fewer buckets); modelled "
        f"{chosen.report.modelled_seconds:.4f} s with them relayed",)
