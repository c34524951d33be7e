"""Transport: moves a plan's bytes (in-process for tests, torch.distributed P2P for refits)."""

from .executor import Sink, TensorSink, TransferStats, execute_plan, raw_send_bandwidth, zero_fill_padding
from .group import RankMap, RefitError, RefitGroup, RefitTimeout

__all__ = [
    "RankMap",
    "RefitError",
    "RefitGroup",
    "RefitTimeout",
    "Sink",
    "TensorSink",
    "TransferStats",
    "execute_plan",
    "raw_send_bandwidth",
    "zero_fill_padding",
]
