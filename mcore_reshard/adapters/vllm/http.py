"""A vLLM OpenAI-compatible server as a refit destination: its RL routes over HTTP, JSON only.

vLLM's server (started with ``VLLM_SERVER_DEV_MODE=1`` and ``--weight-transfer-config
'{"backend": "mcore_reshard"}'``; ``python -m mcore_reshard.jobs.serve``) exposes vLLM's
weight-transfer API as routes (``vllm/entrypoints/rl/online/api_router.py``). ``ServerClient``
calls one route with a deadline; ``VllmServer`` is the server as a
``transport.destination.Destination``: the refit's orchestration (``transport.sequence``) runs
on it as on an engine in this process. Its workers cannot be asked what they hold over HTTP:
a refit is confirmed by its own outcome, and a server whose refit failed stays paused.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import httpx

from ...errors import ConfigError, RefitFailed
from ...layout import ModelSpec
from ...transport.destination import Described, DestinationInfo
from ...wire.protocol import WorkerStatus

__all__ = ["Timeouts", "ServerClient", "VllmServer", "wait_healthy", "prompt_logprobs", "ServedTokens",
           "generate_tokens"]


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

    def reset_prefix_cache(self, reset_running_requests: bool = False) -> None:
        """``reset_running_requests``: preempt running requests (their KV is recomputed)."""
        params = {"reset_running_requests": "true"} if reset_running_requests else None
        out = self.call("POST", "/reset_prefix_cache", self.timeouts.call_s, params=params)
        if isinstance(out, dict) and out.get("success") is False:
            raise RefitFailed(f"{self.url} POST /reset_prefix_cache: the server refused (blocks still held)")

    def reset_encoder_cache(self) -> None:
        """Drop every cached multimodal encoder output (the scheduler's and the workers')."""
        self.call("POST", "/reset_encoder_cache", self.timeouts.call_s)

    def weight_version(self) -> str:
        return str(self.call("GET", "/weight_info", self.timeouts.call_s)["weight_version"])

    def update_weight_version(self, version: str) -> None:
        self.call("POST", "/update_weight_version", self.timeouts.call_s, json={"weight_version": version})


class VllmServer:
    """One server as a refit destination (see the module docstring). ``pause_mode``: how a
    blocking refit pauses it ("wait": in-flight requests finish first; an overlapped refit's
    swap always freezes them, "keep")."""

    def __init__(self, client: ServerClient, pause_mode: str = "wait") -> None:
        self.client, self.pause_mode = client, pause_mode
        #: Error lines of this server start with its URL (``EngineCallers`` adds no prefix).
        self.label = client.url

    def info(self) -> DestinationInfo:
        world = int(self.client.call("GET", "/get_world_size", self.client.timeouts.call_s)["world_size"])
        return DestinationInfo(world, "", can_pause=True, name=self.client.url)

    def describe(self, spec: ModelSpec) -> Described:
        raise RefitFailed(f"{self.client.url}: a server's workers cannot be asked what they hold over HTTP: plan "
                          f"against its layout by the rules (adapters.vllm.rules.vllm_layout)")

    def join(self, init: Any) -> None:
        self.client.init_weight_transfer(init.to_wire() if hasattr(init, "to_wire") else init)

    def pause(self, swap: bool) -> None:
        self.client.pause("keep" if swap else self.pause_mode)

    def begin(self) -> None:
        self.client.start_weight_update()

    def transfer(self, update: Any) -> None:
        self.client.update_weights(update.to_wire() if hasattr(update, "to_wire") else update)

    def conclude(self, version: str | None) -> None:
        """``/finish_weight_update`` (with ``version``: what ``/weight_info`` reports once it
        committed; without: the last committed one is kept). A refit that did not commit
        answers HTTP 500 naming every refusing rank; every worker's session is closed either way."""
        self.client.finish_weight_update(version)

    def status(self) -> list[WorkerStatus] | None:
        return None

    def refresh(self, version: str, recompute: bool = False, encoders: bool = False) -> str:
        """Drop the KV cached under the old weights (``recompute``: preempting running requests;
        without, vLLM may refuse while requests hold blocks: a note -- clients should then send
        the version as their ``cache_salt``). ``encoders``: the vision tower or projector
        changed: running requests are preempted and the encoder cache dropped
        (``/reset_encoder_cache``, scheduler and workers). The label was set by
        ``/finish_weight_update``."""
        if encoders:
            self.client.reset_prefix_cache(True)
            self.client.reset_encoder_cache()
            return ""
        try:
            self.client.reset_prefix_cache(recompute)
        except RefitFailed as exc:
            if recompute or "refused" not in str(exc):
                raise
            return f"{self.client.url}: prefix cache not reset (requests running across the swap hold KV blocks)"
        return ""

    def resume(self) -> None:
        self.client.resume()

    def close(self) -> None:
        self.client.call("POST", "/shutdown_weight_transfer_engine", self.client.timeouts.call_s)


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


