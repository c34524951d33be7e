"""Plans are computed once per layout pair and reused for every refit.

The key is a digest of both layouts, so a changed layout (restart, other parallelism)
rebuilds the plan and an unchanged one never does. A layout the rules built from settings
(``get_layouts``, ``described_by``) is keyed by those settings instead: the rules are pure,
so equal settings give equal layouts, and digesting ~300k pieces costs a full-size command
about a tenth of its time. Layouts described live (the running job's) are digested.
"""

from __future__ import annotations

import hashlib
import weakref
from collections import OrderedDict
from typing import Any, Callable, Hashable

from ..layout.descriptor import SideLayout
from ..layout.memo import IdentityCache
from ..layout.quant import clear_quant_cache
from .placement import LINK_CLASSES, RankPlacement
from .planner import build_plan
from .report import clear_report_caches
from .types import TransferPlan, digest_text
from .validate import clear_reinterpreted_cache

__all__ = ["layout_digest", "layout_key", "described_by", "derived_from", "get_plan", "link_cost", "clear_plan_cache"]

_CACHE: "OrderedDict[tuple, TransferPlan]" = OrderedDict()
_MAX = 8


#: Digests of the last few layouts by identity (a CLI run asks for each side's digest once per
#: plan it builds: the plain one and the relays' charged one).
_DIGESTS = IdentityCache(4)


def layout_digest(side: SideLayout) -> str:
    """Stable hash of every piece of a side (order-independent across ranks' params)."""
    return _DIGESTS.get((side,), None, lambda: _digest(side))


#: Layouts that are a pure function of settings, by identity: id -> (a weak reference to the
#: layout, its settings). Weak: an entry goes with its layout (and a new object never finds
#: an entry of the one whose id it reuses: the entry leaves before the id is free).
_DESCRIBED: dict[int, tuple[weakref.ref, Hashable]] = {}


def described_by(side: SideLayout, settings: Hashable) -> SideLayout:
    """Record that ``side`` is what pure rules make of ``settings`` (hashable values: equal
    settings, equal layouts), so plan caches key it by them (:func:`layout_key`); returns it.
    Only this object: a layout made from it (``replace``, another pass) is digested."""
    i = id(side)
    _DESCRIBED[i] = (weakref.ref(side, lambda _, i=i: _DESCRIBED.pop(i, None)), settings)
    return side


def settings_of(side: SideLayout) -> Hashable | None:
    """The settings ``side`` was described by (:func:`described_by`), None if it was not."""
    hit = _DESCRIBED.get(id(side))
    return hit[1] if hit is not None and hit[0]() is side else None


def derived_from(side: SideLayout, base: SideLayout, how: Hashable) -> SideLayout:
    """Record that ``side`` is what a pure function ``how`` (its settings) makes of ``base``:
    described by (``how``, ``base``'s settings) where ``base`` is described, else left to
    be digested. Returns ``side``."""
    settings = settings_of(base)
    return side if settings is None else described_by(side, (how, settings))


def layout_key(side: SideLayout) -> Hashable:
    """What plan caches key a layout by: its settings where it was described by them
    (:func:`described_by`), else :func:`layout_digest`. Never equal across the two kinds."""
    settings = settings_of(side)
    return layout_digest(side) if settings is None else ("settings", settings)


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
    key = (layout_key(src), layout_key(dst), bucket_bytes, allow_cast, not_direct)
    if placement is not None:  # plans without one keep their keys
        key += (placement,)
    if charges:
        key += (charges,)
    return _cached(_CACHE, _MAX, key, lambda: build_plan(
        src, dst, bucket_bytes=bucket_bytes, allow_cast=allow_cast, not_direct=not_direct,
        link_cost=None if placement is None else link_cost(placement), charges=charges))


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


def link_cost(placement: RankPlacement) -> Callable[[int, int], int]:
    """Link class as a rank, cheapest first (``placement.LINK_CLASSES``)."""
    rank = {c: i for i, c in enumerate(LINK_CLASSES)}
    return lambda s, d: rank[placement.link(s, d)]


#: Plans for a placement (fan-out relays chosen), by layouts, placement, links and buckets:
#: choosing relays costs far more than the direct plan (20 s of 30 for DeepSeek-V3 on 1088
#: ranks), and the CLI, a recipe's dry run and the job each ask for the same one.
_PLACED: "OrderedDict[tuple, TransferPlan]" = OrderedDict()
_MAX_PLACED = 4


def get_placed_plan(src: SideLayout, dst: SideLayout, params: tuple, build: Callable[[], TransferPlan]) -> TransferPlan:
    """``build()`` once per (both layouts' keys, ``params``): ``plan_for_placement``'s cache."""
    return _cached(_PLACED, _MAX_PLACED, (layout_key(src), layout_key(dst), params), build)


#: Layouts by the settings that describe them (``settings.config.side_layouts``): a command
#: and tests that plan one model twice (the plan, then the CLI; a plan, then a dry run) would
#: rebuild ~300k pieces and digest them again, and miss every cache keyed by their identity.
_LAYOUTS: "OrderedDict[tuple, tuple[SideLayout, SideLayout]]" = OrderedDict()
_MAX_LAYOUTS = 2  # full-size pairs hold hundreds of MB


def get_layouts(key: tuple, build: Callable[[], tuple[SideLayout, SideLayout]]) -> tuple[SideLayout, SideLayout]:
    """``build()`` once per ``key`` (hashable settings the rules read, nothing else), least
    recently used pairs beyond the last two dropped; a ``build`` that raises caches nothing.
    Both layouts are described by ``key`` (:func:`described_by`)."""
    def described() -> tuple[SideLayout, SideLayout]:
        src, dst = build()
        return described_by(src, ("source", key)), described_by(dst, ("destination", key))

    return _cached(_LAYOUTS, _MAX_LAYOUTS, key, described)


def clear_plan_cache() -> None:
    """Forget every cached plan, layout, digest and report (full-size plans hold hundreds of MB)."""
    _CACHE.clear()
    _PLACED.clear()
    _DIGESTS.clear()
    _LAYOUTS.clear()
    _DESCRIBED.clear()
    clear_report_caches()
    clear_quant_cache()
    clear_reinterpreted_cache()
