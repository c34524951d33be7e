"""The engine's refit adapter: one LoRA slot of a live vLLM engine that refits write.

vLLM serves an adapter from slots its ``LoRAModelManager`` fills, at activation, from a
``LoRAModel`` loaded whole from a PEFT directory, and after every weight update it drops every
adapter (``reset_lora_state``). A refit instead writes each worker's share of the adapter
straight into the slot. So the engine registers an adapter of its own once, at the
``init_weight_transfer_engine`` that first carries ``EngineInitInfo.lora``:

- a zero ``LoRAModel`` (B = 0: the policy as Megatron-Bridge initialises it, the base model's
  outputs), pinned (``pin_adapter``) into slot ``peft.slot``: the LRU never evicts it, so vLLM
  never refills the slot from that zero copy;
- kept across vLLM's reset: that manager's ``remove_all_adapters`` removes every adapter but
  this one (the base weights a refit replaces do not invalidate an adapter a refit writes);
- its slots zeroed.

Requests name it with :func:`refit_lora_request`; its slots are local tensors of the worker
(``lora_rules.slot_name``), written by the applier like any direct parameter (staged, and
copied in at the commit, so a refit's adapter is all old or all new on every worker).
"""

from __future__ import annotations

from typing import Any

import torch

from ...errors import RefitError
from ...layout import LocalParam, ModelSpec
from ...layout.lora import PeftConfig
from ...transport.views import TORCH_DTYPES
from .layers import owner
from .lora_rules import vllm_lora_rank_params
from .parallel import VllmParallel

__all__ = ["install_refit_adapter", "refit_lora_request", "REFIT_ADAPTER_PATH"]

#: The ``lora_path`` of the refit adapter's requests: never read (the adapter is registered
#: and pinned before any request names it), so it names what serves it.
REFIT_ADAPTER_PATH = "mcore-reshard://refit-adapter"


def refit_lora_request(peft: PeftConfig, name: str = "policy") -> Any:
    """The ``LoRARequest`` that serves the engine's refit adapter."""
    from vllm.lora.request import LoRARequest

    return LoRARequest(name, peft.lora_int_id, REFIT_ADAPTER_PATH)


def install_refit_adapter(model: torch.nn.Module, peft: PeftConfig, spec: ModelSpec, par: VllmParallel,
                          rank: int) -> list[LocalParam]:
    """Register, pin and zero the refit adapter (once; later calls check it is the same) and
    return this worker's slot tensors, each checked against the live slot. Raises
    ``RefitError`` in one line naming the setting that does not fit."""
    mgr = getattr(model, "lora_manager", None)
    if mgr is None:
        raise RefitError("init_info.lora: this engine was started without enable_lora=True; a LoRA policy's "
                         "refits need the engine's LoRA slots")
    cfg = mgr.lora_config
    for key, want, have in (("max_lora_rank", peft.engine_rank, cfg.max_lora_rank),
                            ("max_loras", peft.max_loras, cfg.max_loras)):
        if want != have:
            raise RefitError(f"peft.{key}={want}: the engine was started with {key}={have}")
    held: PeftConfig | None = getattr(mgr, "_mcore_reshard_peft", None)
    lid = peft.lora_int_id
    if held is not None and _slots(held) != _slots(peft):
        diff = [(k, a, b) for k, a, b in zip(_SLOT_KEYS, _slots(held), _slots(peft)) if a != b]
        raise RefitError(f"peft: this engine's refit adapter was installed with other settings "
                         f"({', '.join(k for k, _, _ in diff)}: {[a for _, a, _ in diff]} != {[b for _, _, b in diff]})")
    if held is None:
        if lid in mgr.list_adapters():
            raise RefitError(f"peft.slot={peft.slot}: LoRA id {lid} is already an adapter loaded from a request")
        lora = mgr.create_dummy_lora(lid, peft.dim, getattr(model, "embedding_modules", None) or {})
        mgr.add_adapter(lora)
        mgr.pin_adapter(lid)
        index = mgr.lora_index_to_id.index(lid)
        if index != peft.slot:
            mgr.remove_adapter(lid)
            raise RefitError(f"peft.slot={peft.slot}: the engine's first free LoRA slot is {index} "
                             f"(slots in use: {mgr.lora_index_to_id})")
        for module in mgr.modules.values():
            module.reset_lora(index)
        _keep_across_resets(mgr, lid)
        mgr._mcore_reshard_peft = peft
    params = vllm_lora_rank_params(spec, par, peft, rank)
    for p in params:
        live = owner(model, p.name)[0].value
        if tuple(live.shape) != p.shape or live.dtype != TORCH_DTYPES[p.dtype]:
            raise RefitError(f"peft: the engine's LoRA slot {p.name} is {tuple(live.shape)} {live.dtype}, the layout "
                             f"says {p.shape} {p.dtype}")
    return params


#: What an installed refit adapter is: the settings its slots and their contents depend on.
_SLOT_KEYS = ("modules", "dim", "alpha", "lora_dtype", "max_lora_rank", "max_loras", "slot")


def _slots(peft: PeftConfig) -> tuple:
    return tuple(getattr(peft, k) for k in _SLOT_KEYS)


def _keep_across_resets(mgr: Any, lid: int) -> None:
    """vLLM's ``reset_lora_state`` (after every weight update) calls the manager's
    ``remove_all_adapters``: on this manager it removes every adapter but the refit one."""

    def remove_all_but_the_refit_adapter() -> None:
        for aid in list(mgr.list_adapters()):
            if aid != lid:
                mgr.remove_adapter(aid)
        mgr._last_mapping = None  # as vLLM's own ``remove_all_adapters``: the mapping is rebuilt
        mgr._last_slot_layout = None

    mgr.remove_all_adapters = remove_all_but_the_refit_adapter
