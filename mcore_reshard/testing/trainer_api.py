"""Trainer ranks that reach a vLLM ``LLM`` in the driving process through vLLM's trainer API
only: each rank's ``ForwardingClient`` is vLLM's ``VLLMWeightSyncClient``, whose calls the
driving process runs on its ``LLM`` (``drive_trainer_api``). For tests and benchmarks, where
the engine lives in the test's own process."""

from __future__ import annotations

from typing import Any

__all__ = ["ForwardingClient", "drive_trainer_api"]


class ForwardingClient:
    """vLLM's ``VLLMWeightSyncClient`` calls, each run by the test process on its ``LLM``
    (``serve_engine_calls``): vLLM's own offline API, one call at a time."""

    def __init__(self, calls: Any, replies: Any) -> None:
        self.calls, self.replies = calls, replies

    def _call(self, name: str, *args: Any, **kw: Any) -> Any:
        self.calls.put((name, args, kw))
        error, value = self.replies.get(timeout=600)
        if error:
            raise RuntimeError(error)
        return value

    def init_weight_transfer_engine(self, init_info: dict) -> None:
        self._call("init_weight_transfer_engine", {"init_info": init_info})

    def start_weight_update(self) -> None:
        self._call("start_weight_update")

    def start_draft_weight_update(self) -> None:
        self._call("start_draft_weight_update")

    def update_weights(self, update_info: dict) -> None:
        self._call("update_weights", {"update_info": update_info})

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self._call("finish_weight_update", weight_version=weight_version)

    def shutdown_weight_transfer_engine(self) -> None:
        self._call("shutdown_weight_transfer_engine")

    def probe(self, step: int) -> None:
        """Not a vLLM call: the test process reads what the engine serves now."""
        self._call("probe", step)


def drive_trainer_api(llm: Any, trainers: Any, probe: Any) -> tuple[list, list]:
    """Trainer ranks that reach ``llm`` through vLLM's trainer API only: ``trainers((calls,
    replies))`` runs them (returns their results), their ``ForwardingClient`` (``_trainer_api_jobs``)
    sends each of vLLM's calls on ``calls``, and this thread runs it on ``llm``; ``probe(step)``
    reads what ``llm`` serves after each refit. (ranks' results, probes)."""
    import threading

    import torch.multiprocessing as mp

    manager = mp.get_context("spawn").Manager()  # its queues reach ranks that are already running
    try:
        calls, replies, out, probes = manager.Queue(), manager.Queue(), {}, []

        def run() -> None:
            try:
                out["ranks"] = trainers((calls, replies))
            except BaseException as exc:  # noqa: BLE001 - re-raised in the test thread
                out["error"] = exc
            calls.put(None)

        t = threading.Thread(target=run, daemon=True)
        t.start()
        while (call := calls.get(timeout=600)) is not None:
            name, a, kw = call
            try:
                probes.append(probe(*a)) if name == "probe" else getattr(llm, name)(*a, **kw)
                replies.put(("", None))
            except Exception as exc:  # noqa: BLE001 - raised on the trainer's side
                replies.put((f"{type(exc).__name__}: {exc}".splitlines()[0], None))
        t.join(timeout=60)
        if "error" in out:
            raise out["error"]
        return out["ranks"], probes
    finally:
        manager.shutdown()
