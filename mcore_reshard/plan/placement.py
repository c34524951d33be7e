"""Where ranks sit: a location per rank of both sides, and the link class between two ranks.

Every rank of both sides gets a :class:`Location` (node, device). A transfer is then
same-device (never needs the network: IPC or a copy), intra-node (NVLink-class) or inter-node
(the fabric). These are the plain values the planner takes (``RankPlacement``, ``Links``);
reading them from user settings, with the errors that name a setting, is the settings' job.
Wrong values here raise ``ValueError``.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

__all__ = ["Location", "Links", "RankPlacement", "LINK_CLASSES", "link_class", "same_device_pairs",
           "check_gpus_per_node"]

#: Link classes, cheapest first.
LINK_CLASSES = ("same_device", "intra_node", "inter_node")


@dataclass(frozen=True, order=True)
class Location:
    node: int
    device: int  # index within the node


@dataclass(frozen=True)
class Links:
    """Per-GPU link bandwidths in GB/s (10**9 bytes/s): NVLink-class inside a node, the
    fabric (one NIC per GPU) between nodes; same-device copies at HBM speed."""

    intra_node_gbps: float = 450.0
    inter_node_gbps: float = 50.0
    same_device_gbps: float = 2000.0

    def __post_init__(self) -> None:
        for name in ("intra_node_gbps", "inter_node_gbps", "same_device_gbps"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0):
                raise ValueError(f"{name}={v!r} must be a positive number of GB/s")

    def gbps(self, link: str) -> float:
        return {"same_device": self.same_device_gbps, "intra_node": self.intra_node_gbps,
                "inter_node": self.inter_node_gbps}[link]


@dataclass(frozen=True)
class RankPlacement:
    """The location of every source (training) and destination (inference) rank."""

    src: tuple[Location, ...]
    dst: tuple[Location, ...]
    gpus_per_node: int

    @classmethod
    def separate(cls, num_src: int, num_dst: int, gpus_per_node: int) -> "RankPlacement":
        """Trainers fill nodes 0.., inference ranks the nodes after them (non-colocated)."""
        check_gpus_per_node(gpus_per_node)
        src = tuple(Location(r // gpus_per_node, r % gpus_per_node) for r in range(num_src))
        first = -(-num_src // gpus_per_node)
        dst = tuple(Location(first + r // gpus_per_node, r % gpus_per_node) for r in range(num_dst))
        return cls(src, dst, gpus_per_node)

    @classmethod
    def colocated(cls, num_src: int, num_dst: int, gpus_per_node: int) -> "RankPlacement":
        """Training rank i and inference rank i share device i (NeMo RL's colocated mode)."""
        check_gpus_per_node(gpus_per_node)
        loc = lambda r: Location(r // gpus_per_node, r % gpus_per_node)  # noqa: E731
        return cls(tuple(map(loc, range(num_src))), tuple(map(loc, range(num_dst))), gpus_per_node)

    def link(self, src: int, dst: int) -> str:
        """Link class from training rank ``src`` to inference rank ``dst`` (asked once per
        candidate sender and per transfer: plain tuples, not ``Location.__eq__``)."""
        return _link(self._src_at[src], self._dst_at[dst])

    def dst_link(self, a: int, b: int) -> str:
        """Link class between two inference ranks (a relay forwarding inside a group)."""
        return _link(self._dst_at[a], self._dst_at[b])

    @cached_property
    def _src_at(self) -> tuple[tuple[int, int], ...]:
        return tuple((loc.node, loc.device) for loc in self.src)

    @cached_property
    def _dst_at(self) -> tuple[tuple[int, int], ...]:
        return tuple((loc.node, loc.device) for loc in self.dst)

    @property
    def dst_nodes(self) -> list[int]:
        return sorted({loc.node for loc in self.dst})


def link_class(a: Location, b: Location) -> str:
    return _link((a.node, a.device), (b.node, b.device))


def _link(a: tuple[int, int], b: tuple[int, int]) -> str:
    if a == b:
        return "same_device"
    return "intra_node" if a[0] == b[0] else "inter_node"


def check_gpus_per_node(gpus_per_node: int) -> None:
    """``ValueError`` unless ``gpus_per_node`` is an integer >= 1 (the message names it, so a
    settings reader can prefix its key)."""
    if not (isinstance(gpus_per_node, int) and not isinstance(gpus_per_node, bool) and gpus_per_node >= 1):
        raise ValueError(f"gpus_per_node={gpus_per_node!r} must be an integer >= 1")


def same_device_pairs(placement: RankPlacement) -> tuple[tuple[int, int], ...]:
    """(source rank, destination rank) pairs that share a device: their bytes move through
    shared memory (``transport/shm.py``), never through the network."""
    at: dict[Location, list[int]] = {}
    for d, loc in enumerate(placement.dst):
        at.setdefault(loc, []).append(d)
    return tuple((s, d) for s, loc in enumerate(placement.src) for d in at.get(loc, ()))
