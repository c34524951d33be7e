"""vLLM's own model class built in this process, one TP rank at a time, without an engine.

For the families whose kernels the vLLM CPU engine cannot run (or cannot run at every TP),
a refit is verified against vLLM's own load in-process: the model class that vLLM's loader
would build (``initialize_model``), loaded once by vLLM's own ``load_weights`` from the HF
checkpoint (then ``process_weights_after_loading``), and once by a refit through the
project's applier. Nothing in a forward pass is needed for that, so no kernel is either.

TP > 1 without processes: vLLM's layers read their TP size and rank from the TP group
coordinator (``get_tp_group().world_size`` / ``.rank_in_group``) when they are built and when
their weight loaders run; :func:`tp_rank` sets both on a world of one for the duration of a
build or a load, so rank r of a TP-n model is built exactly as a worker of rank r builds it.
No collective runs in either step.

Test scaffolding (``mcore_reshard.testing``): production code never imports it.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Mapping

import torch

__all__ = ["InprocModel", "build_vllm_model", "tp_rank", "vllm_world", "kernel_state", "load_hf"]

_WORLD: dict[str, Any] = {}


def vllm_world(port: int | None = None) -> None:
    """vLLM's distributed state for a world of one (gloo), once per process."""
    if _WORLD:
        return
    from vllm.distributed import parallel_state as ps

    from ..infra.ports import free_port

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    ps.init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                    distributed_init_method=f"tcp://127.0.0.1:{port or free_port()}")
    _WORLD["ps"] = ps


@contextlib.contextmanager
def tp_rank(tp: int, rank: int, pp: int = 1, pp_rank: int = 0) -> Iterator[None]:
    """Rank ``rank`` of a TP-``tp`` group (and stage ``pp_rank`` of ``pp``), as the layers see
    it, on a world of one: the PP group's size, rank and members are what ``make_layers``
    (``get_pp_indices``) and ``is_first_rank`` / ``is_last_rank`` read."""
    ps = _WORLD["ps"]
    group, pipe = ps.get_tp_group(), ps.get_pp_group()
    saved = group.world_size, group.rank_in_group
    saved_pp = pipe.world_size, pipe.rank_in_group, pipe.ranks, pipe.rank
    group.world_size, group.rank_in_group = tp, rank
    if pp > 1:
        pipe.world_size, pipe.rank_in_group, pipe.ranks, pipe.rank = pp, pp_rank, list(range(pp)), pp_rank
    try:
        yield
    finally:
        group.world_size, group.rank_in_group = saved
        pipe.world_size, pipe.rank_in_group, pipe.ranks, pipe.rank = saved_pp


@dataclass
class InprocModel:
    """One TP rank's vLLM model, with the config it was built under."""

    model: torch.nn.Module
    vllm_config: Any
    tp: int
    rank: int
    pp: int = 1
    pp_rank: int = 0

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        from vllm.config import set_current_vllm_config

        with set_current_vllm_config(self.vllm_config), tp_rank(self.tp, self.rank, self.pp, self.pp_rank), \
                torch.device("cpu"):
            yield


def _engine_config(model_dir: str | Path, dtype: str, tp: int, **engine: Any) -> Any:
    from vllm.engine.arg_utils import EngineArgs

    cfg = EngineArgs(model=str(model_dir), skip_tokenizer_init=True, dtype=dtype, enforce_eager=True,
                     max_model_len=256, max_num_seqs=4, seed=0, **engine).create_engine_config()
    cfg.parallel_config.tensor_parallel_size = tp
    return cfg


def build_vllm_model(model_dir: str | Path, dtype: str, tp: int = 1, rank: int = 0, pp: int = 1,
                     pp_rank: int = 0, **engine: Any) -> InprocModel:
    """vLLM's model class for ``model_dir`` as TP rank ``rank`` of ``tp`` (of PP stage
    ``pp_rank`` of ``pp``) builds it (weights uninitialised: load them with :func:`load_hf` or
    a refit); ``engine``: more ``EngineArgs`` (``mm_encoder_tp_mode``)."""
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader.utils import initialize_model
    from vllm.utils.torch_utils import set_default_torch_dtype

    vllm_world()
    cfg = _engine_config(model_dir, dtype, tp, **engine)
    with set_current_vllm_config(cfg):
        ps = _WORLD["ps"]
        if not ps.model_parallel_is_initialized():
            ps.initialize_model_parallel(1, 1)
    out = InprocModel(None, cfg, tp, rank, pp, pp_rank)  # type: ignore[arg-type]
    with out.active(), set_default_torch_dtype(cfg.model_config.dtype):
        out.model = initialize_model(vllm_config=cfg)
    return out


def load_hf(m: InprocModel) -> None:
    """vLLM's own load of the checkpoint: ``load_weights`` over the files, then
    ``process_weights_after_loading`` (what a worker does at start)."""
    from vllm.model_executor.model_loader import get_model_loader
    from vllm.model_executor.model_loader.utils import process_weights_after_loading

    with m.active():
        loader = get_model_loader(m.vllm_config.load_config)
        m.model.load_weights(loader.get_all_weights(m.vllm_config.model_config, m.model))
        process_weights_after_loading(m.model, m.vllm_config.model_config, torch.device("cpu"))


def kernel_state(model: torch.nn.Module, probe_seed: int = 0) -> dict[str, torch.Tensor]:
    """Everything a forward pass reads, as tensors to compare bit for bit: every parameter and
    buffer, every tensor attribute a processing step left on a module (a conv's unpacked
    copy), and, for each layer whose weights vLLM's CPU processing packed into a kernel handle
    (``cpu_linear``; the parameter is then empty), the handle's output on a fixed probe: equal
    packed weights give equal outputs, bit for bit."""
    out: dict[str, torch.Tensor] = {}
    for name, t in model.named_parameters(remove_duplicate=False):
        out[name] = t.detach()
    for name, t in model.named_buffers(remove_duplicate=False):
        out["buffer:" + name] = t.detach()
    gen = torch.Generator().manual_seed(probe_seed)
    for mname, module in model.named_modules():
        for k, v in vars(module).items():
            if isinstance(v, torch.Tensor) and not k.startswith("__"):
                out[f"attr:{mname}.{k}"] = v.detach()
        fn = getattr(module, "cpu_linear", None)
        weight = getattr(module, "weight", None)
        if fn is None or weight is None:
            continue
        k_in = getattr(module, "input_size_per_partition", None) or getattr(module, "embedding_dim", None)
        if k_in is None:
            continue
        dtype = weight.dtype if weight.is_floating_point() else torch.float32
        x = torch.randn(3, int(k_in), generator=gen).to(dtype)
        out[f"probe:{mname}"] = fn(x, getattr(module, "weight", None), getattr(module, "bias", None)).detach()
    return out


def compare_states(want: Mapping[str, torch.Tensor], got: Mapping[str, torch.Tensor]) -> list[str]:
    """Names whose tensors differ in shape, dtype or any bit (or exist on one side only)."""
    bad = sorted(set(want) ^ set(got))
    for name in sorted(set(want) & set(got)):
        a, b = want[name], got[name]
        if a.shape != b.shape or a.dtype != b.dtype:
            bad.append(f"{name} ({tuple(a.shape)} {a.dtype} vs {tuple(b.shape)} {b.dtype})")
        elif a.numel() and not torch.equal(a.reshape(-1).view(torch.uint8) if a.dtype.itemsize == 1 else
                                           a.contiguous().view(_INT[a.dtype.itemsize]),
                                           b.contiguous().view(_INT[b.dtype.itemsize])):
            bad.append(name)
    return bad


_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
