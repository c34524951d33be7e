"""``mcore_reshard.refit.servers`` without vLLM: bad input in one line, and the order of calls a failed
update leaves behind, against a real HTTP server (stdlib) that answers like vLLM's RL routes
(the real server is ``test_http_server.py``, slow)."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Iterator

import pytest

from mcore_reshard.errors import ConfigError, RefitFailed
from mcore_reshard.refit.servers import ServerClient, Timeouts, refit_servers
from mcore_reshard.jobs.serve import BACKEND_CONFIG, server_argv


class _Routes(BaseHTTPRequestHandler):
    calls: list[tuple[str, dict]] = []
    fail: str = ""

    def _reply(self, status: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_POST(self) -> None:  # noqa: N802 - http.server's name
        n = int(self.headers.get("Content-Length") or 0)
        body = json.loads(self.rfile.read(n) or b"{}")
        self.calls.append((self.path, body))
        if self.path == "/finish_weight_update" and self.fail == "/update_weights" and not body:
            self._reply(500, {"error": {"message": "Call to collective_rpc method failed: Worker failed with error "
                                        "'finish_weight_update called without a matching start_weight_update.'",
                                        "type": "InternalServerError", "code": 500}})
        elif self.path.split("?")[0] == self.fail:
            self._reply(500, {"error": {"message": "refit not committed: vLLM destination rank 0: RefitError:\n boom",
                                        "type": "InternalServerError", "code": 500}})
        else:
            self._reply(200, {"message": "ok"} if "reset" not in self.path else {"success": True})

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def routes() -> Iterator[tuple[str, type[_Routes]]]:
    handler = type("Routes", (_Routes,), {"calls": [], "fail": ""})
    srv = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    try:
        yield f"http://127.0.0.1:{srv.server_address[1]}", handler
    finally:
        srv.shutdown()
        srv.server_close()


def test_failed_update_finishes_without_version_and_stays_paused(routes):
    url, h = routes
    h.fail = "/update_weights"
    with pytest.raises(RefitFailed) as e:
        refit_servers([url], {"request": {}}, "v1", init_info={"join": {}}, timeouts=Timeouts(call_s=5))
    line = str(e.value)
    assert "\n" not in line and line.startswith(f"{url} POST /update_weights: HTTP 500: refit not committed")
    assert "kept paused" in line
    assert [p for p, _ in h.calls] == ["/pause?mode=wait", "/init_weight_transfer_engine", "/start_weight_update",
                                       "/update_weights", "/finish_weight_update"]
    assert h.calls[-1][1] == {}  # no new weight_version: the server keeps its last committed one


def test_good_refit_runs_the_whole_sequence(routes):
    url, h = routes
    refit_servers([url, url], {"request": {}}, "v1", init_info=[{"join": {"dst_offset": 0}}, {"join": {"dst_offset": 1}}],
                  timeouts=Timeouts(call_s=5))
    paths = [p for p, _ in h.calls]
    assert sorted(b["init_info"]["join"]["dst_offset"] for p, b in h.calls if p == "/init_weight_transfer_engine") == [0, 1]
    assert paths == ["/pause?mode=wait"] * 2 + ["/init_weight_transfer_engine"] * 2 + ["/start_weight_update"] * 2 + ["/update_weights"] * 2 + \
        ["/finish_weight_update"] * 2 + ["/reset_prefix_cache"] * 2 + ["/resume"] * 2
    assert all(b == {"weight_version": "v1"} for p, b in h.calls if p == "/finish_weight_update")


def test_failure_before_update_resumes_the_old_weights(routes):
    url, h = routes
    h.fail = "/start_weight_update"
    with pytest.raises(RefitFailed, match=r"HTTP 500: .*\(refit not started: no weights changed, servers resumed\)$"):
        refit_servers([url], {"request": {}}, "v1", timeouts=Timeouts(call_s=5))
    assert [p for p, _ in h.calls] == ["/pause?mode=wait", "/start_weight_update", "/resume"]


def test_overlapped_refit_serves_until_the_swap_and_pauses_only_for_it(routes):
    """``request.overlap``: no pause before the update; ``before_swap`` runs while the servers
    serve (nothing paused yet); then pause(keep), swap, reset (running requests preempted with
    the recompute setting), resume."""
    url, h = routes
    seen = []
    notes = refit_servers([url], {"request": {"overlap": True}}, "v2", timeouts=Timeouts(call_s=5),
                          before_swap=lambda: seen.append([p for p, _ in h.calls]),
                          recompute_kv_cache_after_weight_updates=True)
    assert notes == []
    assert seen == [["/start_weight_update", "/update_weights"]]
    assert [p for p, _ in h.calls] == ["/start_weight_update", "/update_weights", "/pause?mode=keep",
                                       "/finish_weight_update", "/reset_prefix_cache?reset_running_requests=true",
                                       "/resume"]


def test_overlapped_refit_that_fails_at_the_swap_stays_paused(routes):
    url, h = routes
    h.fail = "/finish_weight_update"
    with pytest.raises(RefitFailed, match=r"POST /finish_weight_update: HTTP 500: refit not committed.*kept paused\)$"):
        refit_servers([url], {"request": {"overlap": True}}, "v2", timeouts=Timeouts(call_s=5))
    paths = [p for p, _ in h.calls]
    assert paths[:4] == ["/start_weight_update", "/update_weights", "/pause?mode=keep", "/finish_weight_update"]
    assert "/resume" not in paths  # a failed swap is never served


def test_unreachable_server_names_it():
    with pytest.raises(RefitFailed, match=r"^http://127.0.0.1:9 POST /pause: ConnectError"):
        refit_servers(["http://127.0.0.1:9"], {}, "v1", timeouts=Timeouts(call_s=2))


def test_bad_input_is_one_line_naming_the_parameter():
    with pytest.raises(ConfigError, match=r"Timeouts.update_s=0"):
        Timeouts(update_s=0)
    with pytest.raises(ConfigError, match=r"base_url='localhost:8000'"):
        ServerClient("localhost:8000")
    with pytest.raises(ConfigError, match=r"^before_swap is for overlapped refits"):
        refit_servers(["http://127.0.0.1:9"], {"request": {"overlap": False}}, "v1", before_swap=lambda: None)
    with pytest.raises(ConfigError, match=r"servers=\[\]"):
        refit_servers([], {"request": {"overlap": True}}, "v1")
    with pytest.raises(ConfigError, match=r"servers=\[\]"):
        refit_servers([], {}, "v1")
    with pytest.raises(ConfigError, match=r"weight_version=''"):
        refit_servers(["http://127.0.0.1:9"], {}, "")
    with pytest.raises(ConfigError, match=r"^init_info: one body per server is needed for 2 servers"):
        refit_servers(["http://127.0.0.1:9"] * 2, {}, "v1", init_info={"join": {}})
    with pytest.raises(ConfigError, match=r"^init_info: expected 2 mappings \(one per server\), got 1 items"):
        refit_servers(["http://127.0.0.1:9"] * 2, {}, "v1", init_info=[{"join": {}}])
    with pytest.raises(ValueError, match=r"model='--port'"):
        server_argv("--port")


def test_server_argv_adds_the_backend_and_the_versioned_route_unless_named():
    assert server_argv("ckpt", ["--port", "1"]) == ["--model", "ckpt", "--weight-transfer-config", BACKEND_CONFIG,
                                                    "--enable-scale-out", "--port", "1"]
    assert server_argv("ckpt", ["--weight-transfer-config={}", "--no-enable-scale-out"]) == [
        "--model", "ckpt", "--weight-transfer-config={}", "--no-enable-scale-out"]
