"""A controller for running vLLM servers as refit destinations: JSON over HTTP only.

vLLM's OpenAI-compatible server (started with ``VLLM_SERVER_DEV_MODE=1`` and
``--weight-transfer-config '{"backend": "mcore_reshard"}'``; ``python -m mcore_reshard.jobs.serve``)
exposes vLLM's weight-transfer API as routes. One refit of one or many servers is::

    POST /pause?mode=wait                  in-flight requests finish, new ones wait
    POST /init_weight_transfer_engine      {"init_info": ...}   once per refit group (join)
    POST /start_weight_update
    POST /update_weights                   {"update_info": ...} while the trainers refit
    POST /finish_weight_update             {"weight_version": ...}
    POST /reset_prefix_cache               KV blocks computed with the old weights
    POST /resume

An overlapped refit (``RefitRequest.overlap``: the workers receive into shadow weights on
their own threads) keeps serving while the weights move and pauses only for the swap::

    POST /init_weight_transfer_engine, /start_weight_update, /update_weights   (returns at once)
    ... the servers keep serving the old weights while the trainers send (``before_swap``) ...
    POST /pause?mode=keep                  running requests freeze where they are
    POST /finish_weight_update             the vote's outcome: swap the shadows in, or drop them
    POST /reset_prefix_cache, /resume

``refit_servers`` runs it with a deadline on every call and raises ``RefitFailed`` with one
line naming the server, the route and vLLM's error text when a call fails.

When an update fails (the refit did not commit, or its outcome is unknown) the weight update
session is still closed (``/finish_weight_update`` without a version: the server keeps
reporting the last committed one) and the server stays **paused**: the engine kept its old
weights whole if the refit aborted, but an unknown outcome or a torn streaming refit must
never be served, and the client cannot tell those apart from here. The controller then either
runs a new refit (a new join: ``init_info`` with a fresh nonce, then the update) and resumes
through this helper, or replaces the server. A failure before any update (pause, init,
start) changed no weights: the servers this call paused are resumed.
"""

from __future__ import annotations

import math
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import httpx

from ..errors import ConfigError, RefitFailed

__all__ = ["Timeouts", "ServerClient", "refit_servers", "wait_healthy", "prompt_logprobs"]


@dataclass(frozen=True)
class Timeouts:
    """Seconds each kind of call may take; every HTTP call has one (a hung server must not
    hang the controller).

    ``call_s``: quick routes; ``pause_s``: ``/pause?mode=wait`` drains in-flight requests;
    ``init_s``: ``/init_weight_transfer_engine`` waits for every rank of the refit group to
    join; ``update_s``: ``/update_weights`` lasts the whole refit (give it more than the
    ``RefitRequest.timeout_s`` so the engine's own error arrives first)."""

    call_s: float = 30.0
    pause_s: float = 300.0
    init_s: float = 300.0
    update_s: float = 900.0

    def __post_init__(self) -> None:
        for name in ("call_s", "pause_s", "init_s", "update_s"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and math.isfinite(v) and v > 0):
                raise ConfigError(f"Timeouts.{name}={v!r} must be a positive number of seconds")


#: vLLM's worker error for a finish without an open session (``gpu_worker.finish_weight_update``).
_NO_SESSION = "finish_weight_update called without a matching start_weight_update"


def _error_text(resp: httpx.Response) -> str:
    """vLLM's error message in one line (``{"error": {"message"}}``, ``{"error": str}`` or
    FastAPI's ``{"detail"}``), else the body."""
    try:
        body = resp.json()
    except ValueError:
        body = None
    msg: Any = None
    if isinstance(body, dict):
        err = body.get("error")
        msg = err.get("message") if isinstance(err, dict) else err
        msg = msg or body.get("detail") or body.get("message")
    text = str(msg if msg else resp.text).strip()
    return " ".join(text.split())[:1500] or resp.reason_phrase


