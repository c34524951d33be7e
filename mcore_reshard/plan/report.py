"""Plan report: the numbers a refit is judged by, as a table or one JSON object."""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field

from .types import TransferPlan

__all__ = ["PlanReport", "plan_report", "format_bytes"]


@dataclass(frozen=True)
class PlanReport:
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

    def to_json(self) -> dict:
        return asdict(self)

    def table(self, title: str = "refit plan") -> str:
        ratio = self.bytes_hf_broadcast / self.bytes_planned if self.bytes_planned else float("nan")
        rows = [
            ("source ranks -> destination ranks", f"{self.num_src_ranks} -> {self.num_dst_ranks}"),
            ("theoretical minimum bytes", format_bytes(self.bytes_min)),
            ("planned bytes", format_bytes(self.bytes_planned) + ("  (= minimum)" if self.bytes_planned == self.bytes_min else "  (!= minimum)")),
            ("HF-broadcast baseline bytes", f"{format_bytes(self.bytes_hf_broadcast)}  ({ratio:.1f}x planned)"),
            ("max bytes sent by a rank", f"{format_bytes(self.max_send_bytes)}  (max/mean {self.max_send_bytes / self.mean_send_bytes:.2f})" if self.mean_send_bytes else "0"),
            ("max bytes received by a rank", format_bytes(self.max_recv_bytes)),
            ("transfers / buckets", f"{self.num_transfers} / {self.num_buckets}  (bucket budget {format_bytes(self.bucket_bytes)})"),
            ("padding zero-filled locally", f"{self.padding_elements} elements"),
            ("planning time", f"{self.plan_seconds:.3f} s"),
            ("plan digest", self.digest),
            ("not on the direct path", "none" if not self.not_direct else f"{len(self.not_direct)} parameter(s)"),
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
        for note in self.notes:
            lines.append(f"  note: {note}")
        return "\n".join(lines)


def plan_report(plan: TransferPlan) -> PlanReport:
    send = plan.send_bytes()
    senders = [b for b in send if b]
    return PlanReport(
        bytes_min=plan.bytes_min,
        bytes_planned=plan.bytes_planned,
        bytes_hf_broadcast=plan.bytes_hf_broadcast,
        max_send_bytes=max(send, default=0),
        mean_send_bytes=(sum(send) / len(send)) if send else 0.0,
        max_recv_bytes=max(plan.recv_bytes(), default=0),
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
    )


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
