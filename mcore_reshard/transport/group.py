"""The refit group: a data plane (``dataplane.py``) and a control side, composed.

``DataPlane`` moves bytes (point-to-point ops on a process group private to refits);
``RefitControl`` decides: the signed control plane (``control.py``: agreement, abort signal,
vote and decision) plus rank 0's liveness watch of every peer. ``RefitGroup`` holds one of
each and is what a refit uses; the one place it needs both at once is ``wait_work``, a data
plane wait that stops at a control plane abort.

Use ``RefitGroup.create`` on every participating process with the same host/port/world.
Failure model: every wait has a timeout; after any ``RefitError`` the group is broken:
``close()`` it and create a new one.
"""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from datetime import timedelta
from typing import Any, Callable, Iterable

import torch
import torch.distributed as dist

from ..errors import RefitAborted, RefitError, RefitTimeout
from ..plan.tags import live_tag
from ..infra.ports import bound_store
from ..wire.protocol import RankMap
from .control import ControlPlane, Decision
from .dataplane import DataPlane, backend, error_class

__all__ = ["RefitError", "RefitTimeout", "RankMap", "RefitControl", "RefitGroup", "error_class"]


class RefitControl(ControlPlane):
    """The control plane of one rank of a refit group: the signed messages (``ControlPlane``:
    the abort signal, the all-gather, the one decision) plus rank 0's liveness watch, which
    listens on the data plane ``data`` (the only place a dead peer shows). One object: the
    refit reaches it as ``group.control``, nothing forwards its calls.

    Liveness: a rank that dies is known to every rank in well under a second. A dead process's
    sockets are closed by its kernel; gloo reports that to a thread blocked in ``wait`` on a
    pending receive from it (not to a poll). So group rank 0 keeps one such wait per peer for
    each refit (a one-byte message every peer sends once it has learned the decision): a peer
    that dies at any step before that -- mid-transfer, between its last byte and its vote,
    after its vote -- fails its wait at once, and rank 0 posts the abort on its behalf. A
    stopped (SIGSTOPped) peer keeps its sockets: that is what the timeout is for. Rank 0 itself
    hosts the store, so its death is seen by every rank's next store call."""

    def __init__(self, store: dist.Store, data: DataPlane, key: bytes, nonce: str, timeout_s: float) -> None:
        super().__init__(store, data.rank, data.world_size, data.rank_map, key, nonce, timeout_s)
        self.data = data
        self.dead_peers = self._dead_peers
        self._watch: ThreadPoolExecutor | None = None
        self._live: dict[int, Any] = {}  # group rank -> future of its liveness wait (rank 0 only)
        self._live_sent: list[Any] = []
        self._watched = False  # this refit ends with a vote that releases rank 0's watch

    # -- the refit's lifecycle -------------------------------------------------------------

    def begin_refit(self, epoch: int | None = None, *, watch: bool = False) -> None:
        """A new refit on this group (every rank calls it once per refit, in step, with the
        request's epoch): aborts and votes are per refit, so a group that survived a failed
        refit can run the next one. ``watch``: this refit ends with a vote (``decide``), in
        which every rank releases rank 0's liveness wait on it -- rank 0 then watches every
        peer's socket for this refit."""
        self.begin(self.epoch + 1 if not epoch else epoch)
        self._watched = watch
        if watch:
            self._watch_peers()

    def check_agreement(self, value: Any, what: str = "plan digest", timeout_s: float | None = None) -> None:
        """Every rank contributes ``value``; all must agree before the first byte moves.

        Raises ``RefitError`` on every rank naming the rank(s) that disagree with the majority.
        """
        self.check_values(self.exchange(value, timeout_s), what)

    def check_values(self, exchanged: list[Any], what: str) -> None:
        """``check_agreement`` on values already exchanged (one per group rank)."""
        values = [json.dumps(v, sort_keys=True) for v in exchanged]
        counts = Counter(values)
        if len(counts) == 1:
            return
        majority, _ = max(counts.items(), key=lambda kv: (kv[1], -values.index(kv[0])))
        bad = [r for r, v in enumerate(values) if v != majority]
        detail = "; ".join(f"{self.rank_map.name_at(r)} has {values[r]}" for r in bad)
        raise RefitError(f"{what} disagreement: most ranks have {majority} but {detail}")

    def decide(self, ok: bool, payload: Any, error: str = "", timeout_s: float | None = None,
               after_vote: Callable[[], None] | None = None) -> Decision:
        """Vote and learn the refit's one decision (``ControlPlane.decide``); then release rank
        0's liveness wait on this rank."""
        decision = super().decide(ok, payload, error, timeout_s, after_vote)
        if decision.known:
            self.signal_done()
        return decision

    def barrier(self, timeout_s: float | None = None) -> None:
        self.exchange(None, timeout_s)

    # -- liveness --------------------------------------------------------------------------

    def _watch_peers(self) -> None:
        data = self.data
        if self.rank != 0 or self.world_size < 2 or data.pg is None or data.device.type != "cpu":
            return  # NCCL reports a dead peer through its own watchdog, not to a waiting thread
        if self._watch is None:
            # Room for a second round in case a peer never released one (it left the group).
            self._watch = ThreadPoolExecutor(2 * (self.world_size - 1), thread_name_prefix="refit-live")
        # Waits of an earlier refit whose byte never came belong to a peer that left: drop them.
        self._live = {}
        # No timeout of its own: gloo closes a pair whose wait timed out, and a refit may
        # outlast ``timeout_s``; each wait ends with the peer's byte, its death or ``close``.
        tag, wait = live_tag(self.epoch), timedelta(days=1)
        for g in range(1, self.world_size):
            work = data.recv(torch.zeros(1, dtype=torch.uint8, device=data.device), g, tag)
            self._live[g] = self._watch.submit(work.wait, wait)

    def _dead_peers(self) -> dict[int, str]:
        dead = {}
        for g, fut in self._live.items():
            if fut.done() and fut.exception() is not None:
                text = str(fut.exception()).strip()
                if "timeout" in text.lower() or "timed out" in text.lower():
                    continue  # this rank's own wait on that peer timed out: silent, not known dead
                dead[g] = "its connection closed" if "closed" in text.lower() else (text.splitlines() or ["?"])[0][:120]
        return dead

    def signal_done(self) -> None:
        """This rank learned the refit's decision: release rank 0's liveness wait on it."""
        data = self.data
        if self.rank == 0 or data.pg is None or data.device.type != "cpu" or not self._watched:
            return
        try:
            self._live_sent = [data.send(torch.ones(1, dtype=torch.uint8, device=data.device), 0,
                                         live_tag(self.epoch))]
        except RuntimeError:
            pass  # rank 0 is gone; nothing to release

    def close(self) -> None:
        """Forget this rank's control keys; stop watching. The byte that released rank 0's
        watch is flushed first: the data plane's teardown closes every socket at once, and
        rank 0 would otherwise read this rank's leaving as its death."""
        for work in self._live_sent:
            try:
                work.wait(timedelta(seconds=1))
            except RuntimeError:
                pass  # rank 0 is gone, or the wait closed the pairs: leaving either way
        self._live_sent = []
        self.forget()
        if self._watch is not None:
            self._watch.shutdown(wait=False, cancel_futures=True)
        self._watch = None


