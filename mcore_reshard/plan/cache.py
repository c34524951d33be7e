"""Plans are computed once per layout pair and reused for every refit.

The key is a digest of both layouts, so a changed layout (restart, other parallelism)
rebuilds the plan and an unchanged one never does.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from typing import Any, Callable

from ..layout.descriptor import SideLayout
from ..layout.memo import IdentityCache
from ..layout.quant import clear_quant_cache
from .placement import LINK_CLASSES, RankPlacement
from .planner import build_plan
from .report import clear_report_caches
from .types import TransferPlan, digest_text
from .validate import clear_reinterpreted_cache

__all__ = ["layout_digest", "get_plan", "clear_plan_cache"]

_CACHE: "OrderedDict[tuple, TransferPlan]" = OrderedDict()
_MAX = 8


#: Digests of the last few layouts by identity (a CLI run asks for each side's digest once per
#: plan it builds: the plain one and the relays' charged one).
_DIGESTS = IdentityCache(4)


def layout_digest(side: SideLayout) -> str:
    """Stable hash of every piece of a side (order-independent across ranks' params)."""
    return _DIGESTS.get((side,), None, lambda: _digest(side))


def _digest(side: SideLayout) -> str:
    h = hashlib.sha256(f"{side.world_size}".encode())
    for name, (shape, dtype) in sorted(side.tensors.items()):
        h.update(f"{name}{tuple(shape)}{dtype}".encode())
    if side.quantize:  # layouts without it keep their digests
        h.update(f"quantize{side.quantize}".encode())
    if side.scale:  # likewise
        h.update(f"scale{side.scale}".encode())
    # Per piece ``canonical + box + view`` as text. The rules share Box and View objects
    # between ranks (a full-size vLLM side: ~300k pieces, ~1k boxes), so each one's text is
    # formatted once, by identity (they all stay alive for the call). Hashing one string per
    # local tensor instead of one per piece gives the same digest (sha256 of the concatenation).
    text: dict[int, str] = {}
    for p in sorted(side.params, key=lambda p: (p.rank, p.name)):
        parts = [f"{p.rank}|{p.name}|{p.shape}|{p.dtype}"]
        for q in p.pieces:
            parts.append(q.canonical + digest_text(text, q.box) + digest_text(text, q.view))
        h.update("".join(parts).encode())
    return h.hexdigest()[:16]


def get_plan(src: SideLayout, dst: SideLayout, *, bucket_bytes: int, allow_cast: bool = False,
             not_direct: tuple[tuple[str, str], ...] = (), placement: RankPlacement | None = None,
             charges: tuple[tuple[int, str, tuple[int, ...]], ...] = ()) -> TransferPlan:
    """The plan for both layouts (cached). ``placement``: senders are chosen by link class
    first (same device, same node, other node), then by load; part of the cache key.
    ``charges``: see ``build_plan`` (fan-out relays)."""
    key = (layout_digest(src), layout_digest(dst), bucket_bytes, allow_cast, not_direct)
    if placement is not None:  # plans without one keep their keys
        key += (placement,)
    if charges:
        key += (charges,)
    return _cached(_CACHE, _MAX, key, lambda: build_plan(
        src, dst, bucket_bytes=bucket_bytes, allow_cast=allow_cast, not_direct=not_direct,
        link_cost=None if placement is None else _link_cost(placement), charges=charges))


def _cached(cache: "OrderedDict[tuple, Any]", most: int, key: tuple, build: Callable[[], Any]) -> Any:
    """``cache[key]``, built on a miss (a ``build`` that raises caches nothing); least recently
    used entries beyond ``most`` dropped."""
    plan = cache.get(key)
    if plan is None:
        plan = cache[key] = build()
        while len(cache) > most:
            cache.popitem(last=False)
    else:
        cache.move_to_end(key)
    return plan


def _link_cost(placement: RankPlacement) -> Callable[[int, int], int]:
    """Link class as a rank, cheapest first (``placement.LINK_CLASSES``)."""
    rank = {c: i for i, c in enumerate(LINK_CLASSES)}
    return lambda s, d: rank[placement.link(s, d)]


#: Plans for a placement (fan-out relays chosen), by layouts, placement, links and buckets:
#: choosing relays costs far more than the direct plan (20 s of 30 for DeepSeek-V3 on 1088
#: ranks), and the CLI, a recipe's dry run and the job each ask for the same one.
_PLACED: "OrderedDict[tuple, TransferPlan]" = OrderedDict()
_MAX_PLACED = 4


def get_placed_plan(src: SideLayout, dst: SideLayout, params: tuple, build: Callable[[], TransferPlan]) -> TransferPlan:
    """``build()`` once per (both layouts' digests, ``params``): ``plan_for_placement``'s cache."""
    return _cached(_PLACED, _MAX_PLACED, (layout_digest(src), layout_digest(dst), params), build)


#: Layouts by the settings that describe them (``settings.config.side_layouts``): a command
#: and tests that plan one model twice (the plan, then the CLI; a plan, then a dry run) would
#: rebuild ~300k pieces and digest them again, and miss every cache keyed by their identity.
_LAYOUTS: "OrderedDict[tuple, tuple[SideLayout, SideLayout]]" = OrderedDict()
_MAX_LAYOUTS = 2  # full-size pairs hold hundreds of MB


def get_layouts(key: tuple, build: Callable[[], tuple[SideLayout, SideLayout]]) -> tuple[SideLayout, SideLayout]:
    """``build()`` once per ``key`` (hashable settings the rules read, nothing else), least
    recently used pairs beyond the last two dropped; a ``build`` that raises caches nothing."""
    return _cached(_LAYOUTS, _MAX_LAYOUTS, key, build)


def clear_plan_cache() -> None:
    """Forget every cached plan, layout, digest and report (full-size plans hold hundreds of MB)."""
    _CACHE.clear()
    _PLACED.clear()
    _DIGESTS.clear()
    _LAYOUTS.clear()
    clear_report_caches()
    clear_quant_cache()
    clear_reinterpreted_cache()