@dataclass(frozen=True)
class ServedTokens:
    """A server's completion with the weights that sampled it: ``weight_versions`` are
    ``(version, start, end)`` spans over the output tokens (vLLM's ``WeightVersionSpan``): one
    span, or -- a refit that swapped weights while the request ran -- the old version, then
    the new one from the token where they changed. ``logprobs``: each token's log-prob as the
    engine sampled it."""

    token_ids: tuple[int, ...]
    weight_versions: tuple[tuple[str, int, int], ...]
    logprobs: tuple[float, ...] = ()


def generate_tokens(base_url: str, token_ids: Sequence[int], max_tokens: int, *, timeout_s: float = 120.0,
                    on_tokens: Callable[[int], Any] | None = None) -> ServedTokens:
    """A greedy completion of a token-id prompt (``max_tokens`` tokens, EOS ignored, with each
    token's log-prob) through
    vLLM's token-in/token-out route ``/inference/v1/generate``, streamed; ``on_tokens(n)`` is
    called as each chunk brings the count to ``n``. The OpenAI routes' responses do not say
    which weights produced them; this route's final chunk does (the server needs
    ``--enable-scale-out``, which ``jobs.serve`` adds). Raises ``RefitFailed`` naming the
    server on an HTTP error or a missed deadline."""
    url = base_url.rstrip("/") + "/inference/v1/generate"
    body = {"token_ids": list(token_ids), "stream": True,
            "sampling_params": {"temperature": 0.0, "max_tokens": int(max_tokens), "ignore_eos": True, "logprobs": 0}}
    tokens: list[int] = []
    logprobs: list[float] = []
    spans: tuple[tuple[str, int, int], ...] = ()
    try:
        with httpx.Client() as http, http.stream("POST", url, json=body, timeout=timeout_s) as r:
            if r.status_code != 200:
                r.read()
                raise RefitFailed(f"{base_url}: POST /inference/v1/generate: {_error_text(r)}")
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                for choice in json.loads(line[len("data: "):]).get("choices", ()):
                    tokens.extend(int(t) for t in choice.get("token_ids") or ())
                    logprobs.extend(float(c["logprob"]) for c in (choice.get("logprobs") or {}).get("content") or ())
                    if choice.get("weight_versions"):
                        spans = tuple((str(s["version"]), int(s["start"]), int(s["end"]))
                                      for s in choice["weight_versions"])
                if on_tokens is not None:
                    on_tokens(len(tokens))
    except httpx.TimeoutException:
        raise RefitFailed(f"{base_url}: POST /inference/v1/generate: no reply within {timeout_s:g}s") from None
    except httpx.HTTPError as exc:
        raise RefitFailed(f"{base_url}: POST /inference/v1/generate: {type(exc).__name__}: {exc}") from None
    return ServedTokens(tuple(tokens), spans, tuple(logprobs))
