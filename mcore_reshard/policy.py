"""Turning mcore-reshard on from an RL framework's policy config (NeMo RL shape).

``policy.megatron_cfg.mcore_reshard.enabled: true`` selects the shard-to-shard refit; the
parallel sizes come from the config the recipe already has, so nothing is said twice.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from .adapters.megatron.rules import MegatronParallel
from .adapters.vllm.rules import VllmParallel
from .layout import LayoutError, ModelSpec

__all__ = ["RefitConfig", "RecipeLayout", "from_policy_config"]

TRANSPORTS = ("reshard", "hf_broadcast")
VERIFY = ("off", "checksum", "full")
#: auto: vLLM's layerwise reload wherever the kernel repacks weights, in-place writes where it
#: keeps model format; direct: also switch CPU dense linears to plain F.linear (model format).
APPLY = ("auto", "direct")


@dataclass(frozen=True)
class RefitConfig:
    """How a refit runs (``refit.*`` in the CLI configs, ``megatron_cfg.mcore_reshard`` in recipes)."""

    enabled: bool = True
    transport: str = "reshard"
    #: The most extra memory a rank spends on wire buffers. Two buckets are in flight (one on
    #: the wire while the next is packed or the last is applied), so a bucket is half of it.
    buffer_bytes: int = 1 << 30
    verify: str = "checksum"
    timeout_s: float = 300.0
    apply_mode: str = "auto"
    allow_cast: bool = False

    @property
    def bucket_bytes(self) -> int:
        """The plan's per-round budget: each rank sends and receives at most this per bucket."""
        return max(1, self.buffer_bytes // 2)

    def __post_init__(self) -> None:
        for name, allowed in (("transport", TRANSPORTS), ("verify", VERIFY), ("apply_mode", APPLY)):
            if getattr(self, name) not in allowed:
                raise LayoutError(f"refit.{name}={getattr(self, name)!r} is not one of {allowed}")
        if self.buffer_bytes <= 0:
            raise LayoutError(f"refit.buffer_bytes={self.buffer_bytes} must be positive")
        if self.timeout_s <= 0:
            raise LayoutError(f"refit.timeout_s={self.timeout_s} must be positive")


@dataclass(frozen=True)
class RecipeLayout:
    spec: ModelSpec
    training: MegatronParallel
    vllm: VllmParallel
    refit: RefitConfig
    #: The engine's model when it is configured apart from the trainer's (must match it).
    vllm_spec: ModelSpec | None = None


def _get(cfg: Mapping[str, Any], path: str, default: Any = None) -> Any:
    node: Any = cfg
    for key in path.split("."):
        if node is None or key not in node:
            return default
        node = node[key]
    return node


def from_policy_config(cfg: Mapping[str, Any]) -> RecipeLayout:
    """Map a NeMo-RL-shaped GRPO config onto training / vLLM layouts and a refit config."""
    from .config import resolve_model

    mcfg = _get(cfg, "policy.megatron_cfg")
    if not mcfg or not mcfg.get("enabled", False):
        raise LayoutError("policy.megatron_cfg.enabled must be true to refit from Megatron-Core")
    rcfg = dict(mcfg.get("mcore_reshard") or {})
    if not rcfg.get("enabled", False):
        raise LayoutError("policy.megatron_cfg.mcore_reshard.enabled is not true: mcore-reshard is off in this recipe")
    from .config import build_dataclass

    refit = build_dataclass(RefitConfig, rcfg, "policy.megatron_cfg.mcore_reshard")
    model_ref = _get(cfg, "policy.model_config") or _get(cfg, "policy.model_name")
    spec = resolve_model(str(model_ref), dtype=str(_get(cfg, "policy.precision", "bfloat16")))

    gpus = int(_get(cfg, "cluster.gpus_per_node", 1)) * int(_get(cfg, "cluster.num_nodes", 1))
    gen = _get(cfg, "policy.generation.colocated", {}) or {}
    if gen.get("enabled", True):
        raise LayoutError("policy.generation.colocated.enabled: colocated refits are not planned yet (set it false)")
    gen_gpus = int(_get(gen, "resources.gpus_per_node", 0)) * int(_get(gen, "resources.num_nodes", 0))
    train_world = gpus - gen_gpus
    tp = int(mcfg.get("tensor_model_parallel_size", 1))
    pp = int(mcfg.get("pipeline_model_parallel_size", 1))
    cp = int(mcfg.get("context_parallel_size", 1))
    if train_world <= 0 or train_world % (tp * pp * cp):
        raise LayoutError(
            f"training world {train_world} (cluster minus generation GPUs) is not a multiple of tp*pp*cp={tp * pp * cp}"
        )
    training = MegatronParallel(
        tp=tp, pp=pp, cp=cp, dp=train_world // (tp * pp * cp),
        ep=int(mcfg.get("expert_model_parallel_size", 1)),
        etp=mcfg.get("expert_tensor_parallel_size"),
        vpp=int(mcfg.get("virtual_pipeline_model_parallel_size") or 1),
        first_stage_layers=mcfg.get("num_layers_in_first_pipeline_stage"),
        last_stage_layers=mcfg.get("num_layers_in_last_pipeline_stage"),
        make_vocab_size_divisible_by=int(mcfg.get("make_vocab_size_divisible_by", 128)),
        layer_spec="te" if mcfg.get("transformer_impl", "transformer_engine") == "transformer_engine" else "local",
        experts="grouped" if mcfg.get("moe_grouped_gemm", False) else "sequential",
        sequence_parallel=bool(mcfg.get("sequence_parallel", False)),
    )
    vcfg = _get(cfg, "policy.generation.vllm_cfg", {}) or {}
    vtp = int(vcfg.get("tensor_parallel_size", 1))
    vpp = int(vcfg.get("pipeline_parallel_size", 1))
    vdp = int(vcfg.get("data_parallel_size", 1))
    per_engine = vtp * vpp * vdp
    if gen_gpus % per_engine:
        raise LayoutError(f"generation GPUs {gen_gpus} are not a multiple of one engine's tp*pp*dp={per_engine}")
    ep = int(vcfg.get("expert_parallel_size", 1))
    if ep > 1 and ep != vtp * vdp:
        raise LayoutError(f"policy.generation.vllm_cfg.expert_parallel_size={ep}: vLLM's expert parallelism spans "
                          f"data_parallel_size*tensor_parallel_size={vdp * vtp} ranks")
    vllm = VllmParallel(
        tp=vtp, pp=vpp, dp=vdp, replicas=gen_gpus // per_engine, enable_ep=ep > 1,
        num_redundant_experts=int(vcfg.get("num_redundant_experts", 0)),
    )
    return RecipeLayout(spec, training, vllm, refit)
