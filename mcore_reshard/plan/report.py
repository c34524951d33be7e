"""Plan reports: the numbers a refit is judged by, as a table or one JSON object -- the plan's
own (:func:`plan_report`) and its bytes on the links of a placement (:func:`placement_report`).
"""

from __future__ import annotations

import operator
import re
from dataclasses import asdict, dataclass, field
from typing import Iterable

from ..layout import DTYPE_BYTES, SideLayout
from ..layout.memo import IdentityCache
from ..layout.quant import FP8, scale_name
from .floor import clear_floor_cache, hf_ipc_bytes, inter_node_minimum
from .placement import LINK_CLASSES, Links, RankPlacement
from .planner import gc_paused
from .types import TransferPlan

__all__ = ["PlanReport", "plan_report", "PlacementReport", "placement_report", "modelled_seconds", "format_bytes"]


@dataclass(frozen=True)
class PlanReport:
    #: What every destination rank must receive, summed over all ``num_dst_ranks`` of them
    #: (every rank of every engine: a vLLM layout has ``replicas x dp x pp x tp`` ranks).
    bytes_min: int
    bytes_planned: int
    bytes_hf_broadcast: int
    max_send_bytes: int
    mean_send_bytes: float
    max_recv_bytes: int
    num_transfers: int
    num_buckets: int
    plan_seconds: float
    num_src_ranks: int
    num_dst_ranks: int
    bucket_bytes: int
    padding_elements: int
    digest: str
    not_direct: list[dict[str, str]]
    notes: list[str]
    #: Every tensor whose source dtype differs from the destination's: {"tensor", "from", "to"}.
    casts: list[dict[str, str]] = field(default_factory=list)
    #: Every tensor carried as its bits in the wire dtype (``TransferPlan.reinterpret``):
    #: {"tensor", "dtype" (its own), "wire"}.
    reinterpret: list[dict[str, str]] = field(default_factory=list)
    #: How a delta refit (``refit.delta=auto``) rebuilds each destination tensor (per rank):
    #: ``live`` from the weights the engine holds, ``kept_copy`` from the model-format copy a
    #: worker keeps of a tensor vLLM repacks (``not_direct``). Which boxes went unchanged,
    #: sparse or dense is per refit: ``RefitMetrics.delta_boxes``.
    delta_mode_per_tensor: dict[str, int] = field(default_factory=dict)
    #: Every tensor the senders quantize to block FP8 (``TransferPlan.quantized``):
    #: {"tensor", "from", "to"}; and the planned bytes of those tensors (codes + scales) next to
    #: what the same elements would move in the dtype the senders hold them in.
    quantized: list[dict[str, str]] = field(default_factory=list)
    quantized_bytes: int = 0
    quantized_bytes_unquantized: int = 0
    #: Tensors the destination holds in FP8 but the training layout cuts their blocks: sent
    #: unquantized, quantized by the receiver ({"tensor", "why"}); and the bytes that costs over
    #: codes + scales (every destination rank).
    quantized_at_receiver: list[dict[str, str]] = field(default_factory=list)
    bytes_over_fp8_minimum: int = 0

    def to_json(self) -> dict:
        return asdict(self)

    def table(self, title: str = "refit plan") -> str:
        ratio = self.bytes_hf_broadcast / self.bytes_planned if self.bytes_planned else float("nan")
        rows = [
            ("source ranks -> destination ranks", f"{self.num_src_ranks} -> {self.num_dst_ranks}"),
            ("theoretical minimum bytes", f"{format_bytes(self.bytes_min)}  (summed over all {self.num_dst_ranks} "
                                          f"destination ranks)"),
            ("planned bytes", format_bytes(self.bytes_planned) + ("  (= minimum)" if self.bytes_planned == self.bytes_min else "  (!= minimum)")),
            ("HF-broadcast baseline bytes", f"{format_bytes(self.bytes_hf_broadcast)}  ({ratio:.1f}x planned)"),
            ("max bytes sent by a rank", f"{format_bytes(self.max_send_bytes)}  (max/mean {self.max_send_bytes / self.mean_send_bytes:.2f})" if self.mean_send_bytes else "0"),
            ("max bytes received by a rank", format_bytes(self.max_recv_bytes)),
            ("transfers / buckets", f"{self.num_transfers} / {self.num_buckets}  (bucket budget {format_bytes(self.bucket_bytes)})"),
            ("padding zero-filled locally", f"{self.padding_elements} elements"),
            ("planning time", f"{self.plan_seconds:.3f} s"),
            ("plan digest", self.digest),
            ("not on the direct path", "none" if not self.not_direct else f"{len(self.not_direct)} parameter(s)"),
            ("delta refits rebuild from", f"live weights: {self.delta_mode_per_tensor.get('live', 0)} tensor(s), "
                                          f"a kept model-format copy: {self.delta_mode_per_tensor.get('kept_copy', 0)}"),
        ]
        width = max(len(k) for k, _ in rows)
        lines = [title, "-" * len(title)] + [f"{k.ljust(width)}  {v}" for k, v in rows]
        for (pattern, reason), count in _group_names(self.not_direct, "param", "reason").items():
            lines.append(f"  not direct: {pattern} (x{count}): {reason}")
        lines.append(f"casts (sender converts while packing): {len(self.casts)} tensor(s)" if self.casts
                     else "casts (sender converts while packing): none")
        groups = list(_group_names(self.casts, "tensor", "from", "to").items())
        for (pattern, src, dst), count in groups[:_MAX_CAST_LINES]:
            lines.append(f"  cast: {pattern} (x{count}): {src} -> {dst}")
        if len(groups) > _MAX_CAST_LINES:
            rest = sum(count for _, count in groups[_MAX_CAST_LINES:])
            lines.append(f"  cast: ... {len(groups) - _MAX_CAST_LINES} more pattern(s), {rest} tensor(s) (all in the JSON form)")
        for (pattern, dtype, wire), count in _group_names(self.reinterpret, "tensor", "dtype", "wire").items():
            what = f"x {count} layers" if ".*." in pattern else f"x{count}"
            lines.append(f"  reinterpreted: {pattern} ({what}) carried as {dtype} bits in a {wire} plan (not cast)")
        if self.quantized:
            ratio = self.quantized_bytes / self.quantized_bytes_unquantized if self.quantized_bytes_unquantized else 0
            lines.append(f"quantized at the sender (block FP8 128x128, vLLM's formula): {len(self.quantized)} tensor(s), "
                         f"{format_bytes(self.quantized_bytes)} of codes + scales for "
                         f"{format_bytes(self.quantized_bytes_unquantized)} in {self.quantized[0]['from']} ({ratio:.3f}x)")
            for (pattern, src, dst), count in list(_group_names(self.quantized, "tensor", "from", "to").items())[:_MAX_CAST_LINES]:
                lines.append(f"  quantized: {pattern} (x{count}): {src} -> {dst} + fp32 scale_inv")
        if self.quantized_at_receiver:
            lines.append(f"quantized at the receiver (the training layout cuts their FP8 blocks): "
                         f"{len(self.quantized_at_receiver)} tensor(s), {format_bytes(self.bytes_over_fp8_minimum)} "
                         f"more than their FP8 codes")
            for (pattern, why), count in list(_group_names(self.quantized_at_receiver, "tensor", "why").items())[:_MAX_CAST_LINES]:
                lines.append(f"  at the receiver: {pattern} (x{count}): {why}")
        for note in self.notes:
            lines.append(f"  note: {note}")
        return "\n".join(lines)


