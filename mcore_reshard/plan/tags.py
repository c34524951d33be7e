"""The message tags of a refit: one tag space the executor, the group and the planner share.

gloo tags are C ints, so every kind of message has its own band below ``2**31``:

=======================  ===========================================================
``[0, B]``               plain bucket ``k`` (``B``: the checksums), ``k`` itself
``(B, 2**29)``           relayed messages: per (bucket, relay group, sent/forwarded, rank)
``[2**29, 2**30)``       zero-copy boxes: per (bucket, box of the pair), and the headers
                         of delta refits (which send no zero-copy box): per (bucket, relay group)
``2**30``                the teardown's receive, never sent (``DataPlane.shutdown``)
``2**30 + 1``            the group's connect handshake
``2**30 + 2 + ...``      consumed-buffer acknowledgements: per (bucket, relay group)
``2**31 - 4096 + e``     the liveness watch of refit epoch ``e`` (mod 4096)
=======================  ===========================================================

The planner asks ``relayed_tags_fit`` instead of restating the formula, so a plan it accepts
is one the executor can tag.
"""

from __future__ import annotations

from .types import PlanError

__all__ = [
    "MAX_RANKS", "CLOSE_TAG", "CONNECT_TAG", "ACK_TAG", "LIVE_TAG",
    "message_tag", "direct_tag", "header_tag", "ack_tag", "live_tag", "relayed_tags_fit",
]

#: Ranks a relayed message's tag can name (``config.MAX_WORLD``).
MAX_RANKS = 4096
_RELAY_LIMIT = 1 << 29
_DIRECT_BASE = 1 << 29
CLOSE_TAG = 1 << 30
CONNECT_TAG = (1 << 30) + 1
ACK_TAG = (1 << 30) + 2
LIVE_TAG = (1 << 31) - 4096


def message_tag(num_buckets: int, num_groups: int, k: int, g: int, forwarded_from: int | None = None) -> int:
    """Tag of the message of bucket ``k`` (``k = num_buckets``: the checksums) in relay group
    ``g`` (-1: none): ``k`` itself for a plain message; relayed ones after those, unique per
    (bucket, group, sent or forwarded, rank): a forwarded message carries its source's rank,
    relayed checksums the rank that forwards the message."""
    if g < 0 and forwarded_from is None:
        return k
    slot = ((k * (num_groups + 1) + g + 1) * 2 + (forwarded_from is not None and k < num_buckets))
    tag = num_buckets + 1 + slot * MAX_RANKS + (forwarded_from or 0)
    if tag >= _RELAY_LIMIT:
        raise PlanError(f"{num_buckets} buckets x {num_groups} relay groups need tags past 2**29: "
                        f"raise refit.buffer_bytes (fewer buckets)")
    return tag


def relayed_tags_fit(num_buckets: int, num_groups: int) -> bool:
    """Whether ``message_tag`` covers every (bucket, relay group) of a relayed plan."""
    return (num_buckets + 2) * (num_groups + 1) * 2 * MAX_RANKS < _RELAY_LIMIT


def direct_tag(k: int, i: int) -> int:
    """Tag of the ``i``-th zero-copy box of a pair in bucket ``k``."""
    if i >= 1 << 15 or k >= 1 << 13:
        raise PlanError(f"zero-copy tag out of range (bucket {k}, box {i})")
    return _DIRECT_BASE + (k << 16) + i


def header_tag(k: int, g: int) -> int:
    """Tag of a delta refit's header of bucket ``k``'s message in relay group ``g`` (-1: none):
    the upper half of the zero-copy band, which a delta refit does not use."""
    if g + 1 >= 1 << 15 or k >= 1 << 13:
        raise PlanError(f"delta header tag out of range (bucket {k}, relay group {g})")
    return _DIRECT_BASE + (k << 16) + (1 << 15) + g + 1


def ack_tag(num_groups: int, k: int, g: int) -> int:
    """Tag of the acknowledgement that bucket ``k``'s buffer of relay group ``g`` was consumed."""
    return ACK_TAG + k * (num_groups + 1) + g + 1


def live_tag(epoch: int) -> int:
    """Tag of the liveness watch of refit ``epoch``: above every other tag."""
    return LIVE_TAG + epoch % 4096
