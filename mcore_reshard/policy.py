"""Turning mcore-reshard on from an RL framework's policy config (NeMo RL shape).

``policy.megatron_cfg.mcore_reshard.enabled: true`` selects the shard-to-shard refit; the
parallel sizes come from the config the recipe already has, so nothing is said twice.
Every bad setting raises :class:`~mcore_reshard.errors.ConfigError` naming the recipe key.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping

from .adapters.megatron.rules import MegatronParallel
from .adapters.vllm.rules import VllmParallel
from .errors import ConfigError
from .layout import DTYPE_BYTES, ModelSpec
from .protocol import VerifyMode

__all__ = [
    "RefitConfig",
    "RecipeLayout",
    "from_policy_config",
    "TRANSPORTS",
    "VERIFY",
    "APPLY",
    "MIN_BUFFER_BYTES",
    "MAX_BUFFER_BYTES",
]

TRANSPORTS = ("reshard", "hf_broadcast")
VERIFY = tuple(m.value for m in VerifyMode)
#: auto: vLLM's layerwise reload wherever the kernel repacks weights, in-place writes where it
#: keeps model format; direct: also switch CPU dense linears to plain F.linear (model format).
APPLY = ("auto", "direct")
#: ``refit.placement``: trainers and engines on separate devices, or one of each per device.
PLACEMENTS = ("separate", "colocated")

#: Floor of ``refit.buffer_bytes`` (64 KiB; a bucket is half, 32 KiB). The planner cuts every
#: tensor into pieces of at most one bucket and the transport sends one message per piece, so
#: the plan's size and the number of messages grow as (model bytes / bucket): 4 bytes made a
#: plan of Qwen3-30B-A3B grow past 6 GiB of memory, 1 byte cannot hold a single bf16 element.
#: 32 KiB buckets still hold a whole row of every tensor of the models in configs/models
#: (hidden <= 16384 bf16 elements) and keep per-message costs (a gloo/NCCL send, a header,
#: a checksum) small against the bytes; the end-to-end tests run at exactly this floor.
MIN_BUFFER_BYTES = 1 << 16
#: Ceiling of ``refit.buffer_bytes`` (1 TiB). Byte counts travel in the JSON control messages
#: (``protocol``) and JSON readers that decode numbers as doubles are exact only below 2**53;
#: 2**40 is far inside that, far above any accelerator's memory, and sums of per-bucket byte
#: counts over thousands of ranks stay exact. Anything larger is a typo (``10**21``).
MAX_BUFFER_BYTES = 1 << 40


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True)
class RefitConfig:
    """How a refit runs (``refit.*`` in the CLI configs, ``megatron_cfg.mcore_reshard`` in recipes).

    Every field is checked on construction (a wrong value raises ``ConfigError`` naming
    ``refit.<field>``); ``verify`` accepts the strings ``off | checksum | full`` and is
    stored as a :class:`~mcore_reshard.protocol.VerifyMode`.
    """

    enabled: bool = True
    transport: str = "reshard"
    #: The most extra memory a rank spends on wire buffers. Two buckets are in flight (one on
    #: the wire while the next is packed or the last is applied), so a bucket is half of it.
    #: ``MIN_BUFFER_BYTES <= buffer_bytes <= MAX_BUFFER_BYTES``.
    buffer_bytes: int = 1 << 30
    verify: VerifyMode = VerifyMode.CHECKSUM
    timeout_s: float = 300.0
    apply_mode: str = "auto"
    allow_cast: bool = False
    #: All workers of an engine stage the new weights and commit together, or none does
    #: (false: streaming mode, each worker writes its buckets into live weights as they arrive;
    #: a failed refit then leaves the engine marked not serving).
    atomic: bool = True
    #: Where the local job puts both sides: ``separate`` (no placement: direct plans) or
    #: ``colocated`` (training rank i and vLLM worker i share device i on one node: the plan
    #: prefers same-device senders, whose bytes then move through shared memory).
    placement: str = "separate"

    @property
    def bucket_bytes(self) -> int:
        """The plan's per-round budget: each rank sends and receives at most this per bucket."""
        return max(1, self.buffer_bytes // 2)

    def __post_init__(self) -> None:
        for name in ("enabled", "allow_cast", "atomic"):
            value = getattr(self, name)
            if not isinstance(value, bool):
                raise ConfigError(f"refit.{name}={value!r} is not a boolean (true or false)")
        for name, allowed in (("transport", TRANSPORTS), ("apply_mode", APPLY), ("placement", PLACEMENTS)):
            value = getattr(self, name)
            if not isinstance(value, str) or value not in allowed:
                raise ConfigError(f"refit.{name}={value!r} is not one of {list(allowed)}")
        object.__setattr__(self, "verify", VerifyMode.parse(self.verify, "refit.verify"))
        b = self.buffer_bytes
        if not _is_int(b):
            raise ConfigError(f"refit.buffer_bytes={b!r} is not an integer (bytes)")
        if b < MIN_BUFFER_BYTES:
            raise ConfigError(
                f"refit.buffer_bytes={b} is below the floor of {MIN_BUFFER_BYTES} (64 KiB): smaller buckets "
                f"cut every tensor into a flood of tiny messages"
            )
        if b > MAX_BUFFER_BYTES:
            raise ConfigError(f"refit.buffer_bytes={b} is above the ceiling of {MAX_BUFFER_BYTES} (1 TiB)")
        t = self.timeout_s
        if not (isinstance(t, (int, float)) and not isinstance(t, bool)):
            raise ConfigError(f"refit.timeout_s={t!r} is not a number (seconds)")
        if not (math.isfinite(t) and t > 0):
            raise ConfigError(f"refit.timeout_s={t!r} must be a positive, finite number of seconds")
        object.__setattr__(self, "timeout_s", float(t))


@dataclass(frozen=True)
class RecipeLayout:
    spec: ModelSpec
    training: MegatronParallel
    vllm: VllmParallel
    refit: RefitConfig
    #: The engine's model when it is configured apart from the trainer's (must match it).
    vllm_spec: ModelSpec | None = None
    #: How the modelled cluster places both sides (``plan.topology.TopologyConfig``).
    topology: Any = None


_MISSING = object()


def _get(cfg: Any, path: str, default: Any = _MISSING) -> Any:
    """``cfg[a][b]...`` for ``path = "a.b..."``; a missing key (or a null on the way) gives
    ``default``, or a ``ConfigError`` naming the key when there is none."""
    node: Any = cfg
    seen = []
    for key in path.split("."):
        if node is not None and not isinstance(node, Mapping):
            raise ConfigError(f"recipe: {'.'.join(seen)} is a {type(node).__name__}, not a mapping")
        seen.append(key)
        if node is None or key not in node or node[key] is None:
            if default is _MISSING:
                raise ConfigError(f"recipe: {path} is missing")
            return default
        node = node[key]
    return node


def _typed(cfg: Any, path: str, tp: Any, default: Any = _MISSING, minimum: int | None = None) -> Any:
    from .config import check_type

    value = check_type(path, _get(cfg, path, default), tp)
    if minimum is not None and value is not None and value < minimum:
        raise ConfigError(f"{path}={value} must be >= {minimum}")
    return value


def from_policy_config(cfg: Mapping[str, Any]) -> RecipeLayout:
    """Map a NeMo-RL-shaped GRPO config onto training / vLLM layouts and a refit config."""
    from .config import TINY_MODELS, _tiny_spec, build_dataclass, resolve_model

    if not isinstance(cfg, Mapping):
        raise ConfigError(f"recipe: the top level is a {type(cfg).__name__}, not a mapping (policy:, cluster:, ...)")
    _get(cfg, "policy")
    mcfg = _get(cfg, "policy.megatron_cfg")
    if not isinstance(mcfg, Mapping):
        raise ConfigError(f"recipe: policy.megatron_cfg is a {type(mcfg).__name__}, not a mapping")
    if not _typed(cfg, "policy.megatron_cfg.enabled", bool, False):
        raise ConfigError("policy.megatron_cfg.enabled must be true to refit from Megatron-Core")
    rcfg = _get(cfg, "policy.megatron_cfg.mcore_reshard", {})
    if not isinstance(rcfg, Mapping):
        raise ConfigError(f"recipe: policy.megatron_cfg.mcore_reshard is a {type(rcfg).__name__}, not a mapping")
    if not _typed(cfg, "policy.megatron_cfg.mcore_reshard.enabled", bool, False):
        raise ConfigError("policy.megatron_cfg.mcore_reshard.enabled is not true: mcore-reshard is off in this recipe")
    try:
        refit = build_dataclass(RefitConfig, dict(rcfg), "policy.megatron_cfg.mcore_reshard")
    except ConfigError as exc:
        msg = str(exc)
        if msg.startswith("refit."):
            msg = "policy.megatron_cfg.mcore_reshard." + msg[len("refit."):]
        raise ConfigError(msg) from None

    if _get(cfg, "policy.model_config", None) is not None:
        model_key = "policy.model_config"
    elif _get(cfg, "policy.model_name", None) is not None:
        model_key = "policy.model_name"
    else:
        raise ConfigError("recipe: policy.model_config is missing (a name under configs/models/, a HF config "
                          "path or a built-in tiny model such as tiny-moe), and so is policy.model_name")
    model_ref = _typed(cfg, model_key, str)
    precision = _typed(cfg, "policy.precision", str, "bfloat16")
    if precision not in DTYPE_BYTES:
        raise ConfigError(f"policy.precision={precision!r} is not one of {sorted(DTYPE_BYTES)}")
    if model_ref in TINY_MODELS:  # a built-in random-weight model of the local jobs ("tiny-moe")
        spec = _tiny_spec(model_ref, precision)
    else:
        spec = resolve_model(model_ref, dtype=precision, what=model_key)

    gpn = _typed(cfg, "cluster.gpus_per_node", int, minimum=1)
    nodes = _typed(cfg, "cluster.num_nodes", int, minimum=1)
    gpus = gpn * nodes
    backend = _typed(cfg, "policy.generation.backend", str, "vllm")
    if backend != "vllm":
        raise ConfigError(f"policy.generation.backend={backend!r}: mcore-reshard refits into vLLM")
    colocated = _typed(cfg, "policy.generation.colocated.enabled", bool, True)
    if colocated:
        # NeMo RL's colocated mode: training and generation share every GPU of the cluster.
        train_world = gen_gpus = gpus
    else:
        gen_gpn = _typed(cfg, "policy.generation.colocated.resources.gpus_per_node", int, minimum=1)
        gen_nodes = _typed(cfg, "policy.generation.colocated.resources.num_nodes", int, minimum=1)
        if gen_gpn > gpn:
            raise ConfigError(f"policy.generation.colocated.resources.gpus_per_node={gen_gpn} contradicts "
                              f"cluster.gpus_per_node={gpn}")
        gen_gpus = gen_gpn * gen_nodes
        train_world = gpus - gen_gpus
        if train_world <= 0:
            raise ConfigError(f"policy.generation.colocated.resources ({gen_gpus} GPUs) leave no training GPUs of "
                              f"cluster.num_nodes*cluster.gpus_per_node={gpus}")

    m = "policy.megatron_cfg."
    tp = _typed(cfg, m + "tensor_model_parallel_size", int, 1, minimum=1)
    pp = _typed(cfg, m + "pipeline_model_parallel_size", int, 1, minimum=1)
    cp = _typed(cfg, m + "context_parallel_size", int, 1, minimum=1)
    if train_world % (tp * pp * cp):
        raise ConfigError(
            f"training world {train_world} (cluster minus generation GPUs) is not a multiple of "
            f"{m}tensor_model_parallel_size*pipeline_model_parallel_size*context_parallel_size={tp * pp * cp}"
        )
    impl = _typed(cfg, m + "transformer_impl", str, "transformer_engine")
    if impl not in ("transformer_engine", "local"):
        raise ConfigError(f"{m}transformer_impl={impl!r} is not 'transformer_engine' or 'local'")
    training = MegatronParallel(
        tp=tp, pp=pp, cp=cp, dp=train_world // (tp * pp * cp),
        ep=_typed(cfg, m + "expert_model_parallel_size", int, 1, minimum=1),
        etp=_typed(cfg, m + "expert_tensor_parallel_size", int | None, None, minimum=1),
        vpp=_typed(cfg, m + "virtual_pipeline_model_parallel_size", int | None, None, minimum=1) or 1,
        first_stage_layers=_typed(cfg, m + "num_layers_in_first_pipeline_stage", int | None, None, minimum=0),
        last_stage_layers=_typed(cfg, m + "num_layers_in_last_pipeline_stage", int | None, None, minimum=0),
        make_vocab_size_divisible_by=_typed(cfg, m + "make_vocab_size_divisible_by", int, 128, minimum=1),
        layer_spec="te" if impl == "transformer_engine" else "local",
        experts="grouped" if _typed(cfg, m + "moe_grouped_gemm", bool, False) else "sequential",
        sequence_parallel=_typed(cfg, m + "sequence_parallel", bool, False),
    )
    v = "policy.generation.vllm_cfg."
    vtp = _typed(cfg, v + "tensor_parallel_size", int, 1, minimum=1)
    vpp = _typed(cfg, v + "pipeline_parallel_size", int, 1, minimum=1)
    vdp = _typed(cfg, v + "data_parallel_size", int, 1, minimum=1)
    per_engine = vtp * vpp * vdp
    if gen_gpus % per_engine:
        raise ConfigError(f"generation GPUs {gen_gpus} (policy.generation.colocated.resources) are not a multiple "
                          f"of one engine's {v}tensor*pipeline*data_parallel_size={per_engine}")
    ep = _typed(cfg, v + "expert_parallel_size", int, 1, minimum=1)
    if ep > 1 and ep != vtp * vdp:
        raise ConfigError(f"{v}expert_parallel_size={ep}: vLLM's expert parallelism spans "
                          f"data_parallel_size*tensor_parallel_size={vdp * vtp} ranks")
    vllm = VllmParallel(
        tp=vtp, pp=vpp, dp=vdp, replicas=gen_gpus // per_engine, enable_ep=ep > 1,
        num_redundant_experts=_typed(cfg, v + "num_redundant_experts", int, 0, minimum=0),
    )
    from .plan.topology import TopologyConfig

    # Non-colocated NeMo RL: training fills its nodes, generation the nodes after them;
    # colocated: training rank i and inference rank i share GPU i.
    topology = TopologyConfig(gpus_per_node=gpn, placement="colocated" if colocated else "separate")
    return RecipeLayout(spec, training, vllm, refit, topology=topology)

