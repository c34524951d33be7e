"""What vLLM does to a layer after loading, and how a refit writes around it.

``select_modes`` says, per local parameter, whether the live tensor is the model-format tensor
that a refit may write in place (``direct``) or a kernel-format one that vLLM's
``process_weights_after_loading`` repacked (``reload``: written into a shadow of its layer,
processed there, then swapped in). The shadow helpers below are that swap's parts: a shallow
copy of a layer that vLLM's reload functions may rebind freely (``shadow_module``), the live
tensor taking the processed values (``swap_into``), and the CPU MoE prepack vLLM 0.32 forgets
on reload (``reprepack_cpu_moe``). ``ParamTable`` is how the applier's parts address the
parameters a refit writes. ``Shadows`` (``shadows.py``) drives the swap's parts for the refit's
participant, ``VllmApplier`` (``apply.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import torch

from ...layout.descriptor import LayoutError, LocalParam
from ...transport.views import TORCH_DTYPES
from .fp8 import holds_codes, open_codes, process_codes
from .lora_rules import is_slot_name, parse_slot_name

__all__ = ["derivations", "DIRECT", "RELOAD", "MLA_NOTE", "owner", "LoraSlot", "guarded", "TargetAndDraft", "plain_linear_enabled",
           "kernel_is_model_format", "mla_absorbers", "reabsorb", "select_modes", "aliased", "swap_into", "shadow_module", "viewed_storages",
           "reprepack_cpu_moe", "MISSING", "open_shadow", "process_shadow", "commit_shadow", "carried", "ParamTable",
           "tied_dependents", "process_dependent", "untie_head"]

#: Why MLA's kv_b_proj is never written in place (the plan report lists it with this reason).
MLA_NOTE = ("MLA kv_b_proj: vLLM absorbs it into W_UK/W_UV after loading (kernel format != model format); "
            "written through the layerwise reload, then the attention's W_UK/W_UV are rebuilt")

DIRECT = "direct"
RELOAD = "reload"


class LoraSlot:
    """One slot of a LoRA layer's stacked A or B (``lora_rules.slot_name``), addressed as the
    applier addresses a parameter: ``value`` is the live slot (a view into the stacked tensor,
    so it is always written in place, never rebound); ``layer`` is the module whose forward
    reads it (the forward gate's, ``gate.py``)."""

    __slots__ = ("layer", "value")

    def __init__(self, layer: torch.nn.Module, value: torch.Tensor) -> None:
        self.layer, self.value = layer, value


def owner(model: torch.nn.Module, local_name: str) -> tuple["torch.nn.Module | LoraSlot", str]:
    """The module (or LoRA slot) that holds ``local_name``, and its attribute there."""
    if is_slot_name(local_name):
        module, part, k, slot = parse_slot_name(local_name)
        layer = model.get_submodule(module)
        stacked = getattr(layer, f"{part}_stacked")[k]  # dense [N, 1, ...]; a MoE layer's [N, E_local, ...]
        return LoraSlot(layer, stacked[slot, 0] if part in ("lora_a", "lora_b") else stacked[slot]), "value"
    mname, _, pname = local_name.rpartition(".")
    return (model.get_submodule(mname) if mname else model), pname


class TargetAndDraft(torch.nn.Module):
    """The target model's children at the root and the speculative-decoding draft under
    ``draft``: one module tree that addresses both, so a refit writes and commits them as one
    model (local names ``draft.<the draft's own name>``). A module the draft shares with the
    target (the embedding, the output head) keeps its target name: it is one tensor, written
    once."""

    def __init__(self, target: torch.nn.Module, draft: torch.nn.Module) -> None:
        super().__init__()
        for name, child in target.named_children():
            self.add_module(name, child)
        self.add_module("draft", draft)


def guarded(holder: "torch.nn.Module | LoraSlot") -> torch.nn.Module:
    """The module whose forward reads what ``holder`` holds."""
    return holder.layer if isinstance(holder, LoraSlot) else holder


def plain_linear_enabled(layer: torch.nn.Module) -> bool:
    """True when a CPU linear computes with plain ``F.linear`` on ``layer.weight``."""
    return getattr(layer, "cpu_linear", None) is torch.nn.functional.linear


def kernel_is_model_format(layer: torch.nn.Module) -> bool:
    """Whether ``process_weights_after_loading`` leaves this module's weights as loaded."""
    qm = getattr(layer, "quant_method", None)
    if qm is None:
        return True  # norms, plain parameters: used as loaded
    cls = type(qm).__name__
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        # Linear / embedding methods repack unless the plain-linear mode is active;
        # the CPU MoE always prepacks w13/w2 in place.
        return cls in ("UnquantizedLinearMethod", "UnquantizedEmbeddingMethod") and plain_linear_enabled(layer)
    if current_platform.is_cuda():
        if cls in ("UnquantizedLinearMethod", "UnquantizedEmbeddingMethod"):
            return True
        if cls == "UnquantizedFusedMoEMethod":
            backend = str(getattr(qm, "unquantized_backend", ""))
            return backend.endswith("TRITON")
    return False


def mla_absorbers(model: torch.nn.Module) -> dict[int, list[torch.nn.Module]]:
    """``id(kv_b_proj module) -> [MLA attention layers]`` that absorb its weight after loading."""
    try:
        from vllm.model_executor.layers.attention.mla_attention import MLAAttention
    except ImportError:  # a vLLM without MLA
        return {}
    out: dict[int, list[torch.nn.Module]] = {}
    for m in model.modules():
        kv_b = getattr(m, "kv_b_proj", None) if isinstance(m, MLAAttention) else None
        if kv_b is not None:
            out.setdefault(id(kv_b), []).append(m)
    return out


def tied_dependents(model: torch.nn.Module) -> dict[int, list[torch.nn.Module]]:
    """``id(module) -> [other modules with their own kernel state over one of its parameters]``:
    vLLM ties an LM head to the input embedding by sharing the ``Parameter``
    (``ParallelLMHead.tie_weights``) while the head keeps kernel state of its own built from
    it at load (on CPU, the packed ``cpu_linear``). A refit writes the embedding only (the
    plan moves a tied tensor once), so the head's state must be rebuilt with it
    (``Shadows.process``), or the engine computes with the old head."""
    owners: dict[int, torch.nn.Module] = {}
    out: dict[int, list[torch.nn.Module]] = {}
    for m in model.modules():
        for p in m._parameters.values():
            if p is None:
                continue
            first = owners.setdefault(id(p), m)
            if first is not m and getattr(m, "quant_method", None) is not None:
                out.setdefault(id(first), []).append(m)
    return out


def process_dependent(dependent: torch.nn.Module, layer: torch.nn.Module, shadow: torch.nn.Module,
                      device: torch.device) -> torch.nn.Module:
    """A shadow of ``dependent`` (a module sharing a parameter with ``layer``,
    ``tied_dependents``) over the new values in ``layer``'s ``shadow``, processed by its own
    quant method alone; the live module is not touched. (The whole ``process_shadow`` is not
    the same here: run on a dependent it made GLM-4.5's refit differ from vLLM's own load,
    ``test_family_refit.py``.)"""
    from vllm.model_executor.layers.quantization.base_config import QuantizeMethodBase

    out = shadow_module(dependent)
    for name, p in dependent._parameters.items():
        for lname, lp in layer._parameters.items():
            if lp is p and shadow._parameters.get(lname) is not None:
                out._parameters[name] = shadow._parameters[lname]
    qm = getattr(out, "quant_method", None)
    if isinstance(qm, QuantizeMethodBase):
        with device, torch.no_grad():
            qm.process_weights_after_loading(out)
    return out


def reabsorb(attn: torch.nn.Module) -> None:
    """Rebuild W_UK / W_UV from the (new) kv_b_proj. Unquantized models compute in the
    weight's dtype, which is the ``act_dtype`` vLLM passes at load."""
    attn.process_weights_after_loading(attn.kv_b_proj.weight.dtype)


def derivations(layer: torch.nn.Module) -> dict[str, Any]:
    """``{attribute: fn}`` for the tensors of ``layer`` whose weight loader computes: vLLM's
    ``composed_weight_loader(loader, fn)`` stores ``fn(loaded slice)``, not the slice (Mamba2's
    ``A = -exp(A_log)``). Read from the loader's own closure, so a refit re-derives with
    vLLM's function, never a copy of it."""
    import inspect

    out: dict[str, Any] = {}
    if not isinstance(layer, torch.nn.Module):  # a LoRA slot (``LoraSlot``): loaded by the refit adapter, as is
        return out
    for name, t in list(layer._parameters.items()):
        loader = getattr(t, "weight_loader", None) if t is not None else None
        while loader is not None and hasattr(loader, "_rdt_stamp_inner"):
            loader = loader._rdt_stamp_inner
        if loader is None or getattr(loader, "__name__", "") != "composed_loader":
            continue
        fn = inspect.getclosurevars(loader).nonlocals.get("fn")
        if fn is not None:
            out[name] = fn
    return out


def select_modes(model: torch.nn.Module, params: Sequence[LocalParam]) -> dict[str, str]:
    """``{local_name: "direct" | "reload"}``: direct only where the live tensor is the
    model-format tensor (same shape/dtype, contiguous) and the kernel uses it as such."""
    from vllm.model_executor.model_loader.reload.meta import SKIP_TENSORS

    absorbed = mla_absorbers(model)
    modes = {}
    for lp in params:
        layer, pname = owner(model, lp.name)
        if pname in SKIP_TENSORS:  # vLLM's reload never repacks these: used as loaded
            modes[lp.name] = DIRECT
            continue
        if id(layer) in absorbed:  # MLA_NOTE
            modes[lp.name] = RELOAD
            continue
        if derivations(layer):  # a loader computes (DERIVED_NOTE): its whole module re-derives in a shadow
            modes[lp.name] = RELOAD
            continue
        live = getattr(layer, pname, None)
        same = (
            isinstance(live, torch.Tensor)
            and tuple(live.shape) == tuple(lp.shape)
            and live.dtype == TORCH_DTYPES.get(lp.dtype)
            and live.is_contiguous()
            and not live.is_meta
        )
        modes[lp.name] = DIRECT if same and kernel_is_model_format(layer) else RELOAD
    return modes


@dataclass(frozen=True, eq=False)
class ParamTable:
    """Every parameter a refit writes on one worker, looked up once (a box takes several
    lookups): its ``LocalParam`` and mode (``select_modes``), the module (or LoRA slot) that
    holds it and its attribute there, each module's name, and the parameters under each module
    name (attribute -> local name: one shadow takes them all). Shared, never changed, by the
    applier's parts: the participant, its shadows and gate, and the sink."""

    model: torch.nn.Module
    params: Mapping[str, LocalParam]
    modes: Mapping[str, str]
    owners: Mapping[str, tuple["torch.nn.Module | LoraSlot", str]]
    #: ``id(module)`` -> its name (the first ``named_modules`` gives).
    prefix: Mapping[int, str]
    names_under: Mapping[str, Mapping[str, str]]

    @classmethod
    def of(cls, model: torch.nn.Module, params: Sequence[LocalParam],
           modes: Mapping[str, str] | None = None) -> "ParamTable":
        """The table of ``params`` on ``model``; ``modes`` default to ``select_modes``."""
        by_name = {p.name: p for p in params}
        names_under: dict[str, dict[str, str]] = {}
        for n in by_name:
            prefix, _, attr = n.rpartition(".")
            names_under.setdefault(prefix, {})[attr] = n
        return cls(model, by_name, dict(modes) if modes is not None else select_modes(model, params),
                   {n: owner(model, n) for n in by_name}, {id(m): name for name, m in model.named_modules()},
                   names_under)

    def live(self, name: str) -> torch.Tensor:
        """The tensor the engine serves for ``name`` (kernel format where its mode is reload)."""
        holder, attr = self.owners[name]
        return getattr(holder, attr).data

    def expected(self, name: str) -> int:
        """The elements a refit writes into ``name``: all but its padding."""
        lp = self.params[name]
        return lp.numel - lp.padding

    def module_params(self, name: str) -> list[str]:
        """The reload-mode parameters of ``name``'s module (one shadow, one processing)."""
        names = self.names_under.get(self.prefix[id(self.owners[name][0])], {})
        return [n for n in names.values() if self.modes[n] == RELOAD]

    def guarded(self) -> list[torch.nn.Module]:
        """Each module whose forward reads a parameter written here, once (the gate's)."""
        return list({id(guarded(m)): guarded(m) for m, _ in self.owners.values()}.values())


MISSING = object()


def aliased(layer: "torch.nn.Module | LoraSlot", pname: str) -> bool:
    """Whether a buffer of ``layer`` shares parameter ``pname``'s storage (it would keep the
    old storage after a rebind); a LoRA slot always does (its stacked tensor)."""
    if isinstance(layer, LoraSlot):
        return True
    ptr = getattr(layer, pname).untyped_storage().data_ptr()
    return any(b is not None and b.untyped_storage().data_ptr() == ptr for b in layer._buffers.values())


def swap_into(live: torch.Tensor, new: torch.Tensor, rebind: bool) -> None:
    """Processed values into a live kernel tensor: ``rebind`` (or a kernel that changed the
    shape or dtype): the live tensor object takes the shadow's storage, O(1); else an
    in-place copy (storage addresses kept, as CUDA graphs need)."""
    if rebind or live.shape != new.shape or live.dtype != new.dtype:
        live.data = new.data
    else:
        live.data.copy_(new)


def shadow_module(layer: torch.nn.Module) -> torch.nn.Module:
    """A shallow copy of ``layer`` with its own parameter/buffer dicts and attributes: vLLM's
    reload functions rebind tensors and set attributes on it, never on ``layer``. Hooks and
    submodules are shared (a shadow never runs a forward)."""
    shadow = object.__new__(type(layer))
    shadow.__dict__.update(layer.__dict__)
    shadow.__dict__["_parameters"] = dict(layer._parameters)
    shadow.__dict__["_buffers"] = dict(layer._buffers)
    shadow.__dict__["_non_persistent_buffers_set"] = set(layer._non_persistent_buffers_set)
    return shadow


def reprepack_cpu_moe(layer: torch.nn.Module) -> None:
    """vLLM 0.32 CPU: ``_setup_kernel`` pads and prepacks MoE weights only on the first
    load, so a reload would copy model-format bytes (of the unpadded shape) into the
    kernel tensors. Run the kernel's pad + prepack on the materialised layer, before the
    copy into the kernel tensors, as the first load does."""
    if not hasattr(layer, "w13_weight"):
        return
    from vllm.platforms import current_platform

    kernel = getattr(getattr(layer, "quant_method", None), "moe_kernel", None)
    if current_platform.is_cpu() and kernel is not None:
        kernel.fused_experts.process_weights_after_loading(layer)


def open_shadow(layer: torch.nn.Module, prefix: str, names: dict[str, str], params: Mapping[str, LocalParam],
                modes: Mapping[str, str], device: torch.device) -> tuple[torch.nn.Module, dict[str, str]]:
    """A shadow of ``layer`` (module ``prefix``) in model format, and the attributes it takes
    writes for (``names``: attribute -> local name, less the direct ones vLLM's reload leaves
    live). vLLM's layerwise reload (``restore_layer_on_meta`` + ``materialize_layer``) runs on
    the shadow with its own bookkeeping; the live layer is not touched."""
    from vllm.model_executor.model_loader.reload.layerwise import get_layerwise_info
    from vllm.model_executor.model_loader.reload.meta import SKIP_TENSORS, materialize_layer, restore_layer_on_meta
    from vllm.model_executor.model_loader.reload.types import LayerReloadingInfo
    from vllm.model_executor.model_loader.reload.utils import get_layer_tensors

    names = dict(names)
    for attr, local in list(names.items()):
        if modes[local] == RELOAD:
            continue
        if attr not in SKIP_TENSORS:  # the reload would overwrite a direct write
            raise LayoutError(f"{local}: module {prefix or '<root>'} mixes direct and reload parameters")
        del names[attr]  # left live by the reload (e.g. e_score_correction_bias): written directly
    live_info = get_layerwise_info(layer)
    if live_info.can_load() or live_info.kernel_tensors is not None:
        raise RuntimeError(f"{prefix}: a vLLM layerwise reload is already in progress on this layer")
    shadow = shadow_module(layer)
    shadow.__dict__["_mr_derivations"] = derivations(layer)  # from the live loaders, before the restore
    # The shadow's own reload bookkeeping, from the metadata vLLM recorded at load (the live
    # layer's entry in vLLM's LAYERWISE_INFO is never touched).
    info = LayerReloadingInfo(restore_metadata=live_info.restore_metadata, restore_device=live_info.restore_device)
    with device:
        restore_layer_on_meta(shadow, info)
        materialize_layer(shadow, info)
    if holds_codes(names, params):  # a block-FP8 layer refit with codes and scales (``fp8.py``)
        open_codes(shadow, names, params, device)
    # Padding elements are zero, never uninitialised memory. A described parameter without
    # padding is written whole by the plan (the applier checks the count), so zeroing it first
    # would only be one more pass over the layer's bytes.
    written_whole = {attr for attr, local in names.items() if params[local].padding == 0}
    for name, t in get_layer_tensors(shadow).items():
        if name not in SKIP_TENSORS and t.is_floating_point() and name not in written_whole:
            t.data.zero_()
    return shadow, names


def process_shadow(shadow: torch.nn.Module, device: torch.device) -> None:
    """vLLM's per-layer processing (``process_weights_after_loading``) on a complete shadow."""
    from vllm.model_executor.layers.quantization.base_config import QuantizeMethodBase

    if hasattr(shadow, "_already_called_process_weights_after_loading"):
        delattr(shadow, "_already_called_process_weights_after_loading")
    qm = getattr(shadow, "quant_method", None)
    with device, torch.no_grad():
        # What vLLM's loader computes at load (``derivations``), from the raw values the refit
        # wrote, before any kernel processing -- the order of vLLM's own load.
        for name, fn in shadow.__dict__.get("_mr_derivations", {}).items():
            t = shadow._parameters[name]
            t.data.copy_(fn(t))
        # FP8 codes: the kernel's packing alone (``fp8.py``); anything else: vLLM's processing.
        if isinstance(qm, QuantizeMethodBase):  # (vLLM's FP8 methods are too)
            if not process_codes(shadow, device):
                qm.process_weights_after_loading(shadow)
            if hasattr(shadow, "update_param_tp_status"):
                shadow.update_param_tp_status()
        reprepack_cpu_moe(shadow)


def viewed_storages(model: torch.nn.Module) -> frozenset[int]:
    """Storages some buffer of ``model`` views (Mamba2's ``conv_weights`` views its conv1d's
    ``weight``, a parameter of another module): a tensor there is copied into, never rebound,
    or the view would keep serving the old values."""
    return frozenset(b.untyped_storage().data_ptr() for b in model.buffers() if b is not None and b.numel())


def carried(attr: str) -> bool:
    """Whether a module attribute that vLLM's processing set on a shadow stands for the live
    module's too (kernel handles such as ``cpu_linear``, and CPU processing's private ``_cpu_*``
    copies; torch's own ``_parameters`` and the like are not)."""
    return not attr.startswith("_") or attr.startswith("_cpu_")


def commit_shadow(live: torch.nn.Module, shadow: torch.nn.Module, written: set[str], rebind: bool,
                  viewed: frozenset[int] = frozenset()) -> None:
    """A processed shadow's tensors into the live kernel tensors (copied in place, as vLLM's
    ``_copy_and_restore_kernel_tensors``; ``rebind``: the live tensors take the shadow's
    storages), then what processing set on the module (kernel handles such as the CPU
    ``cpu_linear``). ``written``: the attributes the refit wrote."""
    for name, param in live._parameters.items():
        new = shadow._parameters.get(name)
        if param is not None and new is not None and new is not param:
            swap_into(param, new, rebind and not aliased(live, name) and param.untyped_storage().data_ptr() not in viewed)
    for name, buf in live._buffers.items():
        new = shadow._buffers.get(name)
        if buf is None or new is None or new is buf:
            continue
        if name in live._non_persistent_buffers_set and name not in written:
            continue  # vLLM's reload keeps such buffers (e.g. rotary caches) as they are
        swap_into(buf, new, False)
    for k, v in shadow.__dict__.items():
        # ``_cpu_*``: CPU processing's private copies (Qwen3-Next's conv1d keeps
        # ``_cpu_unpacked_conv_weight`` beside the packed weight): stale if not carried over.
        if carried(k) and live.__dict__.get(k, MISSING) is not v:
            live.__dict__[k] = v


def untie_head(model: torch.nn.Module) -> None:
    """Fault injection (``EngineFault.untie_head``, tests only): an LM head tied to the input
    embedding gets a copy of it as its own weight, which no refit then writes -- the head
    of a tied model left stale while the embedding is updated."""
    head = getattr(model, "lm_head", None)
    embed = getattr(getattr(model, "model", None), "embed_tokens", None)
    if head is None or embed is None or head.weight is not embed.weight:
        return
    copy = shadow_module(head)
    copy._parameters["weight"] = torch.nn.Parameter(head.weight.detach().clone(), requires_grad=False)
    model.lm_head = copy
