"""Transport: moves a plan's bytes (in-process for tests, torch.distributed P2P for refits)."""

from .executor import execute_plan, raw_send_bandwidth, zero_fill_padding
from .group import RankMap, RefitError, RefitGroup, RefitTimeout
from .sink import Sink, TensorSink
from .stats import TransferStats

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
