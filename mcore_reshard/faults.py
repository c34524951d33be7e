"""Fault injection at the ends of a refit: which rank fails, and how (tests and soak runs only).

A production refit never sets these: ``RefitDriver.refit(faults=...)`` is the only way in, and
each end does nothing when its field is None. The fault itself (a flipped bit, an exit or a
stall at a protocol step) is ``transport.faults.Fault``; these messages say where it strikes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .transport.faults import Fault

__all__ = ["TrainerFault", "EngineFault", "Faults"]


@dataclass(frozen=True)
class TrainerFault:
    """On training rank ``rank``: ``fault`` in its executor and vote, and/or its process exits
    abruptly after its packer read ``die_after_reads`` source tensors (a trainer dying
    mid-refit). Every rank receives it; only ``rank`` acts."""

    rank: int
    fault: "Fault | None" = None
    die_after_reads: int | None = None


@dataclass(frozen=True)
class EngineFault:
    """On destination rank ``rank`` (a vLLM worker; a tuple: each of those): ``fault`` (``exit`` / ``sleep`` at a
    protocol step), and/or its process exits abruptly after ``exit_after_writes`` writes,
    and/or before receiving it adds 1 to the first element of the baseline a delta would
    start from for local parameter ``alter_baseline`` (its live weight, or the model-format
    copy of a repacked one): what the trainers last sent is then not what it holds."""

    rank: int | tuple[int, ...]
    fault: "Fault | None" = None
    exit_after_writes: int | None = None
    alter_baseline: str | None = None

    def to_wire(self) -> dict[str, Any]:
        """``ReshardUpdateInfo.fault``: what the weight-transfer engine reads."""
        out: dict[str, Any] = {"rank": list(self.rank) if isinstance(self.rank, tuple) else self.rank}
        if self.fault is not None:
            out.update(self.fault.to_wire())
        if self.exit_after_writes is not None:
            out["exit_after_writes"] = self.exit_after_writes
        if self.alter_baseline is not None:
            out["alter_baseline"] = self.alter_baseline
        return out


@dataclass(frozen=True)
class Faults:
    """What one refit injects, on either side (None: nothing)."""

    trainer: TrainerFault | None = None
    engine: EngineFault | None = None
