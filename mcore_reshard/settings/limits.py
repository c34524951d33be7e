"""What the settings may ask for: ranks the planner describes, and what the local CPU job
can run (one place, shared by ``mcore-reshard refit`` and GRPO recipes)."""

from __future__ import annotations

from typing import Mapping

from ..adapters.megatron.rules import MegatronParallel
from ..adapters.vllm.rules import VllmParallel
from ..errors import ConfigError
from ..layout import ModelSpec

__all__ = ["MAX_WORLD", "MAX_LOCAL_PROCESSES", "MAX_PLAN_TRANSFERS", "check_world", "local_cpu_problem",
           "local_train_problem", "cpu_has_amx"]

#: Ranks per side the metadata planner describes. Layouts are built rank by rank in memory
#: (about 1.6k pieces per rank for a large MoE), so a typo such as ``training.dp=100000000``
#: would exhaust memory; 4096 is 16x the largest layout benchmarked (256 ranks).
MAX_WORLD = 4096
#: Trainer processes + vLLM workers the local job may start on this machine.
MAX_LOCAL_PROCESSES = 32
#: Transfers a plan may hold. The planner cuts every piece into bucket-sized transfers, so
#: their number is at least (bytes each destination receives / bucket); each costs about 1 KB
#: of plan memory (Qwen3-30B-A3B: 304k transfers, 0.3 GB) and one message per refit. 2M is 6x
#: the largest plan benchmarked (328k); beyond it a ``refit.buffer_bytes`` too small for the
#: model would take gigabytes to plan (the default plan with 64 KiB buffers: 15M transfers).
MAX_PLAN_TRANSFERS = 2_000_000


def check_world(training_world: int, vllm_world: int) -> None:
    """Both worlds within :data:`MAX_WORLD` (checked before any layout is built)."""
    for side, world in (("training", training_world), ("vllm", vllm_world)):
        if world > MAX_WORLD:
            raise ConfigError(f"{side} world of {world} ranks: the planner describes at most {MAX_WORLD} ranks "
                              f"per side (check the {side}.* sizes)")


def local_cpu_problem(training: MegatronParallel, vllm: VllmParallel, *,
                      labels: Mapping[str, str] | None = None) -> str | None:
    """The first thing of these layouts the local CPU job cannot run (one line), or None.

    ``labels`` spell the settings the caller's config uses (``layer_spec``, ``experts``,
    ``vllm_pp_dp``, ``enable_ep``); the defaults are ``configs/refit.yaml``'s keys.
    """
    names = {
        "layer_spec": f"training.layer_spec={training.layer_spec!r}",
        "experts": f"training.experts={training.experts!r}",
        "vllm_pp_dp": f"vllm.pp={vllm.pp}, vllm.dp={vllm.dp}: vllm.pp/vllm.dp > 1",
        "enable_ep": "vllm.enable_ep=true",
        **(labels or {}),
    }
    if training.layer_spec != "local":
        return (f"{names['layer_spec']}: the local CPU job builds megatron-core's local layer spec "
                f"(Transformer Engine needs a GPU)")
    if training.experts != "sequential":
        return (f"{names['experts']}: the local CPU job runs sequential experts "
                f"(grouped GEMM needs Transformer Engine and a GPU)")
    if vllm.pp != 1 or vllm.dp != 1:
        return f"{names['vllm_pp_dp']}: one engine per replica with pp=dp=1 runs on this machine"
    if vllm.enable_ep:
        return (f"{names['enable_ep']}: vLLM's CPU fused-MoE kernel segfaults on an expert-parallel "
                f"forward; the local job runs the experts under TP")
    if vllm.quantization is not None and not cpu_has_amx():
        return (f"vllm.quantization={vllm.quantization}: vLLM's CPU FP8 kernels need AMX tiles, which this CPU "
                f"lacks, so the local job cannot start an FP8 engine here; `mcore-reshard plan` plans it")
    procs = training.world_size + vllm.world_size
    if procs > MAX_LOCAL_PROCESSES:
        return (f"training world {training.world_size} + vllm world {vllm.world_size} = {procs} processes: "
                f"the local job starts at most {MAX_LOCAL_PROCESSES} on this machine")
    return None


def local_train_problem(spec: ModelSpec, model: str) -> str | None:
    """Why the local job cannot train ``spec`` in megatron-core on this CPU and compare its
    logprobs with vLLM's (one line), or None. The hybrids' layouts plan and refit here (the
    tests refit a live Nemotron-H engine without a training step), but their training forward
    does not run: megatron-core's Mamba has no torch fallback for its scan (mamba-ssm's
    kernels), and its Qwen3-Next build here lacks the (1 + w) RMSNorms
    (``layernorm_zero_centered_gamma``), so its logprobs cannot match vLLM's."""
    h = spec.hybrid
    if h is None:
        return None
    why = ("megatron-core's Mamba mixer has no CPU forward (mamba-ssm's scan kernels, no torch fallback)"
           if "M" in h.mixers else "megatron-core's CPU build here lacks Qwen3-Next's (1 + w) RMSNorms, so trained "
           "logprobs cannot match vLLM's")
    return (f"model={model}: the local job trains {spec.family.title} in megatron-core on CPU, but {why}; "
            f"`mcore-reshard plan` plans its refits")


def cpu_has_amx() -> bool:
    """Whether this CPU has AMX tiles (``amx_tile`` in ``/proc/cpuinfo``): what vLLM's CPU
    block-FP8 linear and MoE kernels require."""
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            return any(line.startswith("flags") and " amx_tile" in line for line in f)
    except OSError:
        return False
