"""The refit process group: one data plane spanning training and inference ranks.

Megatron and each vLLM worker already own a default process group; a refit must touch
neither. So the group is built by hand from a ``TCPStore`` rendezvous, a ``PrefixStore`` (so
several groups can share one store) and a backend object (``ProcessGroupGloo`` on CPU,
``ProcessGroupNCCL`` on GPU) that is never registered as a default. It is created once and
reused for every refit.

Failure model: every wait has a timeout. Gloo closes a pair after a timeout or a peer's
death, so after any ``RefitError`` the group is broken: ``close()`` it and create a new one.
"""

from __future__ import annotations

import pickle
from collections import Counter
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Iterable

import torch
import torch.distributed as dist

from ..ports import free_port

__all__ = ["RefitError", "RefitTimeout", "RankMap", "RefitGroup", "free_port"]

_CONNECT_TAG = (1 << 30) + 1  # never a bucket's tag


class RefitError(RuntimeError):
    """A refit failed; the message names the peer (side, rank, group rank) and the bucket."""


class RefitTimeout(RefitError):
    """A wait ran past its timeout (a peer is slow, stuck or gone)."""


def error_class(e: BaseException) -> type[RefitError]:
    """``RefitTimeout`` when a backend error says a wait ran out, else ``RefitError``."""
    text = str(e).lower()
    return RefitTimeout if "timed out" in text or "timeout" in text else RefitError


@dataclass(frozen=True)
class RankMap:
    """Which group rank each source (training) and destination (inference) rank is.

    ``src[r]`` / ``dst[r]`` are group ranks. A group rank may be both (colocated refit), in
    which case its messages to itself never touch the wire.
    """

    src: tuple[int, ...]
    dst: tuple[int, ...]

    @staticmethod
    def disaggregated(num_src: int, num_dst: int) -> "RankMap":
        """Separate processes: source r -> r, destination r -> num_src + r."""
        return RankMap(tuple(range(num_src)), tuple(range(num_src, num_src + num_dst)))

    @staticmethod
    def colocated(num_ranks: int) -> "RankMap":
        """Each process is source r and destination r (trainer and engine share a process)."""
        return RankMap(tuple(range(num_ranks)), tuple(range(num_ranks)))

    @property
    def world_size(self) -> int:
        return max(self.src + self.dst, default=-1) + 1

    def group_rank(self, side: str, rank: int) -> int:
        return (self.src if side == "src" else self.dst)[rank]

    def roles(self, group_rank: int) -> tuple[int | None, int | None]:
        """(source rank, destination rank) played by ``group_rank``; None where it plays none."""
        s = self.src.index(group_rank) if group_rank in self.src else None
        d = self.dst.index(group_rank) if group_rank in self.dst else None
        return s, d

    def describe(self, side: str, rank: int) -> str:
        """Human name used in every error, e.g. ``destination rank 1 (group rank 3)``."""
        word = "source" if side == "src" else "destination"
        return f"{word} rank {rank} (group rank {self.group_rank(side, rank)})"

    def describe_group_rank(self, group_rank: int) -> str:
        s, d = self.roles(group_rank)
        parts = ([f"source rank {s}"] if s is not None else []) + ([f"destination rank {d}"] if d is not None else [])
        return f"{' / '.join(parts) or 'no role'} (group rank {group_rank})"


