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
import logging
import socket
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from datetime import timedelta
from typing import Any, Iterable

import torch
import torch.distributed as dist

from ..errors import RefitAborted, RefitError, RefitTimeout
from ..protocol import RankMap

__all__ = ["RefitError", "RefitTimeout", "RankMap", "RefitGroup"]

_CONNECT_TAG = (1 << 30) + 1  # never a bucket's tag
_REJECTED = object()  # a control value that is missing or failed authentication
_log = logging.getLogger("mcore_reshard.transport")


def _listen(host: str, port: int) -> socket.socket:
    """A listening socket bound to ``host:port`` only (the store's server takes its fd)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(256)
    return sock


def error_class(e: BaseException) -> type[RefitError]:
    """``RefitTimeout`` when a backend error says a wait ran out, else ``RefitError``."""
    text = str(e).lower()
    return RefitTimeout if "timed out" in text or "timeout" in text else RefitError


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
        self._key = hashlib.sha256(b"hmac|").digest()
        #: Store keys whose value failed authentication (reported, never used).
        self.rejected: list[str] = []
        self._waiter: ThreadPoolExecutor | None = None
        self._posted_abort = False
        self._epoch = 0
        self._store_dead = False

    @classmethod
    def create(cls, host: str, port: int, rank: int, world_size: int, timeout_s: float, is_master: bool,
               device: str | torch.device = "cpu", *, rank_map: RankMap | None = None,
               prefix: str = "mcore_reshard/refit", secret: str = "") -> "RefitGroup":
        """Rendezvous at ``host:port`` (the master serves the store) and build the backend.

        The master's store listens on ``host`` only (a socket bound there is handed to the
        store), never on a wildcard address. Keys live under a prefix derived from the job's
        ``secret``, and every control message is authenticated with it (:meth:`exchange`), so
        a process without the secret can neither find the group's keys nor plant a message.
        ``rank_map`` defaults to the disaggregated map with no destinations; pass the real one
        (``RankMap.disaggregated(num_src, num_dst)``) so errors can name sides and ranks.
        """
        rank_map = rank_map or RankMap(tuple(range(world_size)), ())
        if rank_map.world_size > world_size or not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} / rank map of {rank_map.world_size} group ranks do not fit a group of "
                             f"{world_size}")
        timeout = timedelta(seconds=timeout_s)
        listener = _listen(host, port) if is_master else None
        tcp = dist.TCPStore(host, port, world_size, is_master, timeout=timeout, wait_for_workers=False,
                            master_listen_fd=listener.fileno() if listener is not None else None)
        tag = hashlib.sha256(f"prefix|{secret}".encode()).hexdigest()[:24]
        store = dist.PrefixStore(f"{prefix}/{tag}", tcp)
        device = torch.device(device)
        if device.type == "cuda":
            pg = _nccl_group(store, rank, world_size, timeout, device)
        else:
            pg = dist.ProcessGroupGloo(store, rank, world_size, timeout)
        if listener is not None:
            listener.detach()  # the store's server owns (and closes) the fd now: never close it twice
        group = cls(store, pg, rank, world_size, timeout_s, device, rank_map, tcp)
        group._key = hashlib.sha256(f"hmac|{secret}".encode()).digest()
        return group

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

    def derived_key(self, purpose: str) -> bytes:
        """A key for ``purpose`` (e.g. naming shared-memory segments) derived from the job's
        secret; the control plane's own MAC key never leaves this object."""
        return hmac.new(self._key, f"derive|{purpose}".encode(), hashlib.sha256).digest()

    def _sign(self, key: str, body: str) -> str:
        mac = hmac.new(self._key, f"{key}\0{body}".encode(), hashlib.sha256).hexdigest()
        return json.dumps({"mac": mac, "body": body})

    def _open(self, key: str, raw: bytes) -> Any:
        """Decode one control message; an unauthenticated value is reported and ignored."""
        try:
            msg = json.loads(raw)
            good = hmac.compare_digest(
                msg["mac"], hmac.new(self._key, f"{key}\0{msg['body']}".encode(), hashlib.sha256).hexdigest())
        except (ValueError, KeyError, TypeError):
            good = False
        if not good:
            self.rejected.append(key)
            _log.warning("refit group: ignored an unauthenticated control value under %r", key)
            return _REJECTED
        return json.loads(msg["body"])

    def exchange(self, obj: Any, timeout_s: float | None = None) -> list[Any]:
        """All-gather a small JSON-able value among all group ranks through the store (no
        tensors, no backend: it works before the data plane is trusted and after it broke).

        Values are JSON with an HMAC under the job secret: nothing read from the network is
        unpickled, and a value planted by a process without the secret is ignored (and listed
        in ``rejected``). Every rank must call it the same number of times (keys are
        sequenced). Raises ``RefitTimeout`` naming the ranks that never contributed.
        """
        ranks = range(self.world_size)
        timeout_s = timeout_s or self.timeout_s
        seq = self._seq
        self._seq += 1
        keys = [f"ctl/{seq}/{r}" for r in ranks]
        mine = keys[self.rank]
        self.store.set(mine, self._sign(mine, json.dumps(obj)))
        values: list[Any] = [_REJECTED] * self.world_size
        deadline = time.monotonic() + timeout_s
        while True:
            missing = [r for r in ranks if values[r] is _REJECTED]
            present = [r for r in missing if self.store.check([keys[r]])]
            if present:
                for r, raw in zip(present, self.store.multi_get([keys[r] for r in present])):
                    values[r] = self._open(keys[r], raw)
                missing = [r for r in ranks if values[r] is _REJECTED]
            if not missing:
                break
            if time.monotonic() > deadline:
                who = ", ".join(self.rank_map.describe_group_rank(r) for r in missing)
                raise RefitTimeout(f"control exchange #{seq}: no answer from {who} within {timeout_s}s")
            msg = self.abort_message()
            if msg is not None:
                raise RefitAborted(f"aborted by another rank: {msg}")
            time.sleep(0.005)
        if seq:
            # Every rank posted #seq only after reading all of #seq-1: this rank's old key is
            # dead, so the store does not grow with every refit of a long run.
            self.store.delete_key(f"ctl/{seq - 1}/{self.rank}")
        return values

    # -- abort signal: a failing rank stops every other rank in well under a second ----------

    def begin_refit(self) -> None:
        """A new refit on this group (every rank calls it once per refit, in step): aborts
        are per refit, so a group that survived a failed refit can run the next one."""
        self._epoch += 1
        self._posted_abort = False

    def post_abort(self, message: str) -> None:
        """Tell every rank of the group to stop (authenticated; the first message wins)."""
        if self.store is None or self._store_dead:
            return
        key = f"abort/{self._epoch}"
        body = self._sign(key, json.dumps(message))
        self._posted_abort = True
        try:
            self.store.compare_set(key, "", body)
        except Exception:  # noqa: BLE001 - the master (and so the store) may be gone already
            pass

    def abort_message(self) -> str | None:
        """The abort another rank posted in this group, or None (this rank knows its own)."""
        if self._posted_abort:
            return None
        key = f"abort/{self._epoch}"
        if self._store_dead:
            return None
        try:
            if not self.store.check([key]):
                return None
            value = self._open(key, self.store.get(key))
        except Exception:  # noqa: BLE001 - the master (and its store) is gone
            # Never poll a dead store again: its peers' data-plane waits end on their own
            # (the master's connections closed with it) and name the real failure.
            self._store_dead = True
            return None
        return None if value is _REJECTED else str(value)

    def wait_work(self, work: Any, timeout_s: float, poll_s: float = 0.05) -> None:
        """``work.wait`` with a deadline that also stops at another rank's abort signal.

        Gloo cannot cancel a posted receive, so the wait runs on a helper thread while this
        one watches the store; on an abort it raises ``RefitAborted`` at once and leaves the
        blocked wait behind (the group is broken and will be closed anyway)."""
        if self._waiter is None:
            self._waiter = ThreadPoolExecutor(1, thread_name_prefix="refit-wait")
        fut = self._waiter.submit(work.wait, timedelta(seconds=timeout_s))
        while True:
            try:
                fut.result(timeout=poll_s)
                return
            except FutureTimeout:
                msg = self.abort_message()
                if msg is not None:
                    self._waiter.shutdown(wait=False)  # its thread is stuck in the wait
                    self._waiter = None
                    raise RefitAborted(f"aborted by another rank: {msg}") from None

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

    def vote(self, ok: bool, payload: Any, timeout_s: float | None = None) -> tuple[bool, list[Any]]:
        """Two-phase commit over the control plane: every rank votes once per refit.

        Returns ``(commit, payloads)``: commit only when every rank voted ok; abort as soon as
        any vote present says no (a rank that failed does not make the others wait for the
        rest). ``payloads[r]`` is rank r's payload, or None where it had not voted yet. A rank
        that never votes aborts everyone after ``timeout_s``.
        """
        timeout_s = timeout_s or self.timeout_s
        seq = self._seq
        self._seq += 1
        keys = [f"vote/{seq}/{r}" for r in range(self.world_size)]
        self.store.set(keys[self.rank], self._sign(keys[self.rank], json.dumps({"ok": ok, "payload": payload})))
        votes: list[Any] = [_REJECTED] * self.world_size
        deadline = time.monotonic() + timeout_s
        while True:
            missing = [r for r in range(self.world_size) if votes[r] is _REJECTED]
            present = [r for r in missing if self.store.check([keys[r]])]
            if present:
                for r, raw in zip(present, self.store.multi_get([keys[r] for r in present])):
                    votes[r] = self._open(keys[r], raw)
            got = [v for v in votes if v is not _REJECTED]
            if any(not v["ok"] for v in got) or len(got) == self.world_size:
                break
            if time.monotonic() > deadline:
                break
            time.sleep(0.005)
        payloads = [None if v is _REJECTED else v["payload"] for v in votes]
        commit = all(v is not _REJECTED and v["ok"] for v in votes)
        return commit, payloads

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
            pg, self.pg = self.pg, None
            if self._waiter is not None:
                self._waiter.shutdown(wait=False)
                self._waiter = None
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