def plan_report(plan: TransferPlan) -> PlanReport:
    send = plan.send_bytes()
    recv = plan.recv_bytes()  # once: ``plan.bytes_planned`` is its sum
    return PlanReport(
        bytes_min=plan.bytes_min,
        bytes_planned=sum(recv),
        bytes_hf_broadcast=plan.bytes_hf_broadcast,
        max_send_bytes=max(send, default=0),
        mean_send_bytes=(sum(send) / len(send)) if send else 0.0,
        max_recv_bytes=max(recv, default=0),
        num_transfers=len(plan.transfers),
        num_buckets=plan.num_buckets,
        plan_seconds=round(plan.plan_seconds, 4),
        num_src_ranks=plan.num_src,
        num_dst_ranks=plan.num_dst,
        bucket_bytes=plan.bucket_bytes,
        padding_elements=sum(n for _, _, n in plan.padding),
        digest=plan.digest(),
        not_direct=[{"param": p, "reason": r} for p, r in plan.not_direct],
        notes=list(plan.notes),
        casts=[{"tensor": t, "from": s, "to": d} for t, s, d in plan.casts],
        reinterpret=[{"tensor": t, "dtype": d, "wire": plan.dtype} for t, d in plan.reinterpret],
        delta_mode_per_tensor=_delta_modes(plan),
        **_quantized(plan),
    )