class ServerClient:
    """One server's routes, each with a deadline; any failure is a ``RefitFailed`` line that
    starts with the server's URL."""

    def __init__(self, base_url: str, timeouts: Timeouts = Timeouts(), client: httpx.Client | None = None) -> None:
        if not isinstance(base_url, str) or not base_url.startswith(("http://", "https://")):
            raise ConfigError(f"base_url={base_url!r} must be an http:// or https:// URL")
        self.url = base_url.rstrip("/")
        self.timeouts = timeouts
        self._client = client or httpx.Client()

    def call(self, method: str, path: str, timeout_s: float, *, json: Any = None,
             params: Mapping[str, Any] | None = None) -> Any:
        """One request; its JSON reply (None when empty). Raises ``RefitFailed`` naming the
        server and route on a transport error, a timeout or a non-2xx status."""
        where = f"{self.url} {method} {path}"
        try:
            # One connection per call: after a route raises (a failed /update_weights), uvicorn
            # drops the kept-alive connection, and the next call on it would be reset. No call is
            # retried (an update is not idempotent), so none may land on a dead connection.
            resp = self._client.request(method, self.url + path, json=json, params=params, timeout=timeout_s,
                                        headers={"Connection": "close"})
        except httpx.TimeoutException:
            raise RefitFailed(f"{where}: no reply within {timeout_s:g}s") from None
        except httpx.HTTPError as exc:
            raise RefitFailed(f"{where}: {type(exc).__name__}: {' '.join(str(exc).split()) or 'transport error'}") \
                from None
        if resp.status_code >= 300:
            raise RefitFailed(f"{where}: HTTP {resp.status_code}: {_error_text(resp)}")
        if not resp.content:
            return None
        try:
            return resp.json()
        except ValueError:
            return resp.text

    # -- vLLM's routes (vllm/entrypoints/rl/online/api_router.py, serve/dev/cache) --------------
    def pause(self, mode: str = "wait") -> None:
        self.call("POST", "/pause", self.timeouts.pause_s, params={"mode": mode})

    def resume(self) -> None:
        self.call("POST", "/resume", self.timeouts.call_s)

    def is_paused(self) -> bool:
        return bool(self.call("GET", "/is_paused", self.timeouts.call_s)["is_paused"])

    def init_weight_transfer(self, init_info: Mapping[str, Any]) -> None:
        self.call("POST", "/init_weight_transfer_engine", self.timeouts.init_s, json={"init_info": dict(init_info)})

    def start_weight_update(self) -> None:
        self.call("POST", "/start_weight_update", self.timeouts.call_s)

    def update_weights(self, update_info: Mapping[str, Any]) -> None:
        self.call("POST", "/update_weights", self.timeouts.update_s, json={"update_info": dict(update_info)})

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        """``weight_version`` None: close the session and keep the version last recorded."""
        body = {} if weight_version is None else {"weight_version": weight_version}
        self.call("POST", "/finish_weight_update", self.timeouts.call_s, json=body)

    def close_failed_session(self) -> None:
        """``/finish_weight_update`` without a version after a failed ``/update_weights``.

        vLLM closes the session itself on a worker whose ``update_weights`` raised, and the
        ``mcore_reshard`` engine raises on the engine's last worker only (an error from any
        other would poison the engine's next RPC), so with TP > 1 the other workers still hold
        an open session that the next ``/start_weight_update`` would refuse: this closes them.
        The last worker then answers "finish_weight_update called without a matching
        start_weight_update" (HTTP 500), which is expected here and ignored."""
        try:
            self.finish_weight_update(None)
        except RefitFailed as exc:
            if _NO_SESSION not in str(exc):
                raise

    def reset_prefix_cache(self, reset_running_requests: bool = False) -> None:
        """``reset_running_requests``: preempt running requests (their KV is recomputed)."""
        params = {"reset_running_requests": "true"} if reset_running_requests else None
        out = self.call("POST", "/reset_prefix_cache", self.timeouts.call_s, params=params)
        if isinstance(out, dict) and out.get("success") is False:
            raise RefitFailed(f"{self.url} POST /reset_prefix_cache: the server refused (blocks still held)")

    def weight_version(self) -> str:
        return str(self.call("GET", "/weight_info", self.timeouts.call_s)["weight_version"])


def _each(clients: Sequence[ServerClient], fn: Callable[[ServerClient], Any]) -> list[RefitFailed | None]:
    """``fn`` on every server at once (joins and refits are collective across servers: one
    server's call waits for the others'); the error of each, None where it succeeded."""

    def run(c: ServerClient) -> RefitFailed | None:
        try:
            fn(c)
            return None
        except RefitFailed as exc:
            return exc

    if len(clients) <= 1:
        return [run(c) for c in clients]
    with ThreadPoolExecutor(len(clients)) as pool:
        return list(pool.map(run, clients))


def _raise(errors: Sequence[RefitFailed | None], note: str) -> None:
    bad = [str(e) for e in errors if e is not None]
    if bad:
        raise RefitFailed("; ".join(bad) + note)


