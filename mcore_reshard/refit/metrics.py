"""What a refit measured: every rank's ``RankReport`` gathered into ``RefitMetrics``.

Apart from the driver so that it stays orchestration only: the numbers depend on the
reports and the plan alone, and every transport reports through the same ``RefitMetrics``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..plan.types import TransferPlan
from ..wire.protocol import RankReport, RefitRequest

__all__ = ["RefitMetrics", "bytes_at_minimum", "reshard_metrics"]


@dataclass(frozen=True)
class RefitMetrics:
    """One refit, as reported (``refit --json`` prints these keys)."""

    transport: str
    bytes_moved: int  # over the wire, all ranks
    bytes_min: int  # theoretical minimum for the destination layout
    seconds: float  # wall time at the driver, start to every rank done
    transfer_seconds: float  # slowest rank's data-plane time
    peak_extra_bytes: int  # largest buffer footprint of any rank
    verified: bool  # checksum verification ran and passed on every destination rank
    token_mult_prob_error: float | None = None
    plan_digest: str = ""
    plan_cached: bool = False
    notes: tuple[str, ...] = ()
    #: Slowest rank's seconds per phase (src_/dst_ pack, wire, unpack, verify; dst_apply_open:
    #: layers back to model format, dst_apply_process: vLLM's processing, dst_apply_commit: copy
    #: into kernel tensors, dst_apply_finish; hf_broadcast: gather, root, receive_and_reload).
    phases: dict[str, float] = field(default_factory=dict)
    #: The part of ``bytes_moved`` that went through shared memory (same-device pairs).
    bytes_same_device: int = 0
    #: The part of ``bytes_moved`` received zero-copy (large contiguous boxes, no buffers).
    bytes_zero_copy: int = 0
    #: Seconds the engines served nothing, the longest over engines (pause call to resume
    #: returning): the whole refit when it blocks; overlapped (``refit.overlap``), the swap.
    pause_seconds: float = 0.0
    #: Whether the engines kept generating while the weights moved (``refit.overlap``).
    overlapped: bool = False
    #: Delta refits (``refit.delta``): what a full refit would have moved (``bytes_moved`` is
    #: what did); whether this one sent deltas, and why not; changed elements / elements (1.0
    #: for a full refit); boxes sent unchanged (nothing), sparse, dense; the most bytes one
    #: rank keeps as its baseline.
    bytes_full: int = 0
    #: The part of ``bytes_moved`` that was delta headers (8 bytes per box).
    bytes_headers: int = 0
    delta: bool = False
    delta_fraction: float = 1.0
    delta_reason: str = ""
    delta_boxes: dict[str, int] = field(default_factory=dict)
    delta_state_bytes: int = 0

    @property
    def at_minimum(self) -> bool:
        """``bytes_at_minimum`` of this refit."""
        return bytes_at_minimum(self.bytes_moved, self.bytes_min, self.bytes_full, self.bytes_headers, self.delta)


def bytes_at_minimum(moved: int, minimum: int, full: int, headers: int, delta: bool) -> bool:
    """Whether a refit moved what the plan promises: a full refit exactly the minimum, a delta
    refit the changes of a refit of the minimum (its boxes' encodings are never larger than the
    boxes) plus its headers."""
    if not delta:
        return moved == minimum
    return full == minimum and moved - headers <= full


def reshard_metrics(reports: list[RankReport], seconds: float, cached: bool, request: RefitRequest,
                    plan: TransferPlan, dst_world: int) -> RefitMetrics:
    """A reshard refit's metrics from every rank's report (``plan``: the one it ran;
    ``dst_world``: the destination ranks, every one of which must report a verified pass)."""
    src = [r for r in reports if r.side == "src"]
    dst = [r for r in reports if r.side == "dst"]
    phases: dict[str, float] = {}
    for side, rs in (("src", src), ("dst", dst)):
        for r in rs:
            for k, v in r.phases.items():
                key = f"{side}_{k}"
                phases[key] = round(max(phases.get(key, 0.0), v), 6)
    # Verified: checksums were asked of the ranks in this very request, and every destination
    # rank reported a pass (not the driver's default config, which a caller may override).
    checked = request.verify.checksums and len(dst) == dst_world and all(r.verified for r in dst)
    return RefitMetrics(
        transport="reshard",
        bytes_moved=sum(r.bytes_received for r in dst),
        bytes_min=plan.bytes_min,
        seconds=seconds,
        transfer_seconds=max((r.seconds for r in reports), default=0.0),
        peak_extra_bytes=max((r.peak_extra_bytes for r in reports), default=0),
        verified=checked,
        plan_digest=plan.digest(),
        plan_cached=cached,
        phases=phases,
        bytes_same_device=sum(r.bytes_same_device for r in dst),
        bytes_zero_copy=sum(r.bytes_zero_copy for r in dst),
        **_delta_metrics(src, dst, reports),
    )


def _delta_metrics(src: list[RankReport], dst: list[RankReport], reports: list[RankReport]) -> dict[str, Any]:
    """The delta part of ``RefitMetrics`` from every rank's report."""
    on = bool(reports) and all(r.delta.on for r in reports)
    elements = sum(r.delta.elements for r in src)
    boxes = [sum(r.delta.boxes[i] for r in src) for i in range(3)]
    return {
        "bytes_full": sum(r.bytes_full for r in dst),
        "bytes_headers": sum(r.bytes_headers for r in dst),
        "delta": on,
        "delta_fraction": sum(r.delta.changed for r in src) / elements if on and elements else 1.0,
        "delta_reason": next((r.delta.reason for r in reports if r.delta.reason), ""),
        "delta_boxes": dict(zip(("unchanged", "sparse", "dense"), boxes)) if on else {},
        "delta_state_bytes": max((r.delta.state_bytes for r in reports), default=0),
    }
