"""An ``LLM``'s queued client path as tests and soaks call it: ``enqueue`` then
``wait_for_completion``, no helper of the project's in between, the wait on a thread of its
own -- so a caller can see a request wait (an engine gated after a failed refit runs no model
step) and, once a refit heals the engine, what it finally ran on.

Test scaffolding (``mcore_reshard.testing``): production code never imports it."""

from __future__ import annotations

import threading
from typing import Any, Sequence

__all__ = ["Enqueued", "enqueued_logprobs"]


class Enqueued:
    """One prompt (``tokens``, greedy, one new token, its prompt logprobs) sent through
    ``llm.enqueue``; ``wait_for_completion`` runs on a daemon thread from here on."""

    def __init__(self, llm: Any, tokens: Sequence[int]) -> None:
        from vllm import SamplingParams

        self.tokens = [int(t) for t in tokens]
        llm.enqueue([{"prompt_token_ids": self.tokens}],
                    SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0), use_tqdm=False)
        self._got: dict[str, Any] = {}
        self.thread = threading.Thread(target=self._wait, args=(llm,), daemon=True)
        self.thread.start()

    def _wait(self, llm: Any) -> None:
        try:
            self._got["out"] = llm.wait_for_completion(use_tqdm=False)
        except BaseException as exc:  # noqa: BLE001 - raised by logprobs()
            self._got["error"] = exc

    def waiting(self, seconds: float) -> bool:
        """Whether the request is still waiting ``seconds`` from now (no reply yet)."""
        self.thread.join(seconds)
        return self.thread.is_alive()

    def logprobs(self, timeout_s: float = 600.0) -> list[float]:
        """The prompt's logprobs once the request ran (waiting up to ``timeout_s``); raises
        what ``wait_for_completion`` raised, or ``TimeoutError``."""
        if self.waiting(timeout_s):
            raise TimeoutError(f"the enqueued request did not complete within {timeout_s:g}s")
        if "error" in self._got:
            raise self._got["error"]
        out = self._got["out"][0]
        return [float(lp[t].logprob) for t, lp in zip(self.tokens[1:], out.prompt_logprobs[1:])]


def enqueued_logprobs(llm: Any, tokens: Sequence[int]) -> list[float]:
    """``enqueue`` + ``wait_for_completion``: the prompt's logprobs."""
    return Enqueued(llm, tokens).logprobs()
