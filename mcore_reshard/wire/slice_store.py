"""Plan slices by digest: the init info names each destination slice, the refit group's store
carries the slice itself.

Why: vLLM's ``init_weight_transfer_engine`` sends one ``init_info`` to every worker of an
engine, so carrying every worker's slice in it (``EngineInitInfo.slices``) makes each worker
receive all of them, through the HTTP body and every RPC hop: 48 KB for the tiny model, ~53 MiB
for Qwen3-30B-A3B on 16 vLLM ranks (3.4 MiB per slice). With ``slice_digests`` the init info
carries one digest per destination rank (16 hex digits, ~30 bytes a rank whatever the model's
size), and each worker, once it has joined the refit group, reads only its own slice from the
group's store, where a trainer (source rank 0 by convention) published it after joining.

Trust: the store (``TCPStore``) has no access control, so a slice read from it is only
accepted when it hashes to the digest the controller sent (``fetch_slice`` checks the wire's
digest, ``slice_from_wire`` re-hashes the content: SHA-256 truncated to 64 bits). The init
info stays the root of trust; a writer on the store can make a worker refuse its slice (the
refit then aborts), not run another one.
"""

from __future__ import annotations

import json
from datetime import timedelta
from typing import Any, Mapping

from ..errors import RefitError

__all__ = ["SLICE_KEY_PREFIX", "slice_key", "slice_digests", "publish_slices", "fetch_slice"]

#: Under the refit group's store prefix; content-addressed, so republishing is idempotent.
SLICE_KEY_PREFIX = "plan_slices/"


def slice_key(digest: str) -> str:
    if not isinstance(digest, str) or not digest or "/" in digest:
        raise ValueError(f"digest={digest!r} must be a non-empty slice digest without '/'")
    return SLICE_KEY_PREFIX + digest


def slice_digests(slices: Mapping[str, Mapping[str, Any]]) -> dict[str, str]:
    """``{destination rank: slice wire}`` -> ``{destination rank: slice digest}`` (what the
    init info's ``slice_digests`` carries)."""
    return {str(r): str(w["digest"]) for r, w in slices.items()}


def publish_slices(store: Any, slices: Mapping[str, Mapping[str, Any]]) -> dict[str, str]:
    """Write every slice under its digest in ``store`` (the refit group's ``group.store``, after
    joining) and return the ``slice_digests`` for the init info. Called once per join by one
    rank of the group: a new group (after a failed refit) has a new, empty store."""
    out = slice_digests(slices)
    for r, wire in slices.items():
        store.set(slice_key(out[str(r)]), json.dumps(wire, separators=(",", ":")))
    return out


def fetch_slice(store: Any, digest: str, timeout_s: float, who: str = "destination") -> dict[str, Any]:
    """This rank's slice wire, read from ``store`` once a peer has published it; waits up to
    ``timeout_s``. Raises ``RefitError`` naming ``who`` when it never comes or is not the one
    named (the caller's ``set_plan`` then re-hashes the content)."""
    key = slice_key(digest)
    try:
        store.wait([key], timedelta(seconds=timeout_s))
        wire = json.loads(store.get(key))
    except Exception as exc:  # noqa: BLE001 - TCPStore raises RuntimeError/DistStoreError/...
        why = (str(exc).strip().splitlines() or [""])[0][:200]
        raise RefitError(f"{who}: plan slice {digest[:16]} not published in the refit group's store within "
                         f"{timeout_s:g}s ({type(exc).__name__}: {why})") from None
    if not isinstance(wire, dict) or wire.get("digest") != digest:
        got = wire.get("digest") if isinstance(wire, dict) else type(wire).__name__
        raise RefitError(f"{who}: the store holds {got!r} under plan slice {digest[:16]}")
    return wire
