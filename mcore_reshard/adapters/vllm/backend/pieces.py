"""What a refit writes on one vLLM worker, and the module tree that holds it.

The engine end's descriptors (``engine.ReshardWeightTransferEngine.params``), in three parts
that arrive at different times: the target's pieces (recorded once, with vLLM's own loaders,
at the first refit), the speculative-decoding draft's (once vLLM's draft session names the
draft: ``set_weight_update_target``) and a LoRA policy's refit adapter slots (installed by an
init info that carries a ``PeftConfig``). Kept apart from the engine's lifecycle so each part
is recorded exactly once and the engine only asks for the current list.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch

from ....layout import Piece
from ....layout.descriptor import LocalParam
from ....layout.lora import PeftConfig
from ....layout.mtp import draft_tensors
from ..fp8 import engine_holds
from ..layers import TargetAndDraft
from ..lora_slots import install_refit_adapter
from ..parallel import VllmParallel
from ..record import canonical_tensors, record_local_params, served_spec

__all__ = ["EnginePieces", "DRAFT_PREFIX"]

#: Local names of the draft's own pieces: ``draft.<the draft's name>`` (``layers.TargetAndDraft``).
DRAFT_PREFIX = "draft."


class EnginePieces:
    """One worker's destination pieces (see the module docstring) and ``served``, the tree a
    refit writes: the target, and the target-and-draft tree once the draft is known."""

    def __init__(self, target: torch.nn.Module, vllm_config: Any, device: torch.device, local_rank: int) -> None:
        self.target, self.vllm_config, self.device, self.local_rank = target, vllm_config, device, local_rank
        self.served: torch.nn.Module = target
        self.draft: torch.nn.Module | None = None
        #: A LoRA policy's refit adapter (``lora_slots``): its slot tensors on this worker.
        self.adapter_params: list[LocalParam] = []
        self._target_params: list[LocalParam] | None = None
        self._draft_params: list[LocalParam] | None = None

    def params(self) -> list[LocalParam]:
        """The target's pieces, the draft's once known, and the adapter's slots once installed
        (each recorded once)."""
        if self._target_params is None:
            tensors = canonical_tensors(self.vllm_config)
            recorded = record_local_params(
                self.target, tensors, self.local_rank, vllm_config=self.vllm_config,
                device=self.device, checkpoint=served_spec(self.vllm_config).checkpoint_shapes())
            self._target_params = engine_holds(self.target, recorded, tensors, self.vllm_config)
        if self.draft is not None and self._draft_params is None:
            self._draft_params = self._record_draft(self.draft)
        return self._target_params + (self._draft_params or []) + self.adapter_params

    def name_draft(self, model: torch.nn.Module) -> None:
        """vLLM's draft session named ``model`` (the target itself, or the draft already known,
        changes nothing): from now on every refit writes the target and the draft as one tree."""
        if model is not self.target and model is not self.draft:
            self.draft, self._draft_params = model, None
            self.served = TargetAndDraft(self.target, model)

    def install_adapter(self, peft: PeftConfig) -> None:
        """A LoRA policy's refit adapter in this worker's LoRA slots (``lora_slots``; once)."""
        par = self.vllm_config.parallel_config
        self.adapter_params = install_refit_adapter(
            self.target, peft, served_spec(self.vllm_config),
            VllmParallel(tp=int(par.tensor_parallel_size), pp=int(par.pipeline_parallel_size)), self.local_rank)

    def _record_draft(self, draft: torch.nn.Module) -> list[LocalParam]:
        """The draft's pieces, recorded with its own loader from the MTP layers' canonical
        tensors (``layout.mtp``), named ``draft.<name>``. Tensors it shares with the target
        (embedding, head) are the target's pieces: not recorded twice."""
        shared = {id(t) for t in self.target.parameters()}  # the same Parameter objects
        own = {n for n, t in draft.named_parameters() if id(t) not in shared}
        recorded = record_local_params(draft, draft_tensors(served_spec(self.vllm_config)), self.local_rank,
                                       vllm_config=self.vllm_config, device=self.device)
        return [replace(p, name=DRAFT_PREFIX + p.name,
                        pieces=tuple(Piece(q.rank, DRAFT_PREFIX + q.local_name, q.canonical, q.box, q.view)
                                     for q in p.pieces))
                for p in recorded if p.name in own]
