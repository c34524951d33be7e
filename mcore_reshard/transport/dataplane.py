"""The refit group's data plane: point-to-point ops on a process group private to refits.

Megatron and each vLLM worker already own a default process group; a refit must touch
neither. So the group is built by hand from a ``TCPStore`` rendezvous, a ``PrefixStore`` (so
several groups can share one store) and a backend object (``ProcessGroupGloo`` on CPU,
``ProcessGroupNCCL`` on GPU) that is never registered as a default. It is created once and
reused for every refit.

Failure model: every wait has a timeout. Gloo closes a pair after a timeout or a peer's
death, so after any ``RefitError`` the group is broken: ``close()`` it and create a new one.

Two facts of gloo (torch 2.13) shape the teardown:

* a posted receive whose ``Work`` is dropped before it completes leaves the pair waiting for
  a buffer that is gone: the bytes that then arrive stay unread in the socket, and gloo's
  event loop wakes on them forever, a full core (a failed refit unwinds with receives still
  posted). So every posted receive is held here until it completes or the group closes;
* ``ProcessGroupGloo.shutdown`` and ``abort`` do nothing, and the pairs live as long as any
  ``Work`` does (a wait abandoned at an abort signal holds one until its timeout). A receive
  whose wait times out closes every pair of its context at once, so ``shutdown`` posts one
  receive nobody sends to and waits 1 ms: every socket of the group closes, every wait on it
  (here and at the peers) fails at once, and nothing is left to wake the loop.
"""

from __future__ import annotations

import re

from datetime import timedelta
from typing import Any, Iterable

import torch
import torch.distributed as dist

from ..errors import RefitError, RefitTimeout
from ..plan.tags import CLOSE_TAG, CONNECT_TAG
from ..wire.protocol import RankMap

__all__ = ["DataPlane", "backend", "error_class"]


def error_class(e: BaseException) -> type[RefitError]:
    """``RefitTimeout`` when a backend error says a wait ran out, else ``RefitError``."""
    text = str(e).lower()
    return RefitTimeout if not peer_closed(e) and ("timed out" in text or "timeout" in text) else RefitError


def peer_closed(e: BaseException) -> bool:
    """Whether a backend error says the peer's connection closed (its process died or left)."""
    text = str(e).lower()
    return "closed by peer" in text or "connection reset" in text or "broken pipe" in text


def backend_failure(e: BaseException, timeout_s: float, waited: float | None = None) -> str:
    """What a failed point-to-point op says happened, in words: a closed connection after the
    seconds it was waited on (a dead peer, known at once), or a wait that ran out its timeout
    (a silent peer), or the backend's first line -- without gloo's source path and sign-off."""
    if peer_closed(e):
        after = f" after {waited:.1f}s" if waited is not None else ""
        return f"the peer's connection closed{after} (its process died or left the group)"
    line = str(e).splitlines()[0] if str(e) else type(e).__name__
    line = re.sub(r"^\[[^\]]*\.(?:cc|cpp|h):\d+\]\s*", "", line)
    if error_class(e) is RefitTimeout:
        return f"no data within the timeout ({timeout_s}s): {line}"
    return line


def backend(store: dist.Store, rank: int, world_size: int, timeout_s: float, device: torch.device) -> Any:
    """A process group on ``store`` that is nobody's default: gloo on CPU, NCCL on GPU."""
    timeout = timedelta(seconds=timeout_s)
    if device.type == "cuda":
        return _nccl_group(store, rank, world_size, timeout, device)
    return dist.ProcessGroupGloo(store, rank, world_size, timeout)


class DataPlane:
    """Moves bytes between the group's ranks: single-tensor point-to-point ops (the caller
    waits with a timeout), a broadcast, and wire buffers kept between refits."""

    def __init__(self, pg: Any, rank: int, world_size: int, device: torch.device, rank_map: RankMap,
                 timeout_s: float) -> None:
        self.pg = pg
        self.rank, self.world_size, self.device, self.rank_map = rank, world_size, device, rank_map
        self.timeout_s = timeout_s
        self._buffers: dict[str, torch.Tensor] = {}
        #: Keep wire buffers between refits (no allocation and first-touch page faults per
        #: refit, at the price of holding them); ``release_buffers()`` frees them.
        self.keep_buffers = True
        self._connected: set[int] = set()
        #: Posted receives not known to have completed (see the module docstring): held until
        #: they complete or the group closes.
        self._posted: list[dist.Work] = []

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

    # -- ops -------------------------------------------------------------------------------

    def send(self, tensor: torch.Tensor, dst: int, tag: int) -> dist.Work:
        return self.pg.send([_bytes_if_fp8(tensor)], dst, tag)

    def recv(self, tensor: torch.Tensor, src: int, tag: int) -> dist.Work:
        work = self.pg.recv([_bytes_if_fp8(tensor)], src, tag)
        if len(self._posted) >= _PRUNE_AT:
            self._posted = [w for w in self._posted if not w.is_completed()]
        self._posted.append(work)  # the work keeps its tensor: nothing else needs holding
        return work

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
                (self.send(ping, g, CONNECT_TAG) if self.rank < g else self.recv(ping, g, CONNECT_TAG)).wait(wait)
            except RuntimeError as e:
                cls = error_class(e)
                first = str(e).splitlines()[0] if str(e) else type(e).__name__
                raise cls(f"{self.rank_map.name_at(self.rank)}: connecting to "
                          f"{self.rank_map.name_at(g)} failed (before bucket 0): {first}") from e
            self._connected.add(g)

    def shutdown(self) -> None:
        """Tear the backend down now (see the module docstring): on gloo every pair's socket
        closes in milliseconds, so no receive is left to wake its event loop and every peer's
        pending wait on this rank fails at once; NCCL is aborted. Safe to call twice."""
        pg, self.pg = self.pg, None
        if pg is None:
            return
        try:
            if self.device.type == "cpu":
                if self.world_size > 1:
                    probe = pg.recv([torch.zeros(1, dtype=torch.uint8)], (self.rank + 1) % self.world_size, CLOSE_TAG)
                    probe.wait(timedelta(milliseconds=1))
            else:
                pg.abort()
        except Exception:  # noqa: BLE001 -- the probe's timeout is what closes the pairs
            pass
        self._posted.clear()


#: Posted receives held before the completed ones among them are dropped.
_PRUNE_AT = 256


def _nccl_group(store: dist.Store, rank: int, world: int, timeout: timedelta, device: torch.device) -> Any:
    """GPU backend (not exercised on CPU machines): NCCL, bound to ``device``."""
    from torch.distributed import ProcessGroupNCCL  # lazy: absent from CPU builds

    torch.cuda.set_device(device)
    opts = ProcessGroupNCCL.Options()
    opts._timeout = timeout
    return ProcessGroupNCCL(store, rank, world, opts)


#: 1-byte float dtypes: moved as their bytes (``uint8``), which every backend carries (NCCL
#: builds before 2.24 have no FP8 type; the bytes are the same either way).
_FP8_DTYPES = frozenset(getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz")
                        if hasattr(torch, n))


def _bytes_if_fp8(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype in _FP8_DTYPES else t