def _per_server(init_info: Mapping[str, Any] | Sequence[Mapping[str, Any]] | None,
                n: int) -> list[Mapping[str, Any]] | None:
    if init_info is None:
        return None
    if isinstance(init_info, Mapping):
        if n != 1:
            raise ConfigError(f"init_info: one body per server is needed for {n} servers (each engine's "
                              f"join.dst_offset differs), got one mapping")
        return [init_info]
    bodies = list(init_info)
    if len(bodies) != n or not all(isinstance(b, Mapping) for b in bodies):
        raise ConfigError(f"init_info: expected {n} mappings (one per server), got {len(bodies)} items")
    return bodies


def refit_servers(servers: Sequence[str], update_info: Mapping[str, Any], weight_version: str, *,
                  init_info: Mapping[str, Any] | Sequence[Mapping[str, Any]] | None = None,
                  timeouts: Timeouts = Timeouts(), resume: bool = True,
                  before_swap: Callable[[], Any] | None = None,
                  recompute_kv_cache_after_weight_updates: bool = False) -> list[str]:
    """Refit every server in ``servers`` (base URLs) once, while the trainers run their side.

    ``init_info``: the ``EngineInitInfo`` body (its ``to_wire``) for a new refit group (every server joins the
    same group), None to reuse the group of the last refit; with several servers, one body per
    server, in order (each engine's ``join.dst_offset`` differs). ``weight_version`` is what
    each server then reports at ``/weight_info``. ``resume`` False leaves the servers paused
    after a successful refit (e.g. to check them first). See the module docstring for what a
    failure leaves behind.

    An overlapped refit (``update_info["request"]["overlap"]``) pauses nothing until the swap:
    ``before_swap`` (e.g. waiting for the trainers' side) runs while the servers still serve the
    old weights; then each pauses (``keep``), swaps and resumes. Its prefix-cache reset preempts
    running requests with ``recompute_kv_cache_after_weight_updates``, else it may be refused
    while they hold blocks (a note; requests should then carry the version as ``cache_salt``).
    Returns such notes."""
    if not servers:
        raise ConfigError("servers=[]: name at least one server base URL")
    if not isinstance(weight_version, str) or not weight_version:
        raise ConfigError(f"weight_version={weight_version!r} must be a non-empty string")
    inits = _per_server(init_info, len(servers))
    request = update_info.get("request") if isinstance(update_info, Mapping) else None
    if isinstance(request, Mapping) and request.get("overlap"):
        return _refit_overlapped(servers, update_info, weight_version, inits, timeouts, resume, before_swap,
                                 recompute_kv_cache_after_weight_updates)
    if before_swap is not None:
        raise ConfigError("before_swap is for overlapped refits (update_info.request.overlap=true): a blocking "
                          "refit's /update_weights returns only when the weights moved")
    with httpx.Client() as http:
        clients = [ServerClient(s, timeouts, http) for s in servers]
        paused = _each(clients, lambda c: c.pause("wait"))
        started: list[RefitFailed | None] = [RefitFailed("not started")] * len(clients)
        try:
            _raise(paused, "")
            if inits is not None:
                _raise(_each(clients, lambda c: c.init_weight_transfer(inits[clients.index(c)])), "")
            started = _each(clients, lambda c: c.start_weight_update())
            _raise(started, "")
        except RefitFailed as exc:  # no weight changed yet: close sessions, serve the old weights again
            _each([c for c, e in zip(clients, started) if e is None], lambda c: c.finish_weight_update(None))
            _each([c for c, e in zip(clients, paused) if e is None], lambda c: c.resume())
            raise RefitFailed(f"{exc} (refit not started: no weights changed, servers resumed)") from None
        updated = _each(clients, lambda c: c.update_weights(update_info))
        _finish(clients, updated, weight_version)
        _raise(_each(clients, lambda c: c.reset_prefix_cache()), " (servers kept paused)")
        if resume:
            _raise(_each(clients, lambda c: c.resume()), "")
    return []


def _finish(clients: list[ServerClient], updated: list[RefitFailed | None], weight_version: str) -> None:
    """``/finish_weight_update`` on every (paused) server after the updates: the new version
    where every update succeeded; else every session closed (no new version where the update
    failed) and the servers kept paused, as when a swap fails (the engines that raised kept
    their weights or must not serve them)."""
    if any(updated):
        closed = _each(clients, lambda c: c.finish_weight_update(weight_version) if updated[clients.index(c)]
                       is None else c.close_failed_session())
        both = [RefitFailed(f"{u}; then {f}") if u and f else (u or f) for u, f in zip(updated, closed)]
        _raise(both, " (servers kept paused: retry the refit or replace them)")
    # A refit that did not commit fails here (its outcome is the vote's); the engine closes
    # every worker's session either way, so the next /start_weight_update is accepted.
    _raise(_each(clients, lambda c: c.finish_weight_update(weight_version)), " (servers kept paused)")


