"""An engine worker joins the refit group with its plan slice, checked against what it holds.

``init_weight_transfer_engine``'s work (``engine.ReshardWeightTransferEngine.init_transfer_engine``),
apart from the engine's lifecycle. It never raises: one worker raising in vLLM's
``collective_rpc`` leaves the others' replies queued and poisons the engine's next call. A
slice the worker refuses is returned as the refusal line instead; the worker still joins, and
its first refit votes no with that line before a byte moves (``RefitEndpoint.refusal``).
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from ....errors import RefitError
from ....layout.descriptor import DTYPE_BYTES, LocalParam
from ....plan.types import RankPlan
from ....transport.participant import RefitEndpoint
from ....wire.protocol import EngineInitInfo, first_error_line
from ....wire.slice_store import fetch_slice

__all__ = ["join_with_slice", "check_slice"]


def join_with_slice(message: EngineInitInfo, local_rank: int, device: torch.device,
                    held: Callable[[], list[LocalParam]], refusal: str = "") -> RefitEndpoint:
    """A new endpoint for refit rank ``dst_offset + local_rank``, joined to the group ``message``
    names, holding its slice: from the message, or (``slice_digests``) read from the group's
    store after joining. ``refusal`` (an earlier step's, e.g. the LoRA adapter's) is kept as
    the first cause; the endpoint's ``refusal`` says why its first refit must vote no ("" when
    none). ``held`` gives this worker's pieces (recorded on first use)."""
    info = message.join
    rank = info.dst_offset + local_rank
    endpoint = RefitEndpoint("dst", rank, device)
    wire = message.slices.get(rank)
    by_digest = message.slice_digests.get(rank) if wire is None else None
    if by_digest is None:
        refusal = refusal or _take(endpoint, wire, message.plan_digest, held)
    try:
        endpoint.join(info)
    except Exception as exc:  # noqa: BLE001 - a worker without a group votes no at its refit
        refusal = refusal or f"{endpoint.who}: joining the refit group failed: {first_error_line(exc)}"
    if by_digest is not None and endpoint.group is not None:
        try:
            wire = fetch_slice(endpoint.group.store, str(by_digest), info.timeout_s, endpoint.who)
        except Exception as exc:  # noqa: BLE001 - reported by this worker's first vote
            refusal = first_error_line(exc)
        else:
            refusal = refusal or _take(endpoint, wire, message.plan_digest, held)
    endpoint.refusal = refusal
    return endpoint


def _take(endpoint: RefitEndpoint, wire: dict[str, Any] | None, digest: str,
          held: Callable[[], list[LocalParam]]) -> str:
    """Keep ``wire`` as the endpoint's slice once it is checked; the refusal line, or ""."""
    try:
        if wire is None:
            raise RefitError(f"vLLM destination rank {endpoint.rank}: the init info carries no plan slice "
                             f"(nor a slice digest) for it")
        endpoint.set_plan(wire, digest)
        check_slice(endpoint.slice, {p.name: p for p in held()}, endpoint.rank, digest)
    except Exception as exc:  # noqa: BLE001 - reported by this worker's first vote
        return first_error_line(exc)
    return ""


def check_slice(s: RankPlan, held: dict[str, LocalParam], rank: int, digest: str) -> None:
    """Every destination parameter the slice ``s`` writes exists here, receives exactly its
    non-padding elements, and arrives in its own dtype (or as its bits): raise ``RefitError``
    in one line naming the first that does not."""
    mine = {n: p.numel - p.padding for n, p in held.items()}
    # Tensors carried as their bits (``RankPlan.reinterpret``) are counted in wire elements.
    for name, real in s.reinterpret:
        if name in held:
            if held[name].dtype != real:
                raise RefitError(f"vLLM destination rank {rank}: plan {digest} carries {name!r} as {real} bits, "
                                 f"this worker holds it in {held[name].dtype}")
            mine[name] *= DTYPE_BYTES[real] // DTYPE_BYTES[s.dtype]
    got: dict[str, int] = {}
    for t in s.transfers:
        if t.dst_name not in mine:
            raise RefitError(f"vLLM destination rank {rank}: plan {digest} writes {t.dst_name!r}, "
                             f"which this worker does not hold")
        got[t.dst_name] = got.get(t.dst_name, 0) + t.box.numel
    bad = [n for n, k in got.items() if k != mine[n]]
    if bad:
        raise RefitError(f"vLLM destination rank {rank}: plan {digest} writes {got[bad[0]]} elements of "
                         f"{bad[0]!r}, this worker holds {mine[bad[0]]}")
    bits = dict(s.reinterpret)
    other = next((n for n in got if n not in bits and held[n].dtype != s.dtype), None)
    if other is not None:  # the wire would cast into it: not the weights the trainers verified
        raise RefitError(f"vLLM destination rank {rank}: plan {digest} carries {other!r} as {s.dtype}, this "
                         f"worker holds it in {held[other].dtype} (plan against the engine's dtype)")