def _quantized(plan: TransferPlan) -> dict:
    """The report's FP8 fields: bytes of quantized tensors (codes and scales) every destination
    rank receives, and what those elements would be unquantized."""
    if not plan.quantized and not plan.quantized_at_receiver:
        return {}
    held = dict(plan.quantized)
    scales = {scale_name(n) for n in held}
    late = {n: d for n, d, _ in plan.quantized_at_receiver}
    moved = unquantized = over = 0
    relay_of = plan.relay_of or (-1,) * len(plan.transfers)
    for t, group in zip(plan.transfers, relay_of):
        copies = len(plan.relay_groups[group]) if group >= 0 else 1  # every destination rank that holds it
        if t.canonical in held:
            moved += t.nbytes * copies
            unquantized += t.box.numel * DTYPE_BYTES[held[t.canonical]] * copies
        elif t.canonical in scales:
            moved += t.nbytes * copies
        elif t.canonical in late:  # moved unquantized: one byte per element as FP8 codes (scales left out)
            over += (t.nbytes - t.nbytes // DTYPE_BYTES[late[t.canonical]]) * copies
    return {"quantized": [{"tensor": n, "from": d, "to": FP8} for n, d in plan.quantized],
            "quantized_bytes": moved, "quantized_bytes_unquantized": unquantized,
            "quantized_at_receiver": [{"tensor": n, "why": w} for n, _, w in plan.quantized_at_receiver],
            "bytes_over_fp8_minimum": over}


def _delta_modes(plan: TransferPlan) -> dict[str, int]:
    copied = {p for p, _ in plan.not_direct}
    tensors = {(t.dst, t.dst_name) for t in plan.transfers}
    kept = sum(1 for _, name in tensors if name in copied)
    return {"live": len(tensors) - kept, "kept_copy": kept}


#: Grouped cast lines shown in the table (a bf16 model into an fp32 engine casts every tensor).
_MAX_CAST_LINES = 6


def _group_names(items: list[dict[str, str]], name: str, *fields: str) -> dict[tuple[str, ...], int]:
    """Group per-layer names (``layers.3.`` -> ``layers.*.``) with the same ``fields`` so the
    table stays short (not-direct parameters, cast tensors); the JSON form keeps every one."""
    groups: dict[tuple[str, ...], int] = {}
    for item in items:
        key = (re.sub(r"\.(\d+)\.", ".*.", item[name]), *(item[f] for f in fields))
        groups[key] = groups.get(key, 0) + 1
    return groups


def format_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} TiB"


