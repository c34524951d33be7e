"""A controller for running vLLM servers as refit destinations: JSON over HTTP only.

vLLM's OpenAI-compatible server (started with ``VLLM_SERVER_DEV_MODE=1`` and
``--weight-transfer-config '{"backend": "mcore_reshard"}'``; ``python -m mcore_reshard.jobs.serve``)
exposes vLLM's weight-transfer API as routes; each server is an ``adapters.vllm.http.VllmServer``
destination and a refit runs the same sequence as every other entry point's
(``transport.sequence.EngineRefit``). One refit of one or many servers is::

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

When an update fails (the refit did not commit, or its outcome is unknown) every session is
still closed (the failed one without a version: the server keeps reporting the last
committed one) and the server stays **paused**: the engine kept its old weights whole if the
refit aborted, but an unknown outcome or a torn streaming refit must never be served, and
HTTP cannot tell those apart. The controller then either runs a new refit (a new join:
``init_info`` with a fresh nonce, then the update) and resumes through this helper, or
replaces the server. A failure before any update (pause, init, start) changed no weights: the
servers this call paused are resumed. ``docs/http-server.md`` gives the retry call by call.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Sequence

import httpx

from ..adapters.vllm.http import (ServedTokens, ServerClient, Timeouts, VllmServer, generate_tokens, prompt_logprobs,
                                  wait_healthy)
from ..errors import ConfigError, RefitFailed
from ..transport.destination import EngineCallers
from ..transport.sequence import EngineRefit, EngineRun

__all__ = ["Timeouts", "ServerClient", "refit_servers", "wait_healthy", "prompt_logprobs", "generate_tokens",
           "ServedTokens"]


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
    overlap = bool(isinstance(request, Mapping) and request.get("overlap"))
    if before_swap is not None and not overlap:
        raise ConfigError("before_swap is for overlapped refits (update_info.request.overlap=true): a blocking "
                          "refit's /update_weights returns only when the weights moved")
    with httpx.Client() as http:
        calls = EngineCallers([VllmServer(ServerClient(s, timeouts, http)) for s in servers])
        run = EngineRun(dict(update_info), weight_version, overlap=overlap, grace_s=timeouts.update_s,
                        recompute=recompute_kv_cache_after_weight_updates, kind="servers",
                        encoders=bool(isinstance(request, Mapping) and request.get("encoders")))
        refit = EngineRefit(calls, run)
        errors = refit.start(inits)
        waited: Exception | None = None
        if before_swap is not None and not errors:
            try:
                before_swap()
            except Exception as exc:  # noqa: BLE001 - reported with the swap's outcome below
                waited = exc
        errors += refit.finish(trusted=not errors, serve=resume and waited is None)
        if errors:
            raise RefitFailed("; ".join(errors) + " (servers kept paused)")
        if waited is not None:
            raise RefitFailed(f"before_swap failed after the servers committed {weight_version!r}: "
                              f"{type(waited).__name__}: {waited} (servers kept paused)")
    return refit.notes
