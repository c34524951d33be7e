"""Fault injection for tests and soak runs (``tests/test_faults.py``, ``scripts/soak.py``): one
typed form.

A :class:`Fault` says what happens (a flipped bit, an exit or a stall at a protocol step);
:class:`TrainerFault` and :class:`EngineFault` say where it strikes (which rank of which side,
plus the count-based exits a sink or a source counts); :class:`Faults` is what one refit
injects. Nothing here runs in a production refit: ``RefitDriver.refit(faults=...)`` is the
only way in, the executor, the endpoints and the sinks take these as typed, optional arguments,
and each does nothing when its field is None. No production code patches an attribute to
inject one. What acts on a fault where bytes live (the bit flip, the exit after n reads or
writes) is in ``transport/injection.py``; these types are messages, so they import no torch.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Any, Mapping


__all__ = ["Fault", "TrainerFault", "EngineFault", "Faults"]



@dataclass(frozen=True)
class Fault:
    """Fault injection (tests, ``scripts/soak.py``; only the testing path sets one).

    ``bitflip`` flips the lowest bit of the first element a sender packs for bucket
    ``bucket``, after its checksum was taken -- a corrupted wire, which the destination's
    checksums must catch. With ``tensor`` set it strikes at the destination instead: the first
    box of that local tensor it receives (at view offset ``offset`` where >= 0) is corrupted
    where it landed, before it is hashed -- a broken write, which the checksums must catch too. ``exit`` ends the rank's process abruptly at protocol step ``at``;
    ``sleep`` stalls it there for ``seconds``. Steps (``transport/participant.py``):
    ``before_vote`` (after its last byte), ``after_vote`` (before the decision is known),
    ``after_decision`` (the decision read, before this rank commits). An ``exit`` with
    ``seconds`` waits that long first (so its peers get that far too)."""

    kind: str = "bitflip"
    bucket: int = 0
    at: str = ""
    seconds: float = 0.0
    tensor: str = ""
    offset: int = -1

    STEPS = ("before_vote", "after_vote", "after_decision")

    def __post_init__(self) -> None:
        if self.kind not in ("bitflip", "exit", "sleep"):
            raise ValueError(f"Fault.kind={self.kind!r} is not one of bitflip, exit, sleep")
        if self.kind != "bitflip" and self.at not in self.STEPS:
            raise ValueError(f"Fault.at={self.at!r} is not one of {list(self.STEPS)}")

    def hit(self, step: str) -> None:
        """Act if this fault is set for protocol step ``step``."""
        if self.kind == "bitflip" or self.at != step:
            return
        time.sleep(self.seconds)
        if self.kind == "exit":
            os._exit(23)

    def to_wire(self) -> dict:
        return {"kind": self.kind, "bucket": self.bucket, "at": self.at, "seconds": self.seconds,
                "tensor": self.tensor, "offset": self.offset}

    @staticmethod
    def from_wire(d: Mapping[str, Any]) -> "Fault":
        return Fault(str(d.get("kind", "bitflip")), int(d.get("bucket", 0)), str(d.get("at", "")),
                     float(d.get("seconds", 0.0)), str(d.get("tensor", "")), int(d.get("offset", -1)))


@dataclass(frozen=True)
class TrainerFault:
    """On training rank ``rank``: ``fault`` in its executor and vote, and/or its process exits
    abruptly after its packer read ``die_after_reads`` source tensors (a trainer dying
    mid-refit), and/or its packer raises at its ``raise_after_reads``-th read (a trainer whose
    refit fails mid-transfer: it posts its abort and votes no). Every rank receives it; only
    ``rank`` acts."""

    rank: int
    fault: Fault | None = None
    die_after_reads: int | None = None
    raise_after_reads: int | None = None


@dataclass(frozen=True)
class EngineFault:
    """On destination rank ``rank`` (a vLLM worker; a tuple: each of those): ``fault`` (``exit`` / ``sleep`` at a
    protocol step), and/or its process exits abruptly after ``exit_after_writes`` writes,
    and/or before receiving it adds 1 to the first element of the baseline a delta would
    start from for local parameter ``alter_baseline`` (its live weight, or the model-format
    copy of a repacked one): what the trainers last sent is then not what it holds."""

    rank: int | tuple[int, ...]
    fault: Fault | None = None
    exit_after_writes: int | None = None
    alter_baseline: str | None = None
    #: Post-load processing skipped for the layer of this local parameter (its kernel keeps
    #: what it was built from before: bytes right, computation stale).
    skip_processing: str | None = None
    #: The worker's LM head is cut loose from the tied embedding before the refit, so the refit
    #: updates the embedding only (a tied head updated on one side).
    untie_head: bool = False
    #: MLA's absorbed ``W_UK``/``W_UV`` are not rebuilt from the refit's ``kv_b_proj`` (state
    #: only decoding reads left stale; prefills still compute with the new weights).
    skip_absorption: bool = False

    def strikes(self, rank: int) -> bool:
        """Whether this fault is for destination ``rank``."""
        return rank in self.rank if isinstance(self.rank, tuple) else rank == self.rank

    @staticmethod
    def from_wire(d: Mapping[str, Any]) -> "EngineFault | None":
        """The form ``to_wire`` gives (``{}``: None)."""
        if not d:
            return None
        rank = d["rank"]
        return EngineFault(tuple(int(r) for r in rank) if isinstance(rank, list) else int(rank),
                           Fault.from_wire(d) if d.get("at") or d.get("tensor") else None,  # a step, or a landed box
                           int(d["exit_after_writes"]) if d.get("exit_after_writes") is not None else None,
                           str(d["alter_baseline"]) if d.get("alter_baseline") is not None else None,
                           str(d["skip_processing"]) if d.get("skip_processing") is not None else None,
                           bool(d.get("untie_head", False)), bool(d.get("skip_absorption", False)))

    def to_wire(self) -> dict[str, Any]:
        """``EngineUpdateInfo.fault``: what the weight-transfer engine reads."""
        out: dict[str, Any] = {"rank": list(self.rank) if isinstance(self.rank, tuple) else self.rank}
        if self.fault is not None:
            out.update(self.fault.to_wire())
        if self.exit_after_writes is not None:
            out["exit_after_writes"] = self.exit_after_writes
        if self.alter_baseline is not None:
            out["alter_baseline"] = self.alter_baseline
        if self.skip_processing is not None:
            out["skip_processing"] = self.skip_processing
        if self.untie_head:
            out["untie_head"] = True
        if self.skip_absorption:
            out["skip_absorption"] = True
        return out


@dataclass(frozen=True)
class Faults:
    """What one refit injects, on either side (None: nothing)."""

    trainer: TrainerFault | None = None
    engine: EngineFault | None = None