@dataclass(frozen=True)
class PlacementReport:
    """A plan's bytes on the links of a placement (``mcore-reshard plan --json`` keys)."""

    bytes_same_device: int
    bytes_intra_node: int
    bytes_inter_node: int
    #: The busiest rank's bytes per class (the larger of what a rank sends and receives).
    busiest_same_device: int
    busiest_intra_node: int
    busiest_inter_node: int
    bytes_inter_node_min: int  # one copy per destination node (see floor.inter_node_minimum)
    modelled_seconds: float
    #: NeMo RL's colocated path for the same layout: every inference rank gets every full tensor.
    bytes_hf_ipc: int
    links: Links
    gpus_per_node: int
    nodes_src: int
    nodes_dst: int

    def lines(self) -> list[str]:
        """The plan table's placement lines."""
        fb = format_bytes
        ratio = self.bytes_inter_node / self.bytes_inter_node_min if self.bytes_inter_node_min else 0.0
        return [
            f"placement: {self.nodes_src} training + {self.nodes_dst} inference node(s) of {self.gpus_per_node} GPUs",
            f"  bytes same device / intra-node / inter-node: {fb(self.bytes_same_device)} / "
            f"{fb(self.bytes_intra_node)} / {fb(self.bytes_inter_node)}",
            f"  inter-node floor (one copy per inference node): {fb(self.bytes_inter_node_min)}"
            + (f" -- the plan moves {ratio:.4f}x it over the fabric" if ratio > 1.0 + 1e-9 else " -- met"),
            f"  busiest rank same device / intra-node / inter-node: {fb(self.busiest_same_device)} / "
            f"{fb(self.busiest_intra_node)} / {fb(self.busiest_inter_node)}",
            f"  modelled refit: {self.modelled_seconds:.3f} s at {self.links.intra_node_gbps:g} GB/s intra-node, "
            f"{self.links.inter_node_gbps:g} GB/s inter-node per GPU",
            f"  NeMo RL colocated path (every inference rank gets the full model over IPC): {fb(self.bytes_hf_ipc)}",
        ]

    def to_json(self) -> dict:
        return {
            "bytes_same_device": self.bytes_same_device, "bytes_intra_node": self.bytes_intra_node,
            "bytes_inter_node": self.bytes_inter_node, "bytes_inter_node_min": self.bytes_inter_node_min,
            "busiest_rank_bytes": {"same_device": self.busiest_same_device, "intra_node": self.busiest_intra_node,
                                   "inter_node": self.busiest_inter_node},
            "modelled_seconds": self.modelled_seconds, "bytes_hf_ipc": self.bytes_hf_ipc,
            "links_gbps": {"intra_node": self.links.intra_node_gbps, "inter_node": self.links.inter_node_gbps,
                           "same_device": self.links.same_device_gbps},
            "gpus_per_node": self.gpus_per_node, "nodes": {"training": self.nodes_src, "inference": self.nodes_dst},
        }


_SRC, _DST, _NBYTES = (operator.attrgetter(a) for a in ("src", "dst", "nbytes"))

#: placement_report by what it reads, the plan's transfers by identity: the relay choice
#: reports each candidate, then the CLI reports the chosen one again (the same transfers, other
#: notes).
_REPORTS = IdentityCache(4)


def placement_report(plan: TransferPlan, src: SideLayout, dst: SideLayout, placement: RankPlacement,
                     links: Links = Links()) -> PlacementReport:
    """Bytes per link class, the busiest rank per class, and the modelled time: the slowest
    rank, whose links of different classes run at once (max over classes of bytes / rate),
    sending and receiving at once (full duplex: the larger direction counts)."""
    if len(placement.src) != plan.num_src or len(placement.dst) != plan.num_dst:
        raise ValueError(f"placement has {len(placement.src)} + {len(placement.dst)} ranks, the plan "
                         f"{plan.num_src} + {plan.num_dst}")
    def build() -> PlacementReport:
        with gc_paused():  # a set and tuples per destination piece (the floor): nothing to collect
            return _placement_report(plan, src, dst, placement, links)

    return _REPORTS.get((plan.transfers, plan.relay_of, plan.relay_groups, src, dst),
                        (plan.itemsize, placement, links), build)


def clear_report_caches() -> None:
    _REPORTS.clear()
    clear_floor_cache()


