"""The training end of a refit, created inside a framework's own Megatron-Core rank.

Nothing here assumes this project started the process: a framework builds the endpoint from
the model chunks it already holds (wrapped in ``Float16Module`` / DDP or not) after megatron's
``parallel_state`` is initialised, and calls it from its own control loop::

    ep = TrainerEndpoint(model_chunks, spec, sync_params=policy.sync_params)
    params = ep.describe()                         # -> the driver plans with every rank's list
    ep.join(JoinInfo(...))                         # once per refit group
    ep.set_plan(slice_wire, plan_digest)           # once per layout
    report = ep.refit(RefitRequest(plan_digest))   # every step; raises RefitFailed if any rank failed
    ep.leave()

``refit`` moves this rank's boxes, then votes with every other rank of the refit group (all
trainers and every engine's workers): all commit or none does, and the votes carry every
rank's ``RankReport`` (``last_reports``), which is how the inference side reports back.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

from ...layout import LayoutError, LocalParam, ModelSpec
from ...transport.participant import TopLogprobs
from ...transport.source import SourceEndpoint
from .live import _unwrap, describe, named_local_params
from .lora import policy_peft

__all__ = ["TrainerEndpoint", "sync_params_before_refit"]


def sync_params_before_refit(chunks: Sequence[Any]) -> None:
    """With the distributed optimizer and an overlapped param all-gather, bf16 params are only
    whole after the gather: force it before reading them (no-op for unwrapped models)."""
    for chunk in chunks:
        sync = getattr(chunk, "start_param_sync", None)
        if callable(sync):
            sync(force_sync=True)


class TrainerEndpoint(SourceEndpoint):
    """One Megatron-Core training rank's end of the refit protocol (see the module docstring):
    its pieces from the rules, checked against the live chunks; its tensors the chunks' own."""

    def __init__(self, model_chunks: Sequence[Any], spec: ModelSpec, *, rank: int | None = None,
                 sync_params: Callable[[], None] | None = None, device: str = "cpu",
                 canary: TopLogprobs | None = None, canary_draft: TopLogprobs | None = None) -> None:
        super().__init__(spec, rank=rank, device=device, canary=canary, canary_draft=canary_draft)
        self.chunks = list(model_chunks)
        self._sync = sync_params or (lambda: sync_params_before_refit(self.chunks))
        self._params: list[LocalParam] | None = None

    def describe(self) -> list[LocalParam]:
        """This rank's pieces, predicted by the rules and checked name by name against the
        live model (``live.describe``); cached."""
        if self._params is None:
            self._params = describe(self.chunks, self.spec)
        return self._params

    def sync(self) -> None:
        self._sync()

    def check_plan(self, rank_plan: Any) -> None:
        """A LoRA policy checks the scaling the plan sends its B with against its own
        ``alpha / r`` (the engine folds the plan's into its slots)."""
        peft = policy_peft(_unwrap(self.chunks[0]))
        scale = rank_plan.get("lora")
        for name, factor in (scale.locals if scale is not None else ()):
            if peft is None or abs(factor - peft.scaling) > 1e-12 * peft.scaling:
                mine = "no adapters" if peft is None else f"peft.alpha={peft.alpha:g}, peft.dim={peft.dim}"
                raise LayoutError(f"training rank {self.rank}: the plan scales {name} by {factor:g} (the engine's "
                                  f"alpha / r); this policy has {mine}")

    def local_tensors(self) -> dict[str, Any]:
        """The live local parameters by descriptor name (read, never copied) -- but for a
        parameter the family's table carries wider than megatron holds it (``widened``:
        GLM-4.5's router weight, fp32 as vLLM holds it): a widened copy, made per refit."""
        import torch

        wide = {lp.name: lp.dtype for lp in self.describe()}
        out = {}
        for name, p in named_local_params(self.chunks).items():
            want = wide.get(name)
            held = str(p.dtype).removeprefix("torch.")
            out[name] = p.data if want is None or held == want else p.data.to(getattr(torch, want))
        return out
