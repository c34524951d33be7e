"""Make megatron-core 0.19.2 train on CPU-only torch (gloo): patch its hard-coded CUDA calls.

Applied only in trainer processes, only when CUDA is absent (a no-op on GPU machines), and
idempotent. Each patch replaces a CUDA-only call with its CPU equivalent; nothing else
changes, so layouts and numerics are megatron's own.
"""

from __future__ import annotations

import contextlib
import functools

__all__ = ["apply_cpu_patches"]

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
    _APPLIED = True
    return True


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
