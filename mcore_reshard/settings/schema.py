"""Every setting the library takes, declared once: the section dataclasses and, for each
source, the dotted keys and sections the reader reads from it.

* :data:`PLAN_CONFIG` / :data:`REFIT_CONFIG`: ``configs/plan.yaml`` / ``configs/refit.yaml``;
* :data:`RECIPE`: a GRPO recipe in NeMo RL's shape (``policy.megatron_cfg.mcore_reshard``
  selects the refit, the parallel sizes are the recipe's own, so nothing is said twice).

:data:`KNOWN_KEYS` -- what a recipe override may set though the file lacks it -- is what
:data:`RECIPE` reads, so the two cannot drift apart.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from ..adapters.megatron.rules import MegatronParallel
from ..adapters.vllm.rules import QUANTIZATIONS, VllmParallel
from ..errors import ConfigError
from ..layout import DTYPE_BYTES, ModelSpec
from ..layout.lora import PeftConfig
from ..wire.protocol import DELTA_MODES, VerifyMode
from .topology import TopologyConfig
from .models import LOCAL_DTYPES
from .reader import REQUIRED, Field, Section, keys

__all__ = [
    "RefitConfig", "RecipeLayout", "TRANSPORTS", "VERIFY", "APPLY", "PLACEMENTS", "MIN_BUFFER_BYTES",
    "MAX_BUFFER_BYTES", "GrpoSettings", "AsyncGrpoSettings", "LossSettings", "GenerationSettings", "TaskSettings",
    "ColourTaskSettings",
    "ClusterSettings", "RaySettings", "PlanConfigKeys", "RefitConfigKeys", "RecipeKeys", "PLAN_CONFIG", "REFIT_CONFIG", "RECIPE",
    "KNOWN_KEYS",
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


def _check(ok: bool, msg: str) -> None:
    if not ok:
        raise ConfigError(msg)


@dataclass(frozen=True)
class RefitConfig:
    """How a refit runs (``refit.*`` in the CLI configs, ``megatron_cfg.mcore_reshard`` in recipes).

    Every field is checked on construction (a wrong value raises ``ConfigError`` naming
    ``refit.<field>``); ``verify`` accepts the strings ``off | checksum | full`` and is
    stored as a :class:`~mcore_reshard.wire.protocol.VerifyMode`.
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
    #: Refit while generating: each vLLM worker receives into shadow weights on a background
    #: thread while the engine keeps decoding, and the driver swaps them in between two model
    #: steps after every rank voted (the engine pauses only for the swap). Needs ``atomic``
    #: and the ``reshard`` transport.
    overlap: bool = False
    #: The most bytes of shadow weights an overlapped refit may hold on one vLLM worker beside
    #: its live weights (about what the worker receives); 0: no cap. An overlapped refit over
    #: the cap is refused before any byte moves.
    max_shadow_bytes: int = 0
    #: Delta refits: ``auto`` sends only the elements that changed since the last committed
    #: refit whenever every rank holds it (the first refit, and any after a failure, a new
    #: process or a new plan, are full); ``off`` always sends whole boxes and keeps no copies.
    delta: str = "auto"
    #: The most bytes one rank keeps between refits for deltas (a training rank: a wire-dtype
    #: copy of what it sends; a vLLM worker: a model-format copy of the layers vLLM repacks);
    #: 0: no limit. A rank over it keeps nothing, and refits stay full (the report says so).
    delta_state_limit_bytes: int = 0
    #: After new weights go live, requests running across the swap: true drops their KV and
    #: recomputes it with the new weights (vLLM's prefix-cache reset with running requests
    #: preempted); false keeps it (faster; tokens after the swap then attend to old-weight
    #: KV), and the prefix cache is reset only where no request holds blocks (the refit's
    #: notes say when it could not be). NeMo RL's key of the same name.
    recompute_kv_cache_after_weight_updates: bool = False
    #: Where the local job puts both sides: ``separate`` (no placement: direct plans) or
    #: ``colocated`` (training rank i and vLLM worker i share device i on one node: the plan
    #: prefers same-device senders, whose bytes then move through shared memory).
    placement: str = "separate"
    #: The canary vote (``docs/canary.md``): before an engine serves new weights, every engine
    #: computes the logprobs of a few fixed token sequences on them and votes no when they
    #: differ from the trainers' (under the policy just sent) beyond ``canary_bound``.
    #: Checksums prove the bytes; this proves what the engine computes.
    canary: bool = False
    #: Its bound on ``token_mult_prob_error``; 0: the precision's (fp32 1.001, bf16 1.05).
    canary_bound: float = 0.0
    #: How many canary sequences, and how many tokens each.
    canary_sequences: int = 2
    canary_tokens: int = 16

    @property
    def bucket_bytes(self) -> int:
        """The plan's per-round budget: each rank sends and receives at most this per bucket."""
        return max(1, self.buffer_bytes // 2)

    def __post_init__(self) -> None:
        for name in ("enabled", "allow_cast", "atomic", "overlap", "recompute_kv_cache_after_weight_updates", "canary"):
            value = getattr(self, name)
            _check(isinstance(value, bool), f"refit.{name}={value!r} is not a boolean (true or false)")
        for name, allowed in (("transport", TRANSPORTS), ("apply_mode", APPLY), ("placement", PLACEMENTS),
                              ("delta", DELTA_MODES)):
            value = getattr(self, name)
            _check(isinstance(value, str) and value in allowed, f"refit.{name}={value!r} is not one of {list(allowed)}")
        object.__setattr__(self, "verify", VerifyMode.parse(self.verify, "refit.verify"))
        b = self.canary_bound
        _check(isinstance(b, (int, float)) and not isinstance(b, bool) and (b == 0 or b > 1.0),
               f"refit.canary_bound={b!r} must be 0 (the precision's bound) or a token_mult_prob_error above 1.0")
        for name, least in (("canary_sequences", 1), ("canary_tokens", 2)):
            value = getattr(self, name)
            _check(isinstance(value, int) and not isinstance(value, bool) and value >= least,
                   f"refit.{name}={value!r} must be an integer >= {least}")
        if self.canary:
            _check(self.transport == "reshard", f"refit.canary=true needs refit.transport=reshard (the "
                                                f"{self.transport} baseline has no vote to put it in)")
        if self.overlap:
            _check(self.atomic, "refit.overlap=true needs refit.atomic=true: a streaming refit writes live weights "
                                "as buckets arrive, which the steps generating meanwhile would read")
            _check(self.transport == "reshard", f"refit.overlap=true needs refit.transport=reshard "
                                                f"(the {self.transport} baseline blocks the engine)")
        for name in ("max_shadow_bytes", "delta_state_limit_bytes"):
            cap = getattr(self, name)
            _check(isinstance(cap, int) and not isinstance(cap, bool) and cap >= 0,
                   f"refit.{name}={cap!r} is not a non-negative integer (bytes; 0: no cap)")
        b = self.buffer_bytes
        _check(isinstance(b, int) and not isinstance(b, bool), f"refit.buffer_bytes={b!r} is not an integer (bytes)")
        _check(b >= MIN_BUFFER_BYTES, f"refit.buffer_bytes={b} is below the floor of {MIN_BUFFER_BYTES} (64 KiB): "
                                      f"smaller buckets cut every tensor into a flood of tiny messages")
        _check(b <= MAX_BUFFER_BYTES, f"refit.buffer_bytes={b} is above the ceiling of {MAX_BUFFER_BYTES} (1 TiB)")
        t = self.timeout_s
        _check(isinstance(t, (int, float)) and not isinstance(t, bool),
               f"refit.timeout_s={t!r} is not a number (seconds)")
        _check(math.isfinite(t) and t > 0, f"refit.timeout_s={t!r} must be a positive, finite number of seconds")
        object.__setattr__(self, "timeout_s", float(t))


@dataclass(frozen=True)
class RecipeLayout:
    """What a plan needs: the model, both sides' sizes, the refit and where the ranks sit."""

    spec: ModelSpec
    #: megatron-core's sizes, or a DTensor policy's mesh (``adapters.dtensor.DTensorParallel``)
    training: Any
    vllm: VllmParallel
    refit: RefitConfig
    #: The engine's model when it is configured apart from the trainer's (must match it).
    vllm_spec: ModelSpec | None = None
    #: How the modelled cluster places both sides (``settings.topology.TopologyConfig``).
    topology: Any = None
    #: A LoRA policy (``policy.megatron_cfg.peft``): after the first refit only its adapters move.
    peft: PeftConfig | None = None
    #: The engines' speculative decoding (``vllm.speculative_config``): their MTP draft refits too.
    speculative: Any = None


# --------------------------------------------------------------------------- GRPO sections


@dataclass(frozen=True)
class GrpoSettings:
    """``grpo:``: how many samples a step draws and how many steps run."""

    num_prompts_per_step: int
    #: >= 2: advantages are normalised within each prompt's group of samples.
    num_generations_per_prompt: int
    max_num_steps: int
    seed: int = 0
    normalize_rewards: bool = True
    use_leave_one_out_baseline: bool = False
    #: 0: never; N: every N-th step's refit runs with verify=full (a bitwise check of every tensor).
    verify_full_every_n_steps: int = 0

    def __post_init__(self) -> None:
        _check(self.num_prompts_per_step >= 1, f"grpo.num_prompts_per_step={self.num_prompts_per_step} must be >= 1")
        _check(self.num_generations_per_prompt >= 2,
               f"grpo.num_generations_per_prompt={self.num_generations_per_prompt} must be >= 2: group-normalised "
               f"advantages compare the samples of one prompt")
        _check(self.max_num_steps >= 1, f"grpo.max_num_steps={self.max_num_steps} must be >= 1")
        _check(0 <= self.seed < 2**63, f"grpo.seed={self.seed} must be in [0, 2**63)")
        _check(self.verify_full_every_n_steps >= 0,
               f"grpo.verify_full_every_n_steps={self.verify_full_every_n_steps} must be >= 0 (0: never)")

    @property
    def samples_per_step(self) -> int:
        return self.num_prompts_per_step * self.num_generations_per_prompt


@dataclass(frozen=True)
class AsyncGrpoSettings:
    """``grpo.async_grpo``: NeMo RL's asynchronous GRPO. Generation for the next steps runs
    while a step trains and refits; a trajectory is trained on only while its oldest token
    is at most ``max_trajectory_age_steps`` policy versions old."""

    enabled: bool = False
    #: >= 1: a batch whose oldest token came from policy version v trains at step <= v + this.
    max_trajectory_age_steps: int = 1
    #: true: refit while the next steps' requests run (their tokens then span two versions);
    #: false: a refit waits until every running request finished.
    in_flight_weight_updates: bool = False
    #: Requests running across a swap recompute their KV with the new weights (else keep it).
    recompute_kv_cache_after_weight_updates: bool = False

    def __post_init__(self) -> None:
        for name in ("enabled", "in_flight_weight_updates", "recompute_kv_cache_after_weight_updates"):
            value = getattr(self, name)
            _check(isinstance(value, bool), f"grpo.async_grpo.{name}={value!r} is not a boolean (true or false)")
        age = self.max_trajectory_age_steps
        _check(isinstance(age, int) and not isinstance(age, bool) and age >= 1,
               f"grpo.async_grpo.max_trajectory_age_steps={age!r} must be an integer >= 1 (0 would train only on "
               f"samples of the current version: that is synchronous GRPO, grpo.async_grpo.enabled=false)")


@dataclass(frozen=True)
class LossSettings:
    """``loss_fn:``: NeMo RL's clipped-ratio policy loss with an optional KL to the reference."""

    reference_policy_kl_penalty: float = 0.0
    ratio_clip_min: float = 0.2
    ratio_clip_max: float = 0.2
    #: Weight each token's loss by pi_prev / pi_gen (the trainer's logprob before the step over
    #: the engine's): the samples of an older policy version then estimate the current one's
    #: loss. Async GRPO requires it.
    use_importance_sampling_correction: bool = False
    #: Truncated importance sampling (NeMo RL's key): each weight is capped at this (None: not
    #: capped), so a token the behaviour policy rarely sampled cannot dominate the step.
    truncated_importance_sampling_ratio: float | None = None

    def __post_init__(self) -> None:
        c = self.truncated_importance_sampling_ratio
        _check(c is None or (math.isfinite(c) and c > 0),
               f"loss_fn.truncated_importance_sampling_ratio={c!r} must be a positive, finite number or null")
        _check(c is None or self.use_importance_sampling_correction,
               f"loss_fn.truncated_importance_sampling_ratio={c!r} needs loss_fn.use_importance_sampling_correction=true")
        _check(isinstance(self.use_importance_sampling_correction, bool),
               f"loss_fn.use_importance_sampling_correction={self.use_importance_sampling_correction!r} is not a "
               f"boolean (true or false)")
        k = self.reference_policy_kl_penalty
        _check(math.isfinite(k) and k >= 0, f"loss_fn.reference_policy_kl_penalty={k!r} must be a finite number >= 0")
        for name in ("ratio_clip_min", "ratio_clip_max"):
            v = getattr(self, name)
            _check(math.isfinite(v) and v >= 0, f"loss_fn.{name}={v!r} must be a finite number >= 0")
        _check(self.ratio_clip_min < 1,
               f"loss_fn.ratio_clip_min={self.ratio_clip_min!r} must be < 1 (the ratio is clipped at 1 - it)")


@dataclass(frozen=True)
class GenerationSettings:
    """``policy.generation`` sampling (``vllm_cfg`` / ``colocated`` are the layout's)."""

    max_new_tokens: int
    temperature: float = 1.0

    def __post_init__(self) -> None:
        _check(self.max_new_tokens >= 1, f"policy.generation.max_new_tokens={self.max_new_tokens} must be >= 1")
        t = self.temperature
        _check(math.isfinite(t) and t > 0, f"policy.generation.temperature={t!r} must be a positive, finite number")


@dataclass(frozen=True)
class ColourTaskSettings:
    """``env.colour_squares``: the built-in task with images (a vision-language policy): a prompt
    is ``prompt_length`` random text ids and one image placeholder, its image one coloured
    square (red, green or blue); the reward is the fraction of generated ids in the colour's
    class (``id % 3``). Only a policy that reads the image learns it."""

    prompt_length: int = 4

    def __post_init__(self) -> None:
        _check(self.prompt_length >= 1, f"env.colour_squares.prompt_length={self.prompt_length} must be >= 1")


@dataclass(frozen=True)
class TaskSettings:
    """``env.target_tokens``: the built-in verifiable task. A prompt is ``prompt_length`` random
    token ids; the reward is the fraction of generated ids below ``round(vocab * target_fraction)``
    (learnable from any start, checkable without a tokenizer or a data set)."""

    prompt_length: int = 8
    target_fraction: float = 0.125

    def __post_init__(self) -> None:
        _check(self.prompt_length >= 1, f"env.target_tokens.prompt_length={self.prompt_length} must be >= 1")
        f = self.target_fraction
        _check(math.isfinite(f) and 0 < f < 1, f"env.target_tokens.target_fraction={f!r} must be in (0, 1)")

    def target_ids(self, vocab: int) -> int:
        """Token ids ``0 <= t < target_ids(vocab)`` are rewarded."""
        return round(vocab * self.target_fraction)


@dataclass(frozen=True)
class ClusterSettings:
    """``cluster:``: nodes x device slots (GPUs; CPU slots for a local run)."""

    num_nodes: int
    gpus_per_node: int

    @property
    def slots(self) -> int:
        return self.num_nodes * self.gpus_per_node


@dataclass(frozen=True)
class RaySettings:
    """``ray:`` (ours, not NeMo RL's): where the Ray cluster comes from."""

    #: None: start an embedded local cluster; "auto" or "host:port": join a running one.
    address: str | None = None
    #: Embedded cluster only: logical CPUs (None: enough for the job).
    num_cpus: int | None = None

    def __post_init__(self) -> None:
        _check(self.address is None or bool(self.address.strip()),
               "ray.address='' is empty: null starts a local cluster, 'auto' or 'host:port' joins one")
        _check(self.num_cpus is None or self.num_cpus >= 1, f"ray.num_cpus={self.num_cpus} must be >= 1")
        _check(self.num_cpus is None or self.address is None,
               f"ray.num_cpus={self.num_cpus} contradicts ray.address={self.address!r}: num_cpus sizes an embedded "
               f"cluster only")


# --------------------------------------------------------------------------- the CLI's Hydra configs

_TRAINING = Section("training", MegatronParallel,
                    minimum=dict(tp=1, pp=1, ep=1, etp=1, cp=1, dp=1, vpp=1, first_stage_layers=0, last_stage_layers=0,
                                 make_vocab_size_divisible_by=1, vocab_padded=1),
                    choices=dict(layer_spec=("local", "te"), experts=("sequential", "grouped")))
_VLLM = Section("vllm", VllmParallel, minimum=dict(tp=1, pp=1, dp=1, replicas=1, num_redundant_experts=0),
                choices=dict(expert_placement=("linear", "round_robin"), quantization=QUANTIZATIONS,
                             mm_encoder_tp_mode=("weights", "data")),
                sub=("speculative_config",))


@dataclass(frozen=True)
class SpeculativeConfig:
    """``vllm.speculative_config`` as vLLM spells it: the engine drafts with the model's MTP
    layers (``method: mtp``; vLLM's older ``deepseek_mtp`` is the same), which then refit in the
    same refit and vote as the target. None: no draft."""

    method: str | None = None
    num_speculative_tokens: int = 1

    def __post_init__(self) -> None:
        _check(self.method in (None, "mtp", "deepseek_mtp"),
               f"vllm.speculative_config.method={self.method!r}: the draft refit knows 'mtp' (or 'deepseek_mtp'): "
               f"a model's own MTP layers")
        _check(self.num_speculative_tokens >= 1,
               f"vllm.speculative_config.num_speculative_tokens={self.num_speculative_tokens} must be >= 1")

    def to_vllm(self) -> dict[str, Any]:
        """vLLM's ``speculative_config`` argument."""
        return {"method": self.method, "num_speculative_tokens": self.num_speculative_tokens}


@dataclass(frozen=True)
class PlanConfigKeys:
    """``configs/plan.yaml`` (``mcore-reshard plan``)."""

    model: Field = Field("model", str)  # a name under configs/models/ or a HF config path
    vllm_model: Field = Field("vllm_model", str | None)
    dtype: Field = Field("dtype", str | None, choices=tuple(sorted(DTYPE_BYTES)))
    training: Section = _TRAINING
    vllm: Section = _VLLM
    refit: Section = Section("refit", RefitConfig)
    topology: Section = Section("topology", TopologyConfig)
    peft: Section = Section("peft", PeftConfig)
    speculative: Section = Section("vllm.speculative_config", SpeculativeConfig, required=False)


@dataclass(frozen=True)
class RefitConfigKeys:
    """``configs/refit.yaml`` (``mcore-reshard refit``)."""

    model: Field = Field("model", str)  # a TINY_MODELS key or a HF checkpoint directory
    dtype: Field = Field("dtype", str, choices=LOCAL_DTYPES)
    seed: Field = Field("seed", int)
    training: Section = _TRAINING
    vllm: Section = _VLLM
    refit: Section = Section("refit", RefitConfig)
    steps: Field = Field("job.steps", int)
    lr: Field = Field("job.lr", float)
    tokens: Field = Field("job.tokens", tuple[int, ...])
    compare_hf: Field = Field("job.compare_hf", bool)
    workdir: Field = Field("job.workdir", str | None)
    async_engine: Field = Field("job.async_engine", bool)
    speculative: Section = Section("vllm.speculative_config", SpeculativeConfig, required=False)


# --------------------------------------------------------------------------- recipes (NeMo RL shape)

_M = "policy.megatron_cfg."
_D = "policy.dtensor_cfg."
_V = "policy.generation.vllm_cfg."
_G = "policy.generation."
_R = "policy.generation.colocated.resources."


@dataclass(frozen=True)
class RecipeKeys:
    """A GRPO recipe: what ``policy.from_policy_config`` maps onto both layouts and the refit,
    and the sections only the GRPO loop reads (``grpo.recipe.load_grpo_recipe``)."""

    megatron_enabled: Field = Field(_M + "enabled", bool, False)
    refit_enabled: Field = Field(_M + "mcore_reshard.enabled", bool, False)
    refit: Section = Section(_M + "mcore_reshard", RefitConfig, required=False, names="refit")
    peft: Section = Section(_M + "peft", PeftConfig, required=False, names="peft")
    speculative: Section = Section(_V + "speculative_config", SpeculativeConfig, required=False,
                                   names="vllm.speculative_config")
    # NeMo RL's other policy backend: an HF model under FSDP2 (+ TP), ``policy.dtensor_cfg``
    dtensor_enabled: Field = Field(_D + "enabled", bool, False)
    dtensor_refit_enabled: Field = Field(_D + "mcore_reshard.enabled", bool, False)
    dtensor_refit: Section = Section(_D + "mcore_reshard", RefitConfig, required=False, names="refit")
    dtensor_tp: Field = Field(_D + "tensor_parallel_size", int, 1, minimum=1)
    dtensor_cp: Field = Field(_D + "context_parallel_size", int, 1, minimum=1)
    dtensor_sp: Field = Field(_D + "sequence_parallel", bool, False)
    dtensor_lr: Field = Field("policy.optimizer.kwargs.lr", float, REQUIRED)
    model_config: Field = Field("policy.model_config", str, REQUIRED)
    model_name: Field = Field("policy.model_name", str, REQUIRED)
    precision: Field = Field("policy.precision", str, "bfloat16", choices=tuple(sorted(DTYPE_BYTES)))
    gpus_per_node: Field = Field("cluster.gpus_per_node", int, REQUIRED, minimum=1)
    num_nodes: Field = Field("cluster.num_nodes", int, REQUIRED, minimum=1)
    backend: Field = Field(_G + "backend", str, "vllm")
    colocated: Field = Field(_G + "colocated.enabled", bool, True)
    generation_gpus_per_node: Field = Field(_R + "gpus_per_node", int, REQUIRED, minimum=1)
    generation_num_nodes: Field = Field(_R + "num_nodes", int, REQUIRED, minimum=1)
    # training: megatron-core's sizes
    tp: Field = Field(_M + "tensor_model_parallel_size", int, 1, minimum=1)
    pp: Field = Field(_M + "pipeline_model_parallel_size", int, 1, minimum=1)
    cp: Field = Field(_M + "context_parallel_size", int, 1, minimum=1)
    transformer_impl: Field = Field(_M + "transformer_impl", str, "transformer_engine")
    ep: Field = Field(_M + "expert_model_parallel_size", int, 1, minimum=1)
    etp: Field = Field(_M + "expert_tensor_parallel_size", int | None, None, minimum=1)
    vpp: Field = Field(_M + "virtual_pipeline_model_parallel_size", int | None, None, minimum=1)
    first_stage_layers: Field = Field(_M + "num_layers_in_first_pipeline_stage", int | None, None, minimum=0)
    last_stage_layers: Field = Field(_M + "num_layers_in_last_pipeline_stage", int | None, None, minimum=0)
    make_vocab_size_divisible_by: Field = Field(_M + "make_vocab_size_divisible_by", int, 128, minimum=1)
    moe_grouped_gemm: Field = Field(_M + "moe_grouped_gemm", bool, False)
    sequence_parallel: Field = Field(_M + "sequence_parallel", bool, False)
    #: Megatron-FSDP (NeMo RL's key; megatron-core calls it ``use_megatron_fsdp`` now): parameters,
    #: gradients and optimizer states sharded over data parallelism; each rank refits its rows.
    use_custom_fsdp: Field = Field(_M + "use_custom_fsdp", bool, False)
    # generation: one vLLM engine's sizes
    vllm_tp: Field = Field(_V + "tensor_parallel_size", int, 1, minimum=1)
    vllm_pp: Field = Field(_V + "pipeline_parallel_size", int, 1, minimum=1)
    vllm_dp: Field = Field(_V + "data_parallel_size", int, 1, minimum=1)
    vllm_ep: Field = Field(_V + "expert_parallel_size", int, 1, minimum=1)
    num_redundant_experts: Field = Field(_V + "num_redundant_experts", int, 0, minimum=0)
    #: vLLM's ``mm_encoder_tp_mode``: a vision tower sharded over TP ("weights") or whole on
    #: every rank ("data", where the model supports it).
    mm_encoder_tp_mode: Field = Field(_V + "mm_encoder_tp_mode", str, "weights", choices=("weights", "data"))
    #: NeMo RL's generation precision: ``fp8`` runs the engine in block FP8 (vLLM's
    #: ``fp8_per_block``, the router kept in the model dtype), quantized at the sender.
    vllm_precision: Field = Field(_V + "precision", str | None, None, choices=("bfloat16", "float16", "float32", "fp8"))
    #: The engine is vLLM's ``AsyncLLM`` in an async actor (generation and refit calls at once).
    async_engine: Field = Field(_V + "async_engine", bool, False)
    # the GRPO loop's own
    grpo: Section = Section("grpo", GrpoSettings, required=True, sub=("async_grpo",))
    async_grpo: Section = Section("grpo.async_grpo", AsyncGrpoSettings, required=False)
    loss: Section = Section("loss_fn", LossSettings, required=False)
    generation: Section = Section("policy.generation", GenerationSettings, required=True,
                                  only=("max_new_tokens", "temperature"))
    task: Section = Section("env.target_tokens", TaskSettings, required=False)
    colour_task: Section = Section("env.colour_squares", ColourTaskSettings, required=False)
    #: A vision-language policy's frozen parts (Megatron-Bridge's keys): the tower, the projector.
    freeze_vision_model: Field = Field(_M + "freeze_vision_model", bool, False)
    freeze_vision_projection: Field = Field(_M + "freeze_vision_projection", bool, False)
    ray: Section = Section("ray", RaySettings, required=False)
    cluster: Section = Section("cluster", ClusterSettings, required=True, only=("num_nodes", "gpus_per_node"))
    lr: Field = Field(_M + "optimizer.lr", float, REQUIRED)
    log_dir: Field = Field("logger.log_dir", str)


PLAN_CONFIG = PlanConfigKeys()
REFIT_CONFIG = RefitConfigKeys()
RECIPE = RecipeKeys()

#: Dotted keys a plain recipe override (``a.b=v``) may set even when the file lacks them: the
#: keys the recipe is read by. Anything else must exist in the file or be added with ``+a.b=v``,
#: so a typo is an error instead of a setting nobody reads.
KNOWN_KEYS: frozenset[str] = keys(RECIPE)