class RefitGroup:
    """A process group private to refits, plus a store-backed control channel.

    Use ``RefitGroup.create`` on every participating process with the same host/port/world.
    """

    def __init__(self, store: dist.Store, pg: Any, rank: int, world_size: int, timeout_s: float,
                 device: torch.device, rank_map: RankMap, tcp_store: dist.Store | None = None) -> None:
        self.store = store
        self.pg = pg
        self.rank = rank
        self.world_size = world_size
        self.timeout_s = timeout_s
        self.device = device
        self.rank_map = rank_map
        self._tcp_store = tcp_store  # keep the master's server alive as long as the group
        self._seq = 0
        self._buffers: dict[str, torch.Tensor] = {}
        #: Keep wire buffers between refits (no allocation and first-touch page faults per
        #: refit, at the price of holding them); ``release_buffers()`` frees them.
        self.keep_buffers = True
        self._connected: set[int] = set()

    @classmethod
    def create(cls, host: str, port: int, rank: int, world_size: int, timeout_s: float, is_master: bool,
               device: str | torch.device = "cpu", *, rank_map: RankMap | None = None,
               prefix: str = "mcore_reshard/refit") -> "RefitGroup":
        """Rendezvous at ``host:port`` (the master serves the store) and build the backend.

        ``rank_map`` defaults to the disaggregated map with no destinations; pass the real one
        (``RankMap.disaggregated(num_src, num_dst)``) so errors can name sides and ranks.
        """
        rank_map = rank_map or RankMap(tuple(range(world_size)), ())
        if rank_map.world_size > world_size or not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} / rank map of {rank_map.world_size} group ranks do not fit a group of "
                             f"{world_size}")
        timeout = timedelta(seconds=timeout_s)
        tcp = dist.TCPStore(host, port, world_size, is_master, timeout=timeout, wait_for_workers=False)
        store = dist.PrefixStore(prefix, tcp)
        device = torch.device(device)
        if device.type == "cuda":
            pg = _nccl_group(store, rank, world_size, timeout, device)
        else:
            pg = dist.ProcessGroupGloo(store, rank, world_size, timeout)
        return cls(store, pg, rank, world_size, timeout_s, device, rank_map, tcp)

    # -- wire buffers ----------------------------------------------------------------------

    def buffer(self, name: str, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A 1-D buffer of at least ``numel`` elements, reused across refits when
        ``keep_buffers`` (a refit's buckets have the same sizes every time)."""
        buf = self._buffers.get(name) if self.keep_buffers else None
        if buf is None or buf.dtype != dtype or buf.numel() < numel:
            buf = torch.empty(numel, dtype=dtype, device=self.device)
            if self.keep_buffers:
                self._buffers[name] = buf
        return buf[:numel]

    def release_buffers(self) -> None:
        self._buffers.clear()

    # -- data plane (single-tensor overloads; the caller waits with a timeout) --------------

    def send(self, tensor: torch.Tensor, dst: int, tag: int) -> dist.Work:
        return self.pg.send([tensor], dst, tag)

    def recv(self, tensor: torch.Tensor, src: int, tag: int) -> dist.Work:
        return self.pg.recv([tensor], src, tag)

    def broadcast(self, tensor: torch.Tensor, root: int, timeout_s: float | None = None) -> torch.Tensor:
        opts = dist.BroadcastOptions()
        opts.rootRank = root
        opts.rootTensor = 0
        work = self.pg.broadcast([tensor], opts)
        work.wait(timedelta(seconds=timeout_s or self.timeout_s))
        return tensor

    def connect(self, peers: Iterable[int], timeout_s: float | None = None) -> None:
        """Exchange one byte with every peer not yet connected, in one global pair order.

        NCCL creates a pair's communicator on the pair's first op and blocks both ends until
        the other joins; if ranks met their peers in arbitrary order that could form a cycle.
        Here every rank walks its pairs by increasing peer rank, i.e. all pairs in
        lexicographic (low, high) order, and the lower rank sends. Done once per pair per group
        (gloo connects at creation, so there it is only a cheap liveness check).
        """
        wait = timedelta(seconds=timeout_s or self.timeout_s)
        ping = torch.zeros(1, dtype=torch.uint8, device=self.device)
        for g in sorted(set(peers) - self._connected - {self.rank}):
            try:
                (self.send(ping, g, _CONNECT_TAG) if self.rank < g else self.recv(ping, g, _CONNECT_TAG)).wait(wait)
            except RuntimeError as e:
                cls = error_class(e)
                first = str(e).splitlines()[0] if str(e) else type(e).__name__
                raise cls(f"{self.rank_map.describe_group_rank(self.rank)}: connecting to "
                          f"{self.rank_map.describe_group_rank(g)} failed (before bucket 0): {first}") from e
            self._connected.add(g)

    # -- control plane (small picklable objects through the store) -------------------------

    def exchange(self, obj: Any, timeout_s: float | None = None) -> list[Any]:
        """All-gather a small object among all group ranks through the store (no tensors, no
        backend: it works before the data plane is trusted and after it broke).

        Every rank must call it the same number of times (keys are sequenced). Raises
        ``RefitTimeout`` naming the ranks that never contributed.
        """
        ranks = range(self.world_size)
        timeout_s = timeout_s or self.timeout_s
        seq = self._seq
        self._seq += 1
        keys = [f"ctl/{seq}/{r}" for r in ranks]
        self.store.set(f"ctl/{seq}/{self.rank}", pickle.dumps(obj))
        try:
            self.store.wait(keys, timedelta(seconds=timeout_s))
        except Exception as e:  # noqa: BLE001 -- the store raises a bare RuntimeError/DistStoreError
            missing = [r for r, k in zip(ranks, keys) if not self.store.check([k])]
            who = ", ".join(self.rank_map.describe_group_rank(r) for r in missing) or "unknown"
            raise RefitTimeout(f"control exchange #{seq}: no answer from {who} within {timeout_s}s") from e
        values = [pickle.loads(v) for v in self.store.multi_get(keys)]
        if seq:
            # Every rank posted #seq only after reading all of #seq-1: this rank's old key is
            # dead, so the store does not grow with every refit of a long run.
            self.store.delete_key(f"ctl/{seq - 1}/{self.rank}")
        return values

    def check_agreement(self, value: Any, what: str = "plan digest", timeout_s: float | None = None) -> None:
        """Every rank contributes ``value``; all must agree before the first byte moves.

        Raises ``RefitError`` on every rank naming the rank(s) that disagree with the majority.
        """
        values = self.exchange(value, timeout_s)
        counts = Counter(values)
        if len(counts) == 1:
            return
        majority, _ = max(counts.items(), key=lambda kv: (kv[1], -values.index(kv[0])))
        bad = [r for r, v in enumerate(values) if v != majority]
        detail = "; ".join(f"{self.rank_map.describe_group_rank(r)} has {values[r]!r}" for r in bad)
        raise RefitError(f"{what} disagreement: most ranks have {majority!r} but {detail}")

    def barrier(self, timeout_s: float | None = None) -> None:
        self.exchange(None, timeout_s)

    def close(self, *, barrier: bool = True) -> None:
        """Release the backend. With ``barrier`` every rank waits for the others first, so the
        master's store outlives every user of it. Safe to call twice."""
        if self.pg is None:
            return
        try:
            if barrier:
                self.barrier()
        finally:
            pg, self.pg = self.pg, None
            try:
                pg.shutdown()
            except Exception:  # noqa: BLE001 -- shutdown is best-effort on every backend
                pass
            self.store = None
            self._tcp_store = None


def _nccl_group(store: dist.Store, rank: int, world: int, timeout: timedelta, device: torch.device) -> Any:
    """GPU backend (not exercised on CPU machines): NCCL, bound to ``device``."""
    from torch.distributed import ProcessGroupNCCL  # lazy: absent from CPU builds

    torch.cuda.set_device(device)
    opts = ProcessGroupNCCL.Options()
    opts._timeout = timeout
    return ProcessGroupNCCL(store, rank, world, opts)
