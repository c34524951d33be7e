"""The refit group's control plane admits only its own job: the store listens on the address
it is given, every control value is authenticated with the job's secret, nothing read from
the network is unpickled, and an abort reaches every rank at once."""

from __future__ import annotations

import pickle
import threading
import time
from datetime import timedelta

import psutil
import pytest
import torch.distributed as dist

from mcore_reshard.errors import RefitAborted
from mcore_reshard.ports import free_port
from mcore_reshard.transport.group import RankMap, RefitGroup


def _pair(secret: str = "s3cret", timeout_s: float = 10.0):
    rm, port, groups = RankMap.disaggregated(1, 1), free_port(), {}
    th = threading.Thread(target=lambda: groups.update(
        {1: RefitGroup.create("127.0.0.1", port, 1, 2, timeout_s, False, rank_map=rm, secret=secret)}))
    th.start()
    groups[0] = RefitGroup.create("127.0.0.1", port, 0, 2, timeout_s, True, rank_map=rm, secret=secret)
    th.join(20)
    return port, groups


def _close(groups):
    for g in groups.values():
        g.close(barrier=False)


def test_store_listens_only_on_the_given_address():
    port, groups = _pair()
    try:
        listening = [c for c in psutil.net_connections(kind="inet")
                     if c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port]
        assert listening, "the store's listening socket was not found"
        assert all(c.laddr.ip == "127.0.0.1" for c in listening), listening  # never 0.0.0.0 / ::
    finally:
        _close(groups)


class _Payload:
    """A pickle that would create a file if anyone unpickled it."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def test_planted_values_are_ignored_and_reported_never_unpickled(tmp_path):
    port, groups = _pair()
    marker = tmp_path / "pwned"
    try:
        # A stray client on the same store, even one that knew the job's key prefix (it cannot:
        # the prefix is derived from the secret), plants a pickle and a forged message.
        g0, g1 = groups[0], groups[1]
        g0.store.set("ctl/0/1", pickle.dumps(_Payload(str(marker))))  # planted through the real prefix
        got: dict = {}
        t = threading.Thread(target=lambda: got.update(v=g0.exchange({"from": 0}, timeout_s=10)))
        t.start()
        time.sleep(0.3)  # rank 0 has read and rejected the planted value by now
        assert "ctl/0/1" in g0.rejected
        assert g1.exchange({"from": 1}, timeout_s=10) == [{"from": 0}, {"from": 1}]
        t.join(10)
        assert got["v"] == [{"from": 0}, {"from": 1}]  # the real value replaced the planted one
        assert not marker.exists()  # nothing was unpickled
        # a forged abort (no valid MAC) stops nobody
        g0.store.set(f"abort/{g0._epoch}", '{"mac": "00", "body": "\\"stop\\""}')
        assert g0.abort_message() is None and f"abort/{g0._epoch}" in g0.rejected
    finally:
        _close(groups)


def test_a_group_with_another_secret_cannot_read_the_job(tmp_path):
    port, groups = _pair(secret="job-a")
    try:
        g0 = groups[0]
        g0.store.set("ctl/9/0", g0._sign("ctl/9/0", '"hello"'))
        # the same key through a prefix derived from another secret is simply not there
        other = dist.PrefixStore("mcore_reshard/refit/" + "0" * 24, dist.TCPStore(
            "127.0.0.1", port, 2, False, timeout=timedelta(seconds=5)))
        assert not other.check(["ctl/9/0"])
    finally:
        _close(groups)


def test_abort_reaches_a_rank_blocked_in_a_receive_within_a_second():
    """A rank waiting for bytes that will never come stops at the abort signal, not at its
    timeout (gloo cannot cancel the receive; the wait is abandoned)."""
    import torch

    port, groups = _pair(timeout_s=60.0)
    try:
        g0, g1 = groups[0], groups[1]
        g0.begin_refit()
        g1.begin_refit()
        work = g1.recv(torch.empty(4), 0, 7)  # rank 0 never sends
        threading.Timer(0.5, g0.post_abort, args=("source rank 0: injected failure",)).start()
        t0 = time.monotonic()
        with pytest.raises(RefitAborted, match="injected failure"):
            g1.wait_work(work, 60.0)
        assert time.monotonic() - t0 < 2.0
    finally:
        _close(groups)
