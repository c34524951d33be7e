"""Phase 4 of the planner: fragments split to the byte budget and packed into buckets, so no
rank sends or receives more than ``bucket_bytes`` in one bucket.

A *bucket* is what the transport moves at once (one message per peer and relay group,
``TransferPlan.num_buckets``, ``Transfer.bucket``); tensors go in model order so a receiver
can finish layers early. Parts are keyed, sorted and gathered column-wise (numpy's sort where
installed, the same order without) and transfers are built column by column
(``transfers_from_columns``): a full-size plan has ~300k of them.
"""

from __future__ import annotations

import itertools
import math
import operator
from typing import Callable, NamedTuple, Sequence

from ..layout.descriptor import Box, Piece
from .fragments import Blocks, Frag, Sender, new_sender
from .types import PlanError, Transfer, transfers_from_columns

try:  # optional: only speeds up placement keys and sorts, plans are the same without it
    import numpy as _np
except ImportError:  # pragma: no cover - numpy comes with torch
    _np = None

__all__ = ["Keys", "bucket", "split_fragment", "assign_buckets"]

_INT64_END = 1 << 63
#: Buckets a part tries one by one before ``_first_fit`` takes over (most fit in the first).
_SCAN = 4
#: Column getters (C-level: each maps over every block or part).
_BOX = operator.attrgetter("box")
_RANK, _LOCAL_NAME, _VIEW, _NUMEL = (operator.attrgetter(a) for a in ("rank", "local_name", "view", "numel"))

Site = Piece | Frag  # a destination site: rank, local_name, view
Charges = dict[tuple[int, str], tuple[int, ...]]  # (dst rank, local tensor) -> more dst ranks it counts against


class Keys(NamedTuple):
    """How placement keys are formed: ((tensor order * num_src + src) * num_dst + dst) * span
    + the box's offsets as a row-major index in its tensor (``strides``)."""

    num_src: int
    num_dst: int
    span: int
    strides: dict[str, tuple[int, ...]]


def bucket(blocks: Blocks, first_numel: dict[int, int], itemsize: int, budget: int, keys: Keys,
           charges: Charges | None = None) -> tuple[list[Transfer], int, int]:
    """Pack transfers into buckets so each rank sends <= budget and receives <= budget per
    bucket; tensors go in model order so the receiver can finish layers early.

    Parts are placed in (tensor, src, dst, offsets) order, one int key per part (the offsets
    as a row-major index); equal keys (a rank receiving the same elements twice) fall back to
    the merge order of their fragments (``first_numel``: by site index, the first fragment's
    size of a fused one). The result is sorted by (bucket, src, dst, tensor, offsets): parts
    are grouped by (bucket, src, dst) in placement order. Returns the transfers, the number
    of buckets and the bytes planned.
    """
    senders, counts, sites = blocks
    owner = list(itertools.chain.from_iterable(map(itertools.repeat, range(len(senders)), counts)))
    if itemsize > budget and sites:  # named as always: the first in (src, dst, tensor) order

        def rank_order(i: int) -> tuple[int, int, int]:
            sender = senders[owner[i]]
            return (sender.src, sites[i].rank, sender.order)

        first = senders[owner[min(range(len(sites)), key=rank_order)]]
        raise PlanError(f"{first.canonical}: bucket budget {budget} bytes is smaller than one element")
    tie_break = _merge_order(blocks, owner, range(len(sites)), first_numel)
    if senders and max(map(_NUMEL, map(_BOX, senders))) * itemsize > budget:
        cut = [(i, part) for i, site in enumerate(sites)
               for part in split_fragment(senders[owner[i]], site, itemsize, budget)]
        tie_break = _merge_order(blocks, owner, [i for i, _ in cut], first_numel)
        senders, sites = [s for _, (s, _) in cut], [f for _, (_, f) in cut]
        owner = list(range(len(cut)))
    placed = _placement(senders, owner, sites, keys, tie_break)
    return _pack(senders, owner, sites, placed, itemsize, budget, keys, charges)