def _refit_overlapped(servers: Sequence[str], update_info: Mapping[str, Any], weight_version: str,
                      inits: list[Mapping[str, Any]] | None, timeouts: Timeouts, resume: bool,
                      before_swap: Callable[[], Any] | None, recompute: bool) -> list[str]:
    """:func:`refit_servers` (its arguments checked) for an overlapped refit: serving until the swap."""
    notes: list[str] = []
    with httpx.Client() as http:
        clients = [ServerClient(s, timeouts, http) for s in servers]
        started: list[RefitFailed | None] = [RefitFailed("not started")] * len(clients)
        try:
            if inits is not None:
                _raise(_each(clients, lambda c: c.init_weight_transfer(inits[clients.index(c)])), "")
            started = _each(clients, lambda c: c.start_weight_update())
            _raise(started, "")
        except RefitFailed as exc:  # nothing received: close what opened; the servers never paused
            _each([c for c, e in zip(clients, started) if e is None], lambda c: c.finish_weight_update(None))
            raise RefitFailed(f"{exc} (refit not started: no weights changed, servers still serving)") from None
        updated = _each(clients, lambda c: c.update_weights(update_info))  # returns once receiving started
        waited: Exception | None = None
        if before_swap is not None and not any(updated):
            try:
                before_swap()
            except Exception as exc:  # noqa: BLE001 - reported with the swap's outcome below
                waited = exc
        # The vote decided (or the deadline passes in finish): freeze, swap or drop, resume.
        paused = _each(clients, lambda c: c.pause("keep"))
        _raise(paused, " (the servers still serve the old weights; their refit sessions are open)")
        _finish(clients, updated, weight_version)
        if waited is not None:
            raise RefitFailed(f"before_swap failed after the servers committed {weight_version!r}: "
                              f"{type(waited).__name__}: {waited} (servers kept paused)")
        for c, e in zip(clients, _each(clients, lambda c: c.reset_prefix_cache(recompute))):
            if e is not None:
                if recompute:
                    raise RefitFailed(f"{e} (servers kept paused)")
                notes.append(f"{c.url}: prefix cache not reset (requests running across the swap hold KV blocks)")
        if resume:
            _raise(_each(clients, lambda c: c.resume()), "")
    return notes


def wait_healthy(base_url: str, timeout_s: float, poll_s: float = 1.0,
                 alive: Callable[[], bool] | None = None) -> None:
    """Wait until ``GET /health`` answers 200 (a server loads its model first). ``alive``: a
    check that the server process still runs, so a crash fails at once instead of at the
    deadline. Raises ``RefitFailed`` naming the server."""
    deadline = time.monotonic() + timeout_s
    last = "no reply"
    with httpx.Client() as http:
        while time.monotonic() < deadline:
            if alive is not None and not alive():
                raise RefitFailed(f"{base_url}: the server process exited before /health answered")
            try:
                r = http.get(base_url.rstrip("/") + "/health", timeout=min(poll_s * 5, 10.0))
                if r.status_code == 200:
                    return
                last = f"HTTP {r.status_code}"
            except httpx.HTTPError as exc:
                last = type(exc).__name__
            time.sleep(poll_s)
    raise RefitFailed(f"{base_url}: /health not ready within {timeout_s:g}s ({last})")


def prompt_logprobs(base_url: str, model: str, token_ids: Sequence[int], timeout_s: float = 60.0) -> list[float]:
    """Log-probability of each given token after its prefix, served by ``/v1/completions`` on a
    token-id prompt (``prompt_logprobs``; ``echo`` + ``logprobs`` needs a tokenizer)."""
    with httpx.Client() as http:
        client = ServerClient(base_url, Timeouts(call_s=timeout_s), http)
        out = client.call("POST", "/v1/completions", timeout_s,
                          json={"model": model, "prompt": list(token_ids), "max_tokens": 1, "temperature": 0.0,
                                "prompt_logprobs": 0})
    rows = out["choices"][0]["prompt_logprobs"]
    return [float(row[str(tok)]["logprob"]) for tok, row in zip(token_ids[1:], rows[1:])]
