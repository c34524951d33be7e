"""Make megatron-core 0.19.2 train on CPU-only torch (gloo): patch its hard-coded CUDA calls.

Applied only in trainer processes, only when CUDA is absent (a no-op on GPU machines), and
idempotent. Each patch replaces a CUDA-only call with its CPU equivalent; nothing else
changes, so layouts and numerics are megatron's own.

The patches (``apply_cpu_patches``):

Model forward / backward
  1. ``torch.cuda.current_device`` -> the CPU device (~60 call sites build tensors on it:
     rotary ``inv_freq``, all-to-all outputs, DDP grad / param buffers, p2p shape buffers).
  2. The RNG tracker (``tensor_parallel.random``): CUDA RNG get/set state and
     ``CudaRNGStatesTracker.add`` use the CPU generator; ``torch.cuda.manual_seed`` seeds the
     CPU one (``model_parallel_cuda_manual_seed``).
  3. ``get_default_causal_mask`` and ``get_sliding_window_causal_mask`` (gpt-oss's windowed
     layers) hard-code ``device="cuda"``: CPU masks where they are looked up.
  4. MoE alltoall dispatcher: ``torch.cuda.Stream/Event/current_stream/stream`` become null
     objects (CPU work is synchronous), and ``maybe_move_tensor_to_cpu`` returns numpy split
     sizes for CPU tensors too (``all_to_all_single`` wants lists). The DDP grad-sync path uses
     the same null ``current_stream``.

Training stack (``Float16Module`` + ``DistributedDataParallel`` + ``get_megatron_optimizer`` +
``get_forward_backward_func``)
  5. ``device='cuda'`` tensor factories (``torch.tensor/zeros/ones/empty/full``) in the modules
     on that path -- the optimizer's ``found_inf`` / ``_scale_one`` / ``_dummy_overflow_buf``,
     the grad scaler, ``clip_grads`` norms, the schedules' ``total_num_tokens``, the rerun state
     machine, ``utils`` l2 norm, ``tensor_parallel.data`` -- see ``_CUDA_FACTORY_MODULES``: each
     such module's ``torch`` global is replaced by a proxy whose factories map a CUDA device to
     the CPU (everything else is torch itself).
  6. ``Tensor.type()`` (no arguments) answers the CUDA type name (``torch.cuda.BFloat16Tensor``)
     for CPU tensors *only when called from ``megatron.core.optimizer``*: the (distributed)
     mixed-precision optimizers pick fp32 main params for bf16 params and ``clip_grads`` asserts
     fp32 grads by comparing those strings; elsewhere ``type()`` is unchanged.
  7. ``torch.cuda.synchronize`` -> a no-op: the pipeline p2p layer calls it after every
     ``batch_isend_irecv`` (gloo's requests are waited on before it; CPU work is synchronous).
  8. ``Tensor.cuda()`` called from ``megatron.core`` returns the CPU tensor itself: tied
     embeddings with PP > 1 move the last stage's output-layer copy to the GPU before the
     first/last-stage all-reduce (``LanguageModule.setup_embeddings_and_output_layer``);
     elsewhere ``.cuda()`` is unchanged.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import sys
import types

__all__ = ["apply_cpu_patches", "apply_fsdp_cpu_patches", "apply_vision_cpu_patches", "CPU_NOTICE", "quiet_cpu_notices"]

#: megatron-core's import-time warnings of what a CPU machine lacks: expected here, said once
#: by the job (``CPU_NOTICE``) instead of by every process that imports megatron.
CPU_NOTICES = ("Transformer Engine and Apex are not installed", "Apex is not installed", "absl.logging is not installed",
               # megatron-core 0.19.2's DDP calls a torch API that torch 2.13 deprecates, every step
               "`torch.distributed.reduce_scatter_tensor` is deprecated")
CPU_NOTICE = ("megatron-core: Transformer Engine and Apex are not installed (a CPU machine): torch's optimizers "
              "and megatron's local multi-tensor kernels are used")


def quiet_cpu_notices() -> bool:
    """Filter ``CPU_NOTICES`` in this process and in every process it starts (``PYTHONWARNINGS``
    is read at each interpreter's start: spawned ranks, the fork server, Ray's workers). True
    when the notice applies (neither Transformer Engine nor Apex is importable): the caller
    prints ``CPU_NOTICE`` once."""
    import importlib.util
    import os
    import warnings

    for msg in CPU_NOTICES:
        warnings.filterwarnings("ignore", message=msg)
    have = os.environ.get("PYTHONWARNINGS", "")
    extra = [f"ignore:{msg}" for msg in CPU_NOTICES if f"ignore:{msg}" not in have]
    if extra:
        os.environ["PYTHONWARNINGS"] = ",".join(([have] if have else []) + extra)
    return importlib.util.find_spec("transformer_engine") is None and importlib.util.find_spec("apex") is None

_APPLIED = False


def apply_cpu_patches() -> bool:
    """Patch this process for CPU megatron; returns True when patches are (now) in place."""
    global _APPLIED
    import torch

    if torch.cuda.is_available():
        return False
    if _APPLIED:
        return True

    from megatron.core.fusions import fused_softmax
    from megatron.core.tensor_parallel import random as mrandom
    from megatron.core.transformer import utils as tutils
    from megatron.core.transformer.moe import moe_utils, token_dispatcher

    cpu = torch.device("cpu")

    # ~60 call sites build tensors on `torch.cuda.current_device()` (rotary inv_freq, all-to-all outputs).
    torch.cuda.current_device = lambda: cpu
    # The RNG tracker saves/restores the CUDA generator around forked regions: use the CPU one.
    mrandom._get_cuda_rng_state = lambda *a, **k: torch.get_rng_state()
    mrandom._set_cuda_rng_state = lambda state, *a, **k: torch.set_rng_state(state)
    mrandom.CudaRNGStatesTracker.add = _cpu_tracker_add
    # model_parallel_cuda_manual_seed seeds the CUDA generator (a no-op here): seed the CPU one.
    torch.cuda.manual_seed = torch.manual_seed
    # get_default_causal_mask hard-codes device="cuda": rebind it where it is looked up.
    tutils.get_default_causal_mask = fused_softmax.get_default_causal_mask = _cpu_causal_mask
    tutils.get_sliding_window_causal_mask = fused_softmax.get_sliding_window_causal_mask = _cpu_window_mask
    # The alltoall dispatcher copies split sizes on a CUDA side stream: a null stream/event on CPU.
    torch.cuda.Stream = _NullStream
    torch.cuda.current_stream = lambda *a, **k: _NULL_STREAM
    torch.cuda.stream = lambda s=None: contextlib.nullcontext()
    torch.cuda.Event = _NullEvent
    # ... and turns split sizes into numpy only for CUDA tensors; all_to_all_single wants lists.
    _orig_move = moe_utils.maybe_move_tensor_to_cpu

    def _move(tensor, as_numpy=False, record_stream=False):
        if torch.is_tensor(tensor) and not tensor.is_cuda:
            return tensor.numpy() if as_numpy else tensor
        return _orig_move(tensor, as_numpy=as_numpy, record_stream=record_stream)

    moe_utils.maybe_move_tensor_to_cpu = _move
    token_dispatcher.maybe_move_tensor_to_cpu = _move
    # The p2p layer synchronises the device after batched send/recv (already waited on here).
    torch.cuda.synchronize = lambda *a, **k: None
    # The training stack's device='cuda' factories: a CPU-mapping torch proxy in those modules.
    proxy = _CpuTorch(torch)
    for mod_name in _CUDA_FACTORY_MODULES:
        mod = importlib.import_module(mod_name)
        if getattr(mod, "torch", None) is torch:
            mod.torch = proxy
    # The optimizers' dtype checks by CUDA type name.
    _orig_type = torch.Tensor.type

    def _type(self, *args, **kwargs):
        if args or kwargs or self.is_cuda:
            return _orig_type(self, *args, **kwargs)
        caller = sys._getframe(1).f_globals.get("__name__", "")
        name = _orig_type(self)
        if caller.startswith("megatron.core.optimizer") and name.startswith("torch."):
            return "torch.cuda." + name.removeprefix("torch.")
        return name

    torch.Tensor.type = _type
    # Tensor.cuda() inside megatron-core (tied embeddings with PP > 1): stay on the CPU.
    _orig_cuda = torch.Tensor.cuda

    def _cuda(self, *args, **kwargs):
        if sys._getframe(1).f_globals.get("__name__", "").startswith("megatron.core"):
            return self
        return _orig_cuda(self, *args, **kwargs)

    torch.Tensor.cuda = _cuda
    _APPLIED = True
    return True


#: megatron-core modules on the training path that create tensors with ``device='cuda'``.
_CUDA_FACTORY_MODULES = (
    "megatron.core.optimizer.optimizer",
    "megatron.core.optimizer.distrib_optimizer",
    "megatron.core.optimizer.clip_grads",
    "megatron.core.optimizer.grad_scaler",
    "megatron.core.pipeline_parallel.schedules",
    "megatron.core.rerun_state_machine",
    "megatron.core.utils",
    "megatron.core.tensor_parallel.data",
)

_FACTORIES = ("tensor", "zeros", "ones", "empty", "full", "arange")


def _cpu_device(device):
    """A CUDA device (string, index or torch.device) -> the CPU device; anything else unchanged."""
    import torch

    if isinstance(device, int) or (isinstance(device, str) and device.startswith("cuda")) or (
            isinstance(device, torch.device) and device.type == "cuda"):
        return torch.device("cpu")
    return device


class _CpuTorch(types.ModuleType):
    """``torch`` for one module: the tensor factories map CUDA devices to the CPU."""

    def __init__(self, torch_mod) -> None:
        super().__init__("torch")
        self.__dict__["_torch"] = torch_mod
        for fname in _FACTORIES:
            self.__dict__[fname] = self._wrap(getattr(torch_mod, fname))

    @staticmethod
    def _wrap(fn):
        @functools.wraps(fn)
        def factory(*args, **kwargs):
            if "device" in kwargs:
                kwargs["device"] = _cpu_device(kwargs["device"])
            return fn(*args, **kwargs)

        return factory

    def __getattr__(self, name: str):
        return getattr(self.__dict__["_torch"], name)


def _cpu_tracker_add(self, name: str, seed: int) -> None:
    """CudaRNGStatesTracker.add with the CPU generator (same bookkeeping as megatron's)."""
    import torch

    self._is_initialized = True
    if seed in self.seeds_:
        raise Exception(f"seed {seed} already exists")
    self.seeds_.add(seed)
    if name in self.states_:
        raise Exception(f"cuda rng state {name} already exists")
    orig = torch.get_rng_state()
    torch.manual_seed(seed)
    self.states_[name] = torch.get_rng_state()
    torch.set_rng_state(orig)


@functools.lru_cache(maxsize=32)
def _cpu_causal_mask(sq: int):
    import torch

    return torch.triu(torch.ones(sq, sq), diagonal=1).bool()


def _cpu_window_mask(sq: int, skv: int, window_size):
    """``get_sliding_window_causal_mask`` on the CPU: True where a query may not attend."""
    import torch

    m = torch.ones(sq, skv, dtype=torch.bool)
    mu = torch.triu(m, diagonal=skv - sq - window_size[0])
    return ~torch.tril(mu, diagonal=skv - sq + window_size[1])


class _NullStream:
    """Stands in for torch.cuda.Stream: CPU work is synchronous."""

    def wait_stream(self, other) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def record_event(self, *a, **k) -> "_NullEvent":
        return _NullEvent()

    def __eq__(self, other) -> bool:
        return isinstance(other, _NullStream)

    __hash__ = object.__hash__


_NULL_STREAM = _NullStream()


class _NullEvent:
    def __init__(self, *a, **k) -> None:
        pass

    def record(self, *a, **k) -> None:
        pass

    def wait(self, *a, **k) -> None:
        pass

    def synchronize(self) -> None:
        pass


_HYBRID_APPLIED = False


def apply_hybrid_cpu_patches() -> None:
    """What megatron-core's hybrid stack needs on CPU, beyond ``apply_cpu_patches``:

    9. ``HybridStack.final_norm`` is hard-wired to ``TENorm`` (Transformer Engine): the
       module's ``TENorm`` name is rebound to ``WrappedTorchNorm`` (torch RMSNorm, the same
       ``weight``).
    10. ``MambaMixer`` refuses to build without mamba-ssm (``HAVE_MAMBA_SSM``): set True,
        since building needs none of its kernels; and it asserts ``RMSNormGated`` (mamba-ssm's Triton norm) exists when
        ``rmsnorm=True``; without mamba-ssm it is a ``MagicMock`` whose ``ExtendedRMSNorm``
        subclass builds no ``weight``: both are replaced by a torch gated RMSNorm with the same
        parameter (``weight`` over the rank's channels), enough to build and describe the
        mixer (its forward needs mamba-ssm's scan kernels, which have no torch fallback).
    11. ``GatedDeltaNet`` refuses to build without FLA (``HAVE_FLA``); with
        ``deterministic_mode=True`` it runs torch's conv1d and ``torch_chunk_gated_delta_rule``
        but calls FLA's ``l2norm``: ``HAVE_FLA`` set True and a torch L2 norm.
    """
    global _HYBRID_APPLIED
    if _HYBRID_APPLIED:
        return
    import torch
    from megatron.core.models.hybrid import hybrid_block
    from megatron.core.ssm import mamba_mixer
    from megatron.core.ssm.gated_delta_net import common as gdn_common
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    hybrid_block.TENorm = WrappedTorchNorm

    class GatedRMSNorm(torch.nn.Module):
        def __init__(self, hidden_size, eps=1e-5, group_size=None, norm_before_gate=False, device=None, dtype=None,
                     **_):
            super().__init__()
            self.eps, self.group_size, self.norm_before_gate = eps, group_size, norm_before_gate
            self.weight = torch.nn.Parameter(torch.ones(hidden_size, device=device, dtype=dtype))

    mamba_mixer.HAVE_MAMBA_SSM = True
    mamba_mixer.RMSNormGated = GatedRMSNorm
    mamba_mixer.ExtendedRMSNorm = GatedRMSNorm
    gdn_common.HAVE_FLA = True
    if getattr(gdn_common, "l2norm", None) is None:
        gdn_common.l2norm = lambda x, eps=1e-6: x * torch.rsqrt((x.float() * x.float()).sum(-1, keepdim=True) + eps).to(x.dtype)
    _HYBRID_APPLIED = True


_VISION_APPLIED = False


def apply_vision_cpu_patches() -> None:
    """What megatron-core's LLaVA needs without Transformer Engine, beyond ``apply_cpu_patches``:

    12. ``CLIPViTModel``'s ``ln_pre`` / ``ln_post`` default to ``TENorm``, else
        ``torch.nn.LayerNorm``, which rejects the ``config=`` that ``build_module`` passes, and
        ``LLaVAModel`` passes neither: the defaults become ``WrappedTorchNorm`` (torch
        LayerNorm from ``config.normalization``, the same ``weight`` / ``bias``).
    """
    global _VISION_APPLIED
    if _VISION_APPLIED:
        return
    from megatron.core.models.vision.clip_vit_model import CLIPViTModel
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    init = CLIPViTModel.__init__
    defaults = list(init.__defaults__)
    defaults[0] = defaults[1] = WrappedTorchNorm  # ln_pre_impl, ln_post_impl
    init.__defaults__ = tuple(defaults)
    _VISION_APPLIED = True


_FSDP_APPLIED = False

#: Megatron-FSDP's modules (``distributed/fsdp``): each builds devices as
#: ``torch.device(f"cuda:{torch.cuda.current_device()}")`` or ``torch.device("cuda")``.
_FSDP_MODULES = tuple(f"megatron.core.distributed.fsdp.src.megatron_fsdp.{m}" for m in (
    "megatron_fsdp", "param_and_grad_buffer", "utils", "fully_shard", "uneven_dtensor", "mixed_precision")) + (
    "megatron.core.distributed.fsdp.mcore_fsdp_adapter",)


def apply_fsdp_cpu_patches() -> None:
    """What Megatron-FSDP (``use_megatron_fsdp``, formerly ``use_custom_fsdp``) needs on CPU,
    beyond ``apply_cpu_patches`` (whose null streams, events and ``synchronize`` it uses):

    12. Its modules build devices as ``torch.device(f"cuda:{torch.cuda.current_device()}")``,
        ``torch.device("cuda")`` and ``device="cuda"`` factories: each module's ``torch`` is the
        CPU-mapping proxy of patch 5, whose ``device`` maps a CUDA device to the CPU as well.
    13. ``mcore_fsdp_adapter`` builds its DTensor meshes with
        ``DeviceMesh.from_group(..., device_type="cuda")``: the CPU mesh over the same groups.
    14. It makes the TP ranks' RNG states equal by broadcasting them, the CUDA generator's
        included (``torch.cuda.get_rng_state`` / ``set_rng_state``): the CPU generator's, as
        patch 2 does for megatron's tracker.

    Nothing of its sharding changes: the flat buffers, their per-rank slices and the DTensors
    over them are Megatron-FSDP's own."""
    global _FSDP_APPLIED
    if _FSDP_APPLIED:
        return
    import torch

    if torch.cuda.is_available():
        return
    apply_cpu_patches()
    from torch.distributed import DeviceMesh

    from megatron.core.distributed.fsdp import mcore_fsdp_adapter

    proxy = _CpuTorch(torch)
    proxy.__dict__["device"] = _CpuDevice
    for mod_name in _FSDP_MODULES:
        mod = importlib.import_module(mod_name)
        if getattr(mod, "torch", None) is torch:
            mod.torch = proxy
    mcore_fsdp_adapter.DeviceMesh = _CpuMesh(DeviceMesh)
    torch.cuda.get_rng_state = lambda *a, **k: torch.get_rng_state()
    torch.cuda.set_rng_state = lambda state, *a, **k: torch.set_rng_state(state)
    _FSDP_APPLIED = True


class _CpuDeviceMeta(type):
    def __instancecheck__(cls, obj) -> bool:
        import torch

        return isinstance(obj, torch.device)


class _CpuDevice(metaclass=_CpuDeviceMeta):
    """``torch.device`` for one module: a CUDA device is the CPU (``isinstance`` still works)."""

    def __new__(cls, *args, **kwargs):
        import torch

        if args and (args[0] == "cuda" or (isinstance(args[0], str) and args[0].startswith("cuda:"))):
            return torch.device("cpu")
        return torch.device(*args, **kwargs)


class _CpuMesh:
    """``DeviceMesh`` for one module: ``from_group`` builds a CPU mesh where it asks for CUDA."""

    def __init__(self, mesh_cls) -> None:
        self._cls = mesh_cls

    def from_group(self, *args, **kwargs):
        if kwargs.get("device_type") == "cuda":
            kwargs["device_type"] = "cpu"
        return self._cls.from_group(*args, **kwargs)

    def __getattr__(self, name: str):
        return getattr(self._cls, name)

    def __instancecheck__(self, obj) -> bool:
        return isinstance(obj, self._cls)