def split_fragment(sender: Sender, site: Site, itemsize: int, budget: int) -> list[tuple[Sender, Site]]:
    """Cut a fragment larger than the budget into boxes that fit: along the outermost dim
    whose trailing slab fits the budget, one index at a time along the dims before it."""
    order, src, canonical, box, src_name, src_view = sender
    if box.numel * itemsize <= budget:
        return [(sender, site)]
    if itemsize > budget:
        raise PlanError(f"{canonical}: bucket budget {budget} bytes is smaller than one element")
    nd = len(box.sizes)
    d, slab = nd - 1, itemsize  # innermost: one element always fits
    for i in range(nd):
        trailing = math.prod(box.sizes[i + 1 :]) * itemsize
        if trailing <= budget:
            d, slab = i, trailing
            break
    step = max(1, budget // slab)
    parts = []
    for outer in itertools.product(*(range(n) for n in box.sizes[:d])):
        for start in range(0, box.sizes[d], step):
            offs = list(box.offsets)
            sizes = list(box.sizes)
            for i, k in enumerate(outer):
                offs[i] += k
                sizes[i] = 1
            offs[d] += start
            sizes[d] = min(step, box.sizes[d] - start)
            sub = Box(tuple(offs), tuple(sizes))
            parts.append((new_sender((order, src, canonical, sub, src_name, src_view.sub(box, sub))),
                          Frag(site.rank, site.local_name, site.view.sub(box, sub))))
    return parts


def _merge_order(blocks: Blocks, owner: list[int], parent: Sequence[int],
                 first_numel: dict[int, int]) -> Callable[[int], tuple]:
    """Tie-break for parts with equal keys: the merge order of the fragment (at site
    ``parent[i]``) that part ``i`` is (a cut of)."""
    senders, _, sites = blocks

    def merge_order(i: int) -> tuple:
        j = parent[i]
        sender, site = senders[owner[j]], sites[j]
        box = sender.box
        return (sender.src_name, site.local_name, box.offsets, -first_numel.get(j, box.numel), site.view.offset)

    return merge_order


def _placement(senders: list[Sender], owner: list[int], sites: list[Site], keys: Keys,
               tie_break: Callable[[int], tuple]) -> list[int]:
    """Part indices in placement order: by key; equal keys by ``tie_break``."""
    num_src, num_dst, span, strides = keys
    bases = [  # per block: the key without its destination rank
        (s.order * num_src + s.src) * num_dst * span + sum(map(operator.mul, s.box.offsets, strides[s.canonical]))
        for s in senders
    ]
    dst = list(map(_RANK, sites))
    if _np is not None and max(bases, default=0) + num_dst * span < _INT64_END:
        key_of = _np.array(bases, dtype=_np.int64)[_np.array(owner, dtype=_np.intp)]
        key_of += _np.array(dst, dtype=_np.int64) * span
        by_key = _np.argsort(key_of, kind="stable")
        ordered = key_of[by_key]
        ties = bool((ordered[1:] == ordered[:-1]).any())
        placed, key = by_key.tolist(), key_of.tolist() if ties else []
    else:
        key = [bases[b] + d * span for b, d in zip(owner, dst)]
        placed = sorted(range(len(key)), key=key.__getitem__)
        ties = len(set(key)) < len(key)
    if ties:
        placed.sort(key=lambda i: (key[i], *tie_break(i)))
    return placed


def _pack(senders: list[Sender], owner: list[int], sites: list[Site], placed: list[int], itemsize: int, budget: int,
          keys: Keys, charges: Charges | None = None) -> tuple[list[Transfer], int, int]:
    """Buckets for the placed parts, then the transfers sorted by (bucket, src, dst), stable."""
    pick = _gatherer(placed)
    gather, by_site = _gatherer(pick(owner)), pick(sites)
    # the senders' fields (in ``Sender``'s order) as columns per block, then per part by its
    # block: a transpose and C-level gathers, where reading each part's named tuple would cost
    # a Python-level lookup per part and field
    _, src_of, canonical_of, box_of, name_of, view_of = zip(*senders) if senders else ((),) * 6
    src, dst = gather(src_of), list(map(_RANK, by_site))
    nbytes = gather([numel * itemsize for numel in map(_NUMEL, box_of)])
    extra = [charges.get(k) for k in zip(dst, map(_LOCAL_NAME, by_site))] if charges else None
    buckets = assign_buckets(src, dst, nbytes, budget, keys.num_src, keys.num_dst, extra)
    made = transfers_from_columns(len(placed), [
        src, dst, gather(canonical_of), gather(box_of), gather(name_of), gather(view_of),
        map(_LOCAL_NAME, by_site), map(_VIEW, by_site), nbytes, buckets,
    ])
    final = _group_order(buckets, src, dst, keys.num_src, keys.num_dst)
    return list(map(made.__getitem__, final)), 1 + max(buckets) if buckets else 0, sum(nbytes)


def _gatherer(index: Sequence[int]) -> Callable[[Sequence], tuple]:
    """``column -> tuple(column[i] for i in index)`` in one C call per column (an ``itemgetter``
    of every index: no Python-level call per part, ~300k of them)."""
    if len(index) > 1:
        return operator.itemgetter(*index)
    return lambda column: tuple(column[i] for i in index)  # itemgetter of one index gives no tuple


def _group_order(buckets: Sequence[int], src: Sequence[int], dst: Sequence[int], num_src: int,
                 num_dst: int) -> list[int]:
    """Indices sorted by (bucket, src, dst), stable: placement order within a message. numpy's
    sort when it is installed (a few times faster on ~300k parts); the same order either way."""
    if _np is not None and (max(buckets, default=0) + 1) * num_src * num_dst < _INT64_END:
        group = (_np.array(buckets, dtype=_np.int64) * num_src + _np.array(src, dtype=_np.int64)) * num_dst
        return _np.argsort(group + _np.array(dst, dtype=_np.int64), kind="stable").tolist()
    group_of = [(k * num_src + s) * num_dst + d for k, s, d in zip(buckets, src, dst)]
    return sorted(range(len(group_of)), key=group_of.__getitem__)


def assign_buckets(src: Sequence[int], dst: Sequence[int], nbytes: Sequence[int], budget: int, num_src: int,
                   num_dst: int, extra: Sequence[Sequence[int] | None] | None = None) -> list[int]:
    """Greedy buckets in placement order: each part goes to the first bucket, from the first
    its ranks can still fill, where every rank it counts against stays within the budget (or
    all of them are empty there). A part counts against its source and destination, and
    against ``extra[i]``: more destination ranks (relay-group members, ``build_plan``'s
    ``charges``; None: none).

    The plan's hot loop (one pass per part, ~300k), written for speed: the source and
    destination slots stay in locals and are tested inline, a part's charged slots are
    looked at only when it has some (``_charged`` & co.), and nothing in here is referenced
    from a nested scope (a comprehension would turn the loop's locals into slower cells).
    """
    levels: list[list[int]] = []  # per bucket: bytes sent by each source, then received by each destination
    n = 0  # len(levels)
    cur = [0] * (num_src + num_dst)  # first bucket each rank slot can still fill
    full = budget - (budget >> 6)  # a bucket with less than 1/64 of the budget left is skipped
    out: list[int] = []
    width = num_src + num_dst
    low: dict[tuple[int, int], int] = {}  # see ``_first_fit``
    for s, d, nb, more in zip(src, dst, nbytes, extra or itertools.repeat(None)):
        d += num_src
        k = cur[s]
        kd = cur[d]
        if kd > k:
            k = kd
        if more is not None:
            more = _charged(more, d, num_src)
            if more is not None:
                k = _start(cur, more, k)
        stop = k + _SCAN  # where the one-by-one scan hands over to ``_first_fit``
        while True:
            if k == n:
                levels.append([0] * width)
                n += 1
            lv = levels[k]
            a, b = lv[s] + nb, lv[d] + nb
            if (a <= budget and b <= budget) or (a == nb and b == nb):
                if more is None or _room(lv, more, nb, budget, a, b):
                    break
            k += 1
            if k == stop and nb <= budget:
                k = _first_fit(levels, (s, d) if more is None else (s, d, *more), nb, budget, k, cur, low)
        lv[s] = a
        lv[d] = b
        if a > full and k == cur[s]:
            _advance(cur, s, levels, full)
        if b > full and k == cur[d]:
            _advance(cur, d, levels, full)
        if more is not None:
            _charge(levels, k, more, nb, cur, full)
        out.append(k)
    return out


def _charged(more: Sequence[int], d: int, num_src: int) -> tuple[int, ...] | None:
    """The slots of a part's charged destination ranks other than its own destination slot
    ``d``, each once (None: none left)."""
    return tuple(dict.fromkeys(m + num_src for m in more if m + num_src != d)) or None


def _start(cur: list[int], slots: Sequence[int], k: int) -> int:
    """The first bucket a part may go to, with its charged ``slots`` counted."""
    return max(k, max(cur[m] for m in slots))


def _room(lv: list[int], slots: Sequence[int], nb: int, budget: int, a: int, b: int) -> bool:
    """Whether a bucket (loads ``lv``) takes a part of ``nb`` bytes whose source and
    destination would be at ``a`` and ``b``, with its charged ``slots``: all within the
    budget, or all empty before it."""
    if a <= budget and b <= budget and all(lv[m] + nb <= budget for m in slots):
        return True
    return a == nb and b == nb and all(lv[m] == 0 for m in slots)


def _charge(levels: list[list[int]], k: int, slots: Sequence[int], nb: int, cur: list[int], full: int) -> None:
    """Count a part of ``nb`` bytes in bucket ``k`` against its charged ``slots``."""
    lv = levels[k]
    for m in slots:
        x = lv[m] = lv[m] + nb
        if x > full and k == cur[m]:
            _advance(cur, m, levels, full)


def _first_fit(levels: list[list[int]], ranks: Sequence[int], nb: int, budget: int, k: int, cur: list[int],
               low: dict[tuple[int, int], int]) -> int:
    """The first bucket from ``k`` where every rank of ``ranks`` has room for ``nb`` bytes
    (``len(levels)``: a new one), as the one-by-one scan finds it, without rescanning buckets.

    Loads only grow, so a bucket without room for ``nb`` on a rank never gets it again, and
    buckets before ``cur[rank]`` are never tried for it: ``low[(rank, nb)]`` remembers where
    that prefix ends. Parts of one size to one busy sender would otherwise each rescan all
    its buckets left just short of full (quadratic: minutes on a 2000-bucket plan)."""
    n = len(levels)
    while k < n:
        moved = False
        for rank in ranks:
            x = low.get((rank, nb), 0)
            if cur[rank] > x:
                x = cur[rank]
            while x < n and levels[x][rank] + nb > budget:
                x += 1
            low[(rank, nb)] = x  # the first bucket rank has room for nb in
            if x < k:
                x = k
                while x < n and levels[x][rank] + nb > budget:
                    x += 1
            if x > k:
                k, moved = x, True
        if not moved:
            break
    return k


def _advance(cur: list[int], rank: int, levels: list[list[int]], full: int) -> None:
    """Move rank slot ``rank`` past the buckets it has filled."""
    k = cur[rank]
    while k < len(levels) and levels[k][rank] > full:
        k += 1
    cur[rank] = k