def _placement_report(plan: TransferPlan, src: SideLayout, dst: SideLayout, placement: RankPlacement,
                      links: Links) -> PlacementReport:
    # ~300k transfers between a few thousand (source, destination) pairs: bytes are summed
    # per pair (one int key) first, and each pair's link class is asked once
    ts = plan.transfers
    dsts, nbytes = list(map(_DST, ts)), list(map(_NBYTES, ts))
    width = max(plan.num_dst, 1 + max(dsts, default=0))  # (a rank out of range still fails below)
    pairs: dict[int, int] = {}
    get = pairs.get
    for s, d, n in zip(map(_SRC, ts), dsts, nbytes):
        k = s * width + d
        pairs[k] = get(k, 0) + n
    # Relays: a group member forwards what it receives from the sources to the other members
    # (summed per (receiver, relay group) first, likewise).
    relayed: dict[tuple[int, int], int] = {}
    for group, d, n in zip(plan.relay_of, dsts, nbytes):
        if group >= 0:
            relayed[(d, group)] = relayed.get((d, group), 0) + n
    totals, busiest, seconds = _link_loads(((*divmod(k, width), n) for k, n in pairs.items()), relayed,
                                           plan.relay_groups, plan.num_src, plan.num_dst, placement, links)
    return PlacementReport(
        bytes_same_device=totals["same_device"], bytes_intra_node=totals["intra_node"],
        bytes_inter_node=totals["inter_node"], busiest_same_device=busiest["same_device"],
        busiest_intra_node=busiest["intra_node"], busiest_inter_node=busiest["inter_node"],
        bytes_inter_node_min=inter_node_minimum(src, dst, placement, plan.itemsize),
        modelled_seconds=seconds, bytes_hf_ipc=hf_ipc_bytes(dst, plan.itemsize), links=links,
        gpus_per_node=placement.gpus_per_node, nodes_src=len({loc.node for loc in placement.src}),
        nodes_dst=len(placement.dst_nodes),
    )


def modelled_seconds(link_bytes: dict[tuple[int, int], int], num_src: int, num_dst: int, placement: RankPlacement,
                     links: Links = Links()) -> float:
    """``PlacementReport.modelled_seconds`` of a plan without relays from its bytes per
    (source, destination) pair alone (``planner.SendersChosen.link_bytes``): the same sums,
    the same arithmetic, so the same float -- without the plan's buckets and transfers."""
    if len(placement.src) != num_src or len(placement.dst) != num_dst:
        raise ValueError(f"placement has {len(placement.src)} + {len(placement.dst)} ranks, the plan "
                         f"{num_src} + {num_dst}")
    return _link_loads(((s, d, n) for (s, d), n in link_bytes.items()), {}, (), num_src, num_dst, placement,
                       links)[2]


def _link_loads(pairs: Iterable[tuple[int, int, int]], relayed: dict[tuple[int, int], int],
                groups: tuple[tuple[int, ...], ...], num_src: int, num_dst: int, placement: RankPlacement,
                links: Links) -> tuple[dict[str, int], dict[str, int], float]:
    """(bytes per link class, the busiest rank's bytes per class, the modelled seconds) of
    ``pairs`` (source, destination, bytes) and ``relayed`` ((receiver, relay group) -> bytes
    it forwards to the group's other members)."""
    totals = dict.fromkeys(LINK_CLASSES, 0)
    sent = {c: [0] * num_src for c in LINK_CLASSES}
    recv = {c: [0] * num_dst for c in LINK_CLASSES}
    for s, d, n in pairs:
        c = placement.link(s, d)
        totals[c] += n
        sent[c][s] += n
        recv[c][d] += n
    forwarded = {c: [0] * num_dst for c in LINK_CLASSES}
    for (d, group), n in relayed.items():
        for m in groups[group]:
            if m != d:
                c = placement.dst_link(d, m)
                totals[c] += n
                recv[c][m] += n
                forwarded[c][d] += n
    busiest = {c: max(max(sent[c], default=0), max(recv[c], default=0), max(forwarded[c], default=0))
               for c in LINK_CLASSES}
    seconds = 0.0
    for per_rank in (sent, recv, forwarded):
        for r in range(len(per_rank["inter_node"])):
            seconds = max(seconds, max(per_rank[c][r] / (links.gbps(c) * 1e9) for c in LINK_CLASSES))
    return totals, busiest, seconds
