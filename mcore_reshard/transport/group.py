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

import hashlib
import hmac
import json
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from datetime import timedelta
from typing import Any, Callable, Iterable

import torch
import torch.distributed as dist

from ..errors import RefitAborted, RefitError, RefitTimeout
from ..plan.tags import CONNECT_TAG, live_tag
from ..ports import bound_store
from ..protocol import RankMap
from .control import ControlPlane, Decision

__all__ = ["RefitError", "RefitTimeout", "RankMap", "RefitGroup"]



def error_class(e: BaseException) -> type[RefitError]:
    """``RefitTimeout`` when a backend error says a wait ran out, else ``RefitError``."""
    text = str(e).lower()
    return RefitTimeout if "timed out" in text or "timeout" in text else RefitError


class RefitGroup:
    """A process group private to refits, plus its signed control plane (``control.py``).

    Use ``RefitGroup.create`` on every participating process with the same host/port/world.
    """

    def __init__(self, store: dist.Store, pg: Any, rank: int, world_size: int, timeout_s: float,
                 device: torch.device, rank_map: RankMap, tcp_store: dist.Store | None = None,
                 control: ControlPlane | None = None) -> None:
        self.store = store
        self.pg = pg
        self.rank = rank
        self.world_size = world_size
        self.timeout_s = timeout_s
        self.device = device
        self.rank_map = rank_map
        self._tcp_store = tcp_store  # keep the master's server alive as long as the group
        self._buffers: dict[str, torch.Tensor] = {}
        #: Keep wire buffers between refits (no allocation and first-touch page faults per
        #: refit, at the price of holding them); ``release_buffers()`` frees them.
        self.keep_buffers = True
        self._connected: set[int] = set()
        self.control = control or ControlPlane(store, rank, world_size, rank_map, hashlib.sha256(b"hmac|").digest(),
                                               "", timeout_s)
        self.control.dead_peers = self._dead_peers
        self._waiter: ThreadPoolExecutor | None = None
        self._watch: ThreadPoolExecutor | None = None
        self._live: dict[int, Any] = {}  # group rank -> future of its liveness wait (rank 0 only)
        self._live_sent: list[Any] = []
        self._watched = False  # this refit ends with a vote that releases rank 0's watch

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
        timeout = timedelta(seconds=timeout_s)
        tcp = bound_store(host, port, world_size, is_master, timeout_s)
        store = dist.PrefixStore(prefix, tcp)
        device = torch.device(device)
        if device.type == "cuda":
            pg = _nccl_group(store, rank, world_size, timeout, device)
        else:
            pg = dist.ProcessGroupGloo(store, rank, world_size, timeout)
        key = hashlib.sha256(f"hmac|{secret}".encode()).digest()
        control = ControlPlane(store, rank, world_size, rank_map, key, nonce, timeout_s)
        return cls(store, pg, rank, world_size, timeout_s, device, rank_map, tcp, control)

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
                (self.send(ping, g, CONNECT_TAG) if self.rank < g else self.recv(ping, g, CONNECT_TAG)).wait(wait)
            except RuntimeError as e:
                cls = error_class(e)
                first = str(e).splitlines()[0] if str(e) else type(e).__name__
                raise cls(f"{self.rank_map.describe_group_rank(self.rank)}: connecting to "
                          f"{self.rank_map.describe_group_rank(g)} failed (before bucket 0): {first}") from e
            self._connected.add(g)

    # -- liveness: a rank that dies is known to every rank in well under a second ----------------
    #
    # A dead process's sockets are closed by its kernel; gloo reports that to a thread blocked
    # in ``wait`` on a pending receive from it (not to a poll). So group rank 0 keeps one such
    # wait per peer for each refit (a one-byte message every peer sends once it has learned
    # the decision): a peer that dies at any step before that -- mid-transfer, between its
    # last byte and its vote, after its vote -- fails its wait at once, and rank 0 posts the
    # abort on its behalf. A stopped (SIGSTOPped) peer keeps its sockets: that is what the
    # timeout is for. Rank 0 itself hosts the store, so its death is seen by every rank's
    # next store call.

    def _live_tag(self) -> int:
        return live_tag(self.control.epoch)

    def _watch_peers(self) -> None:
        if self.rank != 0 or self.world_size < 2 or self.pg is None or self.device.type != "cpu":
            return  # NCCL reports a dead peer through its own watchdog, not to a waiting thread
        if self._watch is None:
            # Room for a second round in case a peer never released one (it left the group).
            self._watch = ThreadPoolExecutor(2 * (self.world_size - 1), thread_name_prefix="refit-live")
        # Waits of an earlier refit whose byte never came belong to a peer that left: drop them.
        self._live = {}
        # No timeout of its own: gloo closes a pair whose wait timed out, and a refit may
        # outlast ``timeout_s``; each wait ends with the peer's byte, its death or ``close``.
        tag, wait = self._live_tag(), timedelta(days=1)
        for g in range(1, self.world_size):
            work = self.recv(torch.zeros(1, dtype=torch.uint8, device=self.device), g, tag)
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
        if self.rank == 0 or self.pg is None or self.device.type != "cpu" or not self._watched:
            return
        try:
            self._live_sent = [self.send(torch.ones(1, dtype=torch.uint8, device=self.device), 0, self._live_tag())]
        except RuntimeError:
            pass  # rank 0 is gone; nothing to release

    # -- control plane ---------------------------------------------------------------------

    @property
    def rejected(self) -> Counter:
        return self.control.rejected

    def derived_key(self, purpose: str) -> bytes:
        """A key for ``purpose`` (e.g. naming shared-memory segments) derived from the job's
        secret; the control plane's own MAC key never leaves it."""
        return hmac.new(self.control._key, f"derive|{purpose}".encode(), hashlib.sha256).digest()

    def exchange(self, obj: Any, timeout_s: float | None = None) -> list[Any]:
        return self.control.exchange(obj, timeout_s)

    def begin_refit(self, epoch: int | None = None, *, watch: bool = False) -> None:
        """A new refit on this group (every rank calls it once per refit, in step, with the
        request's epoch): aborts and votes are per refit, so a group that survived a failed
        refit can run the next one. ``watch``: this refit ends with a vote (``decide``), in
        which every rank releases rank 0's liveness wait on it -- rank 0 then watches every
        peer's socket for this refit."""
        self.control.begin(self.control.epoch + 1 if not epoch else epoch)
        self._watched = watch
        if watch:
            self._watch_peers()

    def post_abort(self, message: str) -> None:
        """Tell every rank of the group to stop (signed, this rank's own key)."""
        self.control.post_abort(message)

    def abort_message(self) -> str | None:
        """Why another rank (or a dead peer, or a dead store) stops this refit, or None."""
        return self.control.abort_message()

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

    def check_agreement(self, value: Any, what: str = "plan digest", timeout_s: float | None = None) -> None:
        """Every rank contributes ``value``; all must agree before the first byte moves.

        Raises ``RefitError`` on every rank naming the rank(s) that disagree with the majority.
        """
        values = [json.dumps(v, sort_keys=True) for v in self.exchange(value, timeout_s)]
        counts = Counter(values)
        if len(counts) == 1:
            return
        majority, _ = max(counts.items(), key=lambda kv: (kv[1], -values.index(kv[0])))
        bad = [r for r, v in enumerate(values) if v != majority]
        detail = "; ".join(f"{self.rank_map.describe_group_rank(r)} has {values[r]}" for r in bad)
        raise RefitError(f"{what} disagreement: most ranks have {majority} but {detail}")

    def decide(self, ok: bool, payload: Any, error: str = "", timeout_s: float | None = None,
               after_vote: Callable[[], None] | None = None) -> Decision:
        """Vote and learn the refit's one decision (``ControlPlane.decide``); then release rank
        0's liveness wait on this rank."""
        decision = self.control.decide(ok, payload, error, timeout_s, after_vote)
        if decision.known:
            self.signal_done()
        return decision

    def barrier(self, timeout_s: float | None = None) -> None:
        self.exchange(None, timeout_s)

    def close(self, *, barrier: bool = True) -> None:
        """Release the backend. With ``barrier`` every rank waits for the others first, so the
        master's store outlives every user of it. Safe to call twice."""
        if self.pg is None:
            return
        try:
            if barrier:
                try:
                    self.barrier()
                except RefitAborted:
                    pass  # the refit failed on some rank; nobody waits for this group any more
        finally:
            self.control.forget()
            pg, self.pg = self.pg, None
            for pool in (self._waiter, self._watch):
                if pool is not None:
                    pool.shutdown(wait=False, cancel_futures=True)
            self._waiter = self._watch = None
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
