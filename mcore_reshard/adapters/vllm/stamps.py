"""The two steps of a recording pass that vLLM has no public API for, copied from vLLM 0.32.

``record.record_local_params`` drives a model's ``load_weights`` on meta tensors (vLLM's
layerwise reload) and needs, around it, (1) every loadable tensor's *original* weight loader
wrapped so that each ``copy_`` can be attributed to its layer and parameter, and (2) the
model put back as it was afterwards, without a real ``finalize_layerwise_reload`` (which would
load). vLLM does both inside ``ShardedRDTWeightTransferEngine`` as private methods
(``_install_recording_stamps``, ``_restore_after_dry_run``, over the private helpers
``_get_original_loader`` and ``_place_kernel_tensors``), and says there that a public
"currently loading" hook and an ``abort_layerwise_reload`` should replace them.

Until then this module keeps a minimal copy of those four (Apache-2.0, vLLM 0.32.0,
``distributed/weight_transfer/sharded_rdt_engine.py`` and
``model_executor/model_loader/reload/layerwise.py``), as plain functions of our own -- never a
call into a private vLLM method. ``tests/test_vllm_rules.py`` pins a digest of vLLM's own
sources of the four: when a vLLM upgrade changes any of them, that test fails and names which,
so this copy is re-read against it before it can drift silently. Every live refit test records
through these functions.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import torch

__all__ = ["install_recording_stamps", "restore_after_recording", "VLLM_SOURCES"]

#: The vLLM functions this module copies (module, qualified name), for the drift test.
VLLM_SOURCES: tuple[tuple[str, str], ...] = (
    ("vllm.distributed.weight_transfer.sharded_rdt_engine", "ShardedRDTWeightTransferEngine._install_recording_stamps"),
    ("vllm.distributed.weight_transfer.sharded_rdt_engine", "ShardedRDTWeightTransferEngine._restore_after_dry_run"),
    ("vllm.model_executor.model_loader.reload.layerwise", "_get_original_loader"),
    ("vllm.model_executor.model_loader.reload.layerwise", "_place_kernel_tensors"),
)


def _original_loader(tensor: torch.Tensor) -> Callable:
    """The tensor's weight loader with layerwise reload's ``online_process_loader`` wrappers
    removed (vLLM's ``_get_original_loader``)."""
    from vllm.model_executor.model_loader.weight_utils import default_weight_loader

    loader = getattr(tensor, "weight_loader", default_weight_loader)
    while loader.__name__ == "online_process_loader":
        loader = loader.__wrapped__
    return loader


def install_recording_stamps(model: torch.nn.Module, recorder: Any) -> None:
    """Wrap each loadable tensor's original loader to set ``recorder.current = (layer, name)``
    around the call, so the fake source's ``copy_`` knows which parameter it writes (vLLM's
    ``_install_recording_stamps``). A tensor without a loader gets the default loader that
    ``load_weights`` would fall back to, stamped; ``restore_after_recording`` removes it."""
    from vllm.model_executor.model_loader.reload.utils import get_layer_tensors
    from vllm.model_executor.model_loader.weight_utils import default_weight_loader

    def stamp_of(layer: torch.nn.Module, name: str, inner: Callable, added: bool = False) -> Callable:
        @functools.wraps(inner)  # keeps ``inner``'s signature (layerwise reload redirects ``param``)
        def stamp(*args: Any, **kwargs: Any) -> Any:
            recorder.current = (layer, name)
            try:
                return inner(*args, **kwargs)
            finally:
                recorder.current = None

        stamp._rdt_stamp_inner = inner  # type: ignore[attr-defined]
        stamp._rdt_stamp_added = added  # type: ignore[attr-defined]
        return stamp

    for module in model.modules():
        for name, tensor in get_layer_tensors(module).items():
            if getattr(tensor, "weight_loader", None) is None:
                tensor.weight_loader = stamp_of(module, name, default_weight_loader, added=True)
                continue
            tensor.weight_loader = stamp_of(module, name, _original_loader(tensor))


def restore_after_recording(model: torch.nn.Module) -> None:
    """Put every layer that layerwise reload moved to meta back on its kernel tensors, without
    loading anything, reset its reload state, and unwrap every stamp (vLLM's
    ``_restore_after_dry_run`` with ``_place_kernel_tensors``)."""
    from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO
    from vllm.model_executor.model_loader.reload.utils import get_layer_tensors

    for layer in model.modules():
        info = LAYERWISE_INFO.get(layer)
        if info is not None and info.can_load():
            if info.kernel_tensors is not None:
                for name in get_layer_tensors(layer):
                    delattr(layer, name)
                parameters, buffers = info.kernel_tensors
                for name, param in parameters.items():
                    layer.register_parameter(name, param)
                for name, buffer in buffers.items():
                    layer.register_buffer(name, buffer, persistent=name not in info.kernel_non_persistent_buffers)
            info.reset()
    for module in model.modules():
        for _, tensor in get_layer_tensors(module).items():
            loader = getattr(tensor, "weight_loader", None)
            added = False
            while loader is not None and hasattr(loader, "_rdt_stamp_inner"):
                added = added or getattr(loader, "_rdt_stamp_added", False)
                loader = loader._rdt_stamp_inner
                tensor.weight_loader = loader
            if added:
                del tensor.weight_loader
    if hasattr(model, "_original_do_torchao_reload"):
        model._do_torchao_reload = model._original_do_torchao_reload
