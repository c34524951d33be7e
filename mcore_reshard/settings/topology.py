"""``topology.*`` settings: how the modelled cluster places both sides.

User input is checked here and refused with a ``ConfigError`` naming the key; the pure
planner only ever sees the plain values it defines (``plan.placement.RankPlacement`` and
``Links``), which this builds.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import ConfigError
from ..plan.placement import Links, RankPlacement, check_gpus_per_node

__all__ = ["TopologyConfig"]


@dataclass(frozen=True)
class TopologyConfig:
    """``topology.*`` of ``configs/plan.yaml``: how the modelled cluster places both sides."""

    gpus_per_node: int = 8
    #: separate: trainers fill their own nodes, inference ranks the next ones (non-colocated);
    #: colocated: training rank i and inference rank i share device i.
    placement: str = "separate"
    intra_node_gbps: float = 450.0
    inter_node_gbps: float = 50.0

    def __post_init__(self) -> None:
        try:
            check_gpus_per_node(self.gpus_per_node)
            Links(self.intra_node_gbps, self.inter_node_gbps)
        except ValueError as exc:
            raise ConfigError(f"topology.{exc}") from None
        if self.placement not in ("separate", "colocated"):
            raise ConfigError(f"topology.placement={self.placement!r} is not one of ['separate', 'colocated']")

    @property
    def links(self) -> Links:
        return Links(self.intra_node_gbps, self.inter_node_gbps)

    def place(self, num_src: int, num_dst: int) -> RankPlacement:
        """Every rank's location: training ranks ``0..num_src-1``, inference ranks ``0..num_dst-1``."""
        if self.placement == "colocated":
            if num_src != num_dst:
                raise ConfigError(f"topology.placement=colocated needs as many training ranks as inference ranks "
                                  f"(one of each per device), got {num_src} and {num_dst}")
            return RankPlacement.colocated(num_src, num_dst, self.gpus_per_node)
        return RankPlacement.separate(num_src, num_dst, self.gpus_per_node)