class RefitGroup:
    """A process group private to refits: its data plane (``DataPlane``; the calls a transfer
    makes are offered here) and its control plane, ``control`` (``RefitControl``: begin_refit,
    exchange, check_agreement, post_abort, abort_message, decide, ...)."""

    def __init__(self, store: dist.Store, pg: Any, rank: int, world_size: int, timeout_s: float,
                 device: torch.device, rank_map: RankMap, tcp_store: dist.Store | None = None,
                 key: bytes | None = None, nonce: str = "") -> None:
        self.store = store
        self.rank, self.world_size, self.timeout_s = rank, world_size, timeout_s
        self.device, self.rank_map = device, rank_map
        self._tcp_store = tcp_store  # keep the master's server alive as long as the group
        self.data = DataPlane(pg, rank, world_size, device, rank_map, timeout_s)
        #: The control plane (signed with the job's secret: ``key``).
        self.control = RefitControl(store, self.data, key or hashlib.sha256(b"hmac|").digest(), nonce, timeout_s)
        self._waiter: ThreadPoolExecutor | None = None

    @classmethod
    def create(cls, host: str, port: int, rank: int, world_size: int, timeout_s: float, is_master: bool,
               device: str | torch.device = "cpu", *, rank_map: RankMap | None = None,
               prefix: str = "mcore_reshard/refit", secret: str = "", nonce: str = "") -> "RefitGroup":
        """Rendezvous at ``host:port`` (the master serves the store) and build the backend.

        The master's store listens on ``host`` only (a socket bound there is handed to the
        store), never on a wildcard address. Every control message is signed with the job's
        ``secret`` and bound to this group's ``nonce`` (fresh per join: ``control.py`` says
        what that guarantees). ``rank_map`` defaults to the disaggregated map with no
        destinations; pass the real one so errors can name sides and ranks.
        """
        rank_map = rank_map or RankMap(tuple(range(world_size)), ())
        if rank_map.world_size > world_size or not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} / rank map of {rank_map.world_size} group ranks do not fit a group of "
                             f"{world_size}")
        tcp = bound_store(host, port, world_size, is_master, timeout_s)
        store = dist.PrefixStore(prefix, tcp)
        device = torch.device(device)
        pg = backend(store, rank, world_size, timeout_s, device)
        key = hashlib.sha256(f"hmac|{secret}".encode()).digest()
        return cls(store, pg, rank, world_size, timeout_s, device, rank_map, tcp, key, nonce)

    @property
    def pg(self) -> Any:
        """The backend process group (None once closed)."""
        return self.data.pg

    @property
    def rejected(self) -> Counter:
        return self.control.rejected

    @property
    def keep_buffers(self) -> bool:
        return self.data.keep_buffers

    @keep_buffers.setter
    def keep_buffers(self, keep: bool) -> None:
        self.data.keep_buffers = keep

    # -- data plane ------------------------------------------------------------------------

    def buffer(self, name: str, numel: int, dtype: torch.dtype) -> torch.Tensor:
        return self.data.buffer(name, numel, dtype)

    def release_buffers(self) -> None:
        self.data.release_buffers()

    def send(self, tensor: torch.Tensor, dst: int, tag: int) -> dist.Work:
        return self.data.send(tensor, dst, tag)

    def recv(self, tensor: torch.Tensor, src: int, tag: int) -> dist.Work:
        return self.data.recv(tensor, src, tag)

    def broadcast(self, tensor: torch.Tensor, root: int, timeout_s: float | None = None) -> torch.Tensor:
        return self.data.broadcast(tensor, root, timeout_s)

    def connect(self, peers: Iterable[int], timeout_s: float | None = None) -> None:
        self.data.connect(peers, timeout_s)

    # -- both ------------------------------------------------------------------------------

    def wait_work(self, work: Any, timeout_s: float, poll_s: float = 0.05) -> None:
        """``work.wait`` with a deadline that also stops at another rank's abort signal.

        Gloo cannot cancel a posted receive, so the wait runs on a helper thread while this
        one watches the control plane; on an abort it raises ``RefitAborted`` at once and
        leaves the blocked wait behind (the group is broken and will be closed anyway)."""
        if self._waiter is None:
            self._waiter = ThreadPoolExecutor(1, thread_name_prefix="refit-wait")
        fut = self._waiter.submit(work.wait, timedelta(seconds=timeout_s))
        while True:
            try:
                fut.result(timeout=poll_s)
                return
            except FutureTimeout:
                try:
                    self.control.raise_if_aborted()
                except RefitAborted:
                    self._waiter.shutdown(wait=False)  # its thread is stuck in the wait
                    self._waiter = None
                    raise

    def close(self, *, barrier: bool = True) -> None:
        """Release the backend. With ``barrier`` every rank waits for the others first, so the
        master's store outlives every user of it. Safe to call twice."""
        if self.data.pg is None:
            return
        try:
            if barrier:
                try:
                    self.control.barrier()
                except RefitAborted:
                    pass  # the refit failed on some rank; nobody waits for this group any more
        finally:
            self.control.close()
            if self._waiter is not None:
                self._waiter.shutdown(wait=False, cancel_futures=True)
            self._waiter = None
            self.data.shutdown()
            self.store = None
            self._tcp_store = None
