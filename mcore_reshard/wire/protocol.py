"""The refit protocol: typed messages between a driver and the two kinds of endpoint.

A refit has two ends, each implemented once: the trainer endpoint inside a Megatron-Core rank
(``adapters/megatron/endpoint.py``) and the vLLM weight-transfer engine inside a vLLM worker
(``adapters/vllm/backend/engine.py``). A driver -- this project's job, or an RL framework's
own controller -- moves these messages between them, over whatever control channel it has
(vLLM's ``collective_rpc``, Ray calls, queues). The lifecycle is vLLM's weight-transfer one:

    describe -> join(JoinInfo) -> set_plan(plan slice) -> refit(RefitRequest) -> RankReport ... -> leave

Every message is a frozen dataclass with ``to_wire()`` / ``from_wire()`` to plain JSON-able
values: nothing here is ever unpickled, and a setting (e.g.
``VerifyMode``) reaches the rank that uses it whole. That includes what crosses vLLM's RPC: an
engine's init info (:class:`EngineInitInfo`) and the diagnostics extension's replies
(:class:`WorkerStatus`, :class:`WorkerLayout`; the received tensors of ``verify=full``
are ``transport.views.ReceivedWeights``, raw bytes). Both ends answer a refit the same way: a vote over the refit group carrying
their ``RankReport`` or one error line (``transport/participant.py``). Bytes never travel in these
messages; they move over the refit group (``transport``).
"""

from __future__ import annotations

import enum
import hashlib
import math
from dataclasses import dataclass, field, fields, replace
from typing import Any, Mapping, Sequence

from ..errors import ConfigError
from ..layout.descriptor import Box, LocalParam, Piece, View
from ..layout.lora import PeftConfig
from .faults import EngineFault

__all__ = ["BACKEND", 
    "VerifyMode",
    "DELTA_MODES",
    "RankMap",
    "JoinInfo",
    "RefitRequest",
    "Canary",
    "token_mult_prob_error",
    "refit_id",
    "RankReport",
    "EngineInitInfo",
    "EngineUpdateInfo",
    "WorkerStatus",
    "WorkerLayout",
    "DETAIL_MARK",
    "first_error_line",
    "one_line",
]

#: The name of this project's vLLM weight-transfer backend (``weight_transfer_config={"backend": BACKEND}``).
BACKEND = "mcore_reshard"


#: ``refit.delta`` / ``RefitRequest.delta``: ``auto`` sends only what changed whenever every
#: rank holds the same committed refit; ``off`` always sends whole boxes.
DELTA_MODES = ("auto", "off")


class VerifyMode(str, enum.Enum):
    """How a refit proves what it wrote.

    ``off``: nothing; ``checksum``: exact bit checksums of every box, source vs what the
    destination parameter holds; ``full``: checksums, and every destination element compared
    with the canonical tensors gathered from the trainers (keeps a received copy)."""

    OFF = "off"
    CHECKSUM = "checksum"
    FULL = "full"

    @classmethod
    def parse(cls, value: "str | VerifyMode", what: str = "verify") -> "VerifyMode":
        try:
            return value if isinstance(value, VerifyMode) else cls(str(value))
        except ValueError:
            raise ConfigError(f"{what}={value!r} is not one of {[m.value for m in cls]}") from None

    @property
    def checksums(self) -> bool:
        return self is not VerifyMode.OFF


@dataclass(frozen=True)
class RankMap:
    """Which refit-group rank each source (training) and destination (inference) rank is.

    ``src[r]`` / ``dst[r]`` are group ranks. A group rank may be both (colocated refit), in
    which case its messages to itself never touch the wire.
    """

    src: tuple[int, ...]
    dst: tuple[int, ...]

    @staticmethod
    def disaggregated(num_src: int, num_dst: int) -> "RankMap":
        """Separate processes: source r -> r, destination r -> num_src + r."""
        return RankMap(tuple(range(num_src)), tuple(range(num_src, num_src + num_dst)))

    @staticmethod
    def colocated(num_ranks: int) -> "RankMap":
        """Each process is source r and destination r (trainer and engine share a process)."""
        return RankMap(tuple(range(num_ranks)), tuple(range(num_ranks)))

    @property
    def world_size(self) -> int:
        return max(self.src + self.dst, default=-1) + 1

    def group_rank(self, side: str, rank: int) -> int:
        return (self.src if side == "src" else self.dst)[rank]

    def roles(self, group_rank: int) -> tuple[int | None, int | None]:
        """(source rank, destination rank) played by ``group_rank``; None where it plays none."""
        s = self.src.index(group_rank) if group_rank in self.src else None
        d = self.dst.index(group_rank) if group_rank in self.dst else None
        return s, d

    def name(self, side: str, rank: int) -> str:
        """Human name used in every error, e.g. ``destination rank 1 (group rank 3)``."""
        word = "source" if side == "src" else "destination"
        return f"{word} rank {rank} (group rank {self.group_rank(side, rank)})"

    def name_at(self, group_rank: int) -> str:
        """``name`` of the rank (or both ranks, colocated) that group rank ``group_rank`` plays."""
        s, d = self.roles(group_rank)
        parts = ([f"source rank {s}"] if s is not None else []) + ([f"destination rank {d}"] if d is not None else [])
        return f"{' / '.join(parts) or 'no role'} (group rank {group_rank})"

    def to_wire(self) -> dict:
        return {"src": list(self.src), "dst": list(self.dst)}

    @staticmethod
    def from_wire(d: Mapping[str, Any]) -> "RankMap":
        return RankMap(tuple(int(r) for r in d["src"]), tuple(int(r) for r in d["dst"]))


def _check_positive(what: str, value: float) -> None:
    if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
        raise ConfigError(f"{what}={value!r} must be a positive number")


@dataclass(frozen=True)
class JoinInfo:
    """Where the refit group meets and who is who in it (sent once per group).

    ``dst_offset`` is the first destination rank of the receiving engine: engine ``e`` of
    several holds destination ranks ``dst_offset .. dst_offset + its world - 1``.
    ``secret`` is the per-job key every control message is authenticated with; ``nonce`` is
    fresh per group (the driver draws one at every join): every signed message is bound to it,
    so nothing recorded from another group is accepted in this one.
    """

    host: str
    port: int
    world_size: int
    rank_map: RankMap
    timeout_s: float
    dst_offset: int = 0
    secret: str = ""
    prefix: str = "mcore_reshard/refit"
    nonce: str = ""

    def __post_init__(self) -> None:
        _check_positive("timeout_s", self.timeout_s)
        if self.rank_map.world_size > self.world_size:
            raise ConfigError(f"rank map spans {self.rank_map.world_size} group ranks, world_size={self.world_size}")

    def to_wire(self) -> dict:
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        out["rank_map"] = self.rank_map.to_wire()
        return out

    @staticmethod
    def from_wire(d: Mapping[str, Any]) -> "JoinInfo":
        d = dict(d)
        d["rank_map"] = RankMap.from_wire(d["rank_map"])
        return JoinInfo(**d)


def refit_id(plan_digest: str, nonce: str, epoch: int) -> str:
    """The id every rank of a refit records when it commits: unique per (plan, group, refit),
    so a restarted process, a new group or a new plan never matches an old one."""
    h = hashlib.sha256(f"{plan_digest}\0{nonce}\0{epoch}".encode()).hexdigest()[:16]
    return f"{plan_digest[:16]}:{h}"


def token_mult_prob_error(gen_logprobs: Sequence[float], train_logprobs: Sequence[float]) -> float:
    """mean(exp(|gen - train|)) over tokens: 1.0 when both sides compute the same model (NeMo
    RL's measure of a refit's health)."""
    if len(gen_logprobs) != len(train_logprobs) or not gen_logprobs:
        raise ValueError(f"logprob lengths differ: {len(gen_logprobs)} vs {len(train_logprobs)}")
    return sum(math.exp(abs(a - b)) for a, b in zip(gen_logprobs, train_logprobs)) / len(gen_logprobs)


@dataclass(frozen=True)
class Canary:
    """What a refit's canary vote checks (``refit.canary``): before an engine serves new
    weights it runs ``tokens`` (a few fixed sequences) through its model on them and takes, after
    each prefix, the log-prob of ``targets`` (one token per position but the last; empty: each
    sequence's own next token, prompt logprobs), and votes no when ``token_mult_prob_error``
    against ``reference`` -- the trainers' log-probs of the same targets under the policy just
    sent -- exceeds ``bound``. Checksums prove the bytes arrived as planned; this proves the
    engine computes the policy (a layout wrong the same way on both sides, a kernel not rebuilt
    after loading, a head left stale). ``dtype`` names the precision the bound was chosen for
    (messages).

    The targets a refit sends are the policy's own most likely tokens (``refit.canary``'s
    reference is the trainers' ``top_logprobs``): the bound is NeMo RL's, measured on tokens the
    policy samples, and a sequence's random next tokens sit in the tail of a trained policy's
    distribution, where two precisions' kernels legitimately differ by more than it.

    A canary without ``reference`` (and ``targets``) is **deferred**: the training ranks compute
    both during the refit, after their last byte is sent, and hand them to the engines at the
    exchange every rank meets at before the canary's forward (``transport.participant``). The
    trainers' forward then runs while the engines still receive and stage, off the refit's
    critical path, instead of before the first byte (:meth:`completed`).

    ``draft``: the engines' speculative draft (DeepSeek's MTP) is checked too, against
    ``draft_targets`` / ``draft_reference`` -- at each position but the last, the token the
    policy's MTP head finds most likely two ahead and its log-prob. Speculative decoding is
    lossless, so a draft left stale changes no logprob of the target: it needs its own check."""

    tokens: tuple[tuple[int, ...], ...]
    reference: tuple[tuple[float, ...], ...]
    bound: float
    dtype: str = ""
    targets: tuple[tuple[int, ...], ...] = ()
    draft: bool = False
    draft_targets: tuple[tuple[int, ...], ...] = ()
    draft_reference: tuple[tuple[float, ...], ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "tokens", tuple(tuple(int(t) for t in s) for s in self.tokens))
        object.__setattr__(self, "reference", tuple(tuple(float(x) for x in s) for s in self.reference))
        object.__setattr__(self, "targets", tuple(tuple(int(t) for t in s) for s in self.targets))
        if not self.tokens or any(len(s) < 2 for s in self.tokens):
            raise ConfigError("canary: needs at least one sequence of two or more tokens")
        if self.deferred:
            if self.targets:
                raise ConfigError("canary: targets without a reference (a deferred canary has neither)")
        elif len(self.reference) != len(self.tokens) or any(
                len(r) != len(s) - 1 for r, s in zip(self.reference, self.tokens)):
            raise ConfigError(f"canary: reference logprobs do not match the sequences ({len(self.reference)} for "
                              f"{len(self.tokens)}; one value per token after the first)")
        if self.targets and (len(self.targets) != len(self.tokens) or any(
                len(t) != len(s) - 1 for t, s in zip(self.targets, self.tokens))):
            raise ConfigError(f"canary: targets do not match the sequences ({len(self.targets)} for "
                              f"{len(self.tokens)}; one token per position but the last)")
        if not isinstance(self.bound, (int, float)) or not self.bound > 1.0:
            raise ConfigError(f"canary: bound={self.bound!r} must be a token_mult_prob_error above 1.0")
        object.__setattr__(self, "draft_targets", tuple(tuple(int(t) for t in s) for s in self.draft_targets))
        object.__setattr__(self, "draft_reference", tuple(tuple(float(x) for x in s) for s in self.draft_reference))
        if (self.draft_targets or self.draft_reference) and not self.draft:
            raise ConfigError("canary: a draft reference for a canary that does not check the draft")
        if self.draft and not self.deferred and [len(t) for t in self.draft_targets] != [len(r) for r in self.reference]:
            raise ConfigError("canary: the draft's targets do not match the sequences (one per position but the last)")
        if [len(t) for t in self.draft_targets] != [len(r) for r in self.draft_reference]:
            raise ConfigError("canary: the draft's targets and reference differ in length")

    @property
    def deferred(self) -> bool:
        """Whether the trainers fill in the targets and the reference during the refit."""
        return not self.reference

    def completed(self, top: Sequence[tuple[Sequence[int], Sequence[float]]],
                  draft: Sequence[tuple[Sequence[int], Sequence[float]]] = ()) -> "Canary":
        """This canary with its targets and reference: ``top``, per sequence, the policy's most
        likely token after each prefix and its log-prob (a trainer's ``top_logprobs``); ``draft``
        the same of its MTP head (``draft_top_logprobs``), for a canary that checks the draft."""
        return replace(self, reference=tuple(tuple(lp) for _, lp in top), targets=tuple(tuple(t) for t, _ in top),
                       draft_targets=tuple(tuple(t) for t, _ in draft),
                       draft_reference=tuple(tuple(lp) for _, lp in draft))

    def scored(self) -> tuple[tuple[int, ...], ...]:
        """The token scored after each prefix of each sequence: ``targets``, else its next token."""
        return self.targets or tuple(s[1:] for s in self.tokens)

    def to_wire(self) -> dict:
        out = {"tokens": [list(s) for s in self.tokens], "reference": [list(r) for r in self.reference],
               "bound": self.bound, "dtype": self.dtype}
        if self.targets:
            out["targets"] = [list(t) for t in self.targets]
        if self.draft:
            out.update(draft=True, draft_targets=[list(t) for t in self.draft_targets],
                       draft_reference=[list(r) for r in self.draft_reference])
        return out

    @staticmethod
    def from_wire(d: Mapping[str, Any]) -> "Canary":
        return Canary(d["tokens"], d["reference"], float(d["bound"]), str(d.get("dtype", "")),
                      tuple(d.get("targets", ())), bool(d.get("draft", False)), tuple(d.get("draft_targets", ())),
                      tuple(d.get("draft_reference", ())))


@dataclass(frozen=True)
class RefitRequest:
    """One refit: which plan (every rank holds its slice already), how to verify, how long
    to wait for a silent peer, and whether the engine commits all-or-nothing.

    ``epoch`` numbers the refits of one group (every signed message of this refit carries it;
    0: each rank counts itself). ``version`` is the label every worker records when it commits
    (vLLM's ``update_weight_version``; default: the refit's identity, ``Outcome.refit``). The
    driver confirms an engine by that identity, never by the label, which a caller may repeat.
    """

    plan_digest: str
    verify: VerifyMode = VerifyMode.CHECKSUM
    timeout_s: float = 300.0
    #: All workers of an engine stage the new weights and commit together, or none does.
    atomic: bool = True
    epoch: int = 0
    version: str = ""
    #: Receive in the background while the engine keeps generating: ``update_weights``
    #: returns at once, each worker receives into shadow weights and votes on its own
    #: thread, and ``finish_weight_update`` swaps them in between two model steps (needs
    #: ``atomic``: a streaming refit writes live weights as buckets arrive).
    overlap: bool = False
    #: ``auto``: send only what changed whenever every rank holds the same committed refit
    #: (``transport/delta.py``); ``off``: always full, and keep no baselines.
    delta: str = "auto"
    #: The most bytes of baseline one rank keeps for delta refits (0: no limit); a rank over
    #: it keeps none, and refits stay full.
    delta_state_limit_bytes: int = 0
    #: The canary vote (``Canary``): every engine checks what it computes on the new weights
    #: before they serve; None: bytes only.
    canary: Canary | None = None
    #: The refit changes weights an engine's multimodal encoder computes with (a vision tower
    #: or its projector): each engine that commits drops its cached encoder outputs (and
    #: preempts running requests, whose images are then encoded under the new weights).
    encoders: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "verify", VerifyMode.parse(self.verify))
        if self.delta not in DELTA_MODES:
            raise ConfigError(f"delta={self.delta!r} is not one of {', '.join(DELTA_MODES)}")
        if not isinstance(self.delta_state_limit_bytes, int) or self.delta_state_limit_bytes < 0:
            raise ConfigError(f"delta_state_limit_bytes={self.delta_state_limit_bytes!r} must be a non-negative "
                              "integer (bytes; 0: no limit)")
        _check_positive("timeout_s", self.timeout_s)
        if not isinstance(self.epoch, int) or self.epoch < 0:
            raise ConfigError(f"epoch={self.epoch!r} must be a non-negative integer")
        if self.overlap and not self.atomic:
            raise ConfigError("overlap=True needs atomic=True: a streaming refit writes live weights as buckets "
                              "arrive, which a model step running meanwhile would read")

    def label(self, refit: str) -> str:
        """The version label of this refit, whose identity is ``refit``."""
        return self.version or refit

    def to_wire(self) -> dict:
        return {"plan_digest": self.plan_digest, "verify": self.verify.value, "timeout_s": self.timeout_s,
                "atomic": self.atomic, "epoch": self.epoch, "version": self.version, "overlap": self.overlap,
                "delta": self.delta, "delta_state_limit_bytes": self.delta_state_limit_bytes,
                **({"canary": self.canary.to_wire()} if self.canary is not None else {}),
                **({"encoders": True} if self.encoders else {})}

    @staticmethod
    def from_wire(d: Mapping[str, Any]) -> "RefitRequest":
        d = dict(d)
        if d.get("canary") is not None:
            d["canary"] = Canary.from_wire(d["canary"])
        return RefitRequest(**d)


@dataclass(frozen=True)
class DeltaStats:
    """One rank's delta part of a refit (``transport/delta.py``): whether it sent deltas and
    why not; the sender's elements and changed elements; its boxes sent unchanged, sparse and
    dense; the bytes it keeps between refits as its baseline."""

    on: bool = False
    reason: str = ""
    elements: int = 0
    changed: int = 0
    boxes: tuple[int, int, int] = (0, 0, 0)
    state_bytes: int = 0

    def to_wire(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @staticmethod
    def from_wire(d: Mapping[str, Any]) -> "DeltaStats":
        d = dict(d)
        d["boxes"] = tuple(d.get("boxes", (0, 0, 0)))
        return DeltaStats(**d)


@dataclass(frozen=True)
class RankReport:
    """What one rank did in one refit (both sides report the same shape).

    ``phases`` are seconds per phase on this rank (pack, wire, unpack, verify; on a vLLM
    worker also apply_open / apply_process / apply_commit / apply_finish); they overlap.
    """

    side: str  # "src" | "dst"
    rank: int
    bytes_sent: int = 0
    bytes_received: int = 0
    messages: int = 0
    buckets: int = 0
    seconds: float = 0.0
    peak_extra_bytes: int = 0
    verified: bool = False
    phases: dict[str, float] = field(default_factory=dict)
    #: The part of the bytes sent or received that went through shared memory (same device).
    bytes_same_device: int = 0
    #: The part that went zero-copy (parameter to parameter, no buffer between).
    bytes_zero_copy: int = 0
    #: What a full refit would have received, and the part of ``bytes_received`` that was
    #: delta headers; the rest of the delta part of the refit.
    bytes_full: int = 0
    bytes_headers: int = 0
    delta: DeltaStats = DeltaStats()

    def to_wire(self) -> dict:
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        out["delta"] = self.delta.to_wire()
        return out

    @staticmethod
    def from_wire(d: Mapping[str, Any]) -> "RankReport":
        d = dict(d)
        d["delta"] = DeltaStats.from_wire(d.get("delta") or {})
        return RankReport(**d)


@dataclass(frozen=True)
class EngineInitInfo:
    """One engine's ``init_weight_transfer_engine`` message (vLLM's ``init_info``): where the
    refit group meets, the plan's digest, and each of the engine's destination ranks' plan
    slice, inline (``slices``: rank -> ``plan.wire.slice_to_wire``) or by digest
    (``slice_digests``: each worker reads its own from the refit group's store after joining,
    so the message stays small). ``slices`` wins for a rank present in both."""

    join: JoinInfo
    plan_digest: str
    slices: Mapping[int, Mapping[str, Any]] = field(default_factory=dict)
    slice_digests: Mapping[int, str] = field(default_factory=dict)
    #: A LoRA policy: the engine holds a refit adapter in its LoRA slots
    #: (``adapters/vllm/lora_slots.py``), and the slices may write its slot tensors.
    lora: PeftConfig | None = None

    def to_wire(self) -> dict:
        out: dict[str, Any] = {"join": self.join.to_wire(), "plan_digest": self.plan_digest,
                               "slices": {str(r): s for r, s in self.slices.items()}}
        if self.slice_digests:
            out["slice_digests"] = {str(r): d for r, d in self.slice_digests.items()}
        if self.lora is not None:
            out["lora"] = self.lora.to_wire()
        return out

    @staticmethod
    def from_wire(d: Mapping[str, Any]) -> "EngineInitInfo":
        lora = d.get("lora")
        return EngineInitInfo(JoinInfo.from_wire(d["join"]), str(d.get("plan_digest", "")),
                              {int(r): s for r, s in (d.get("slices") or {}).items()},
                              {int(r): str(g) for r, g in (d.get("slice_digests") or {}).items()},
                              PeftConfig.from_wire(dict(lora)) if lora else None)


@dataclass(frozen=True)
class EngineUpdateInfo:
    """One engine's ``update_weights`` message (vLLM's ``update_info``): the refit request,
    and, in tests and soak runs only, the fault it injects on the engine's side."""

    request: RefitRequest
    fault: EngineFault | None = None

    def to_wire(self) -> dict:
        return {"request": self.request.to_wire(), "fault": self.fault.to_wire() if self.fault else {}}

    @staticmethod
    def from_wire(d: Mapping[str, Any]) -> "EngineUpdateInfo":
        unknown = set(d) - {"request", "fault"}
        if unknown:
            raise ConfigError(f"update_info: unknown keys {sorted(unknown)} (expected request, fault)")
        return EngineUpdateInfo(RefitRequest.from_wire(d["request"]), EngineFault.from_wire(d.get("fault") or {}))


@dataclass(frozen=True)
class WorkerStatus:
    """One vLLM worker's serving state, the version it holds and the last refit's outcome
    (the diagnostics extension's ``mr_status``; the driver reads it to confirm an engine).

    ``state``: ``serving`` (whole weights of ``version``; "" = as loaded), ``not_serving`` (a
    streaming refit committed part of the weights and then failed), ``unsure`` (this worker
    could not learn the decision of a refit; it stays unsure until a refit commits on it, so
    a later driver sees it too). ``committed`` / ``known``: None before any refit.

    ``refit``: the identity of the refit whose weights it holds (``transport.delta.refit_id``:
    plan digest, the refit group's nonce -- fresh at every join -- and the epoch; "" = as
    loaded). Unlike ``version``, a label the caller may choose and repeat (``"refit-1"`` from
    every new driver), it names one refit of one job: the driver confirms an engine by it."""

    state: str = "serving"
    reason: str = ""
    version: str = ""
    committed: bool | None = None
    known: bool | None = None
    errors: tuple[str, ...] = ()
    init_error: str = ""
    refit: str = ""

    def to_wire(self) -> dict:
        return {"state": self.state, "reason": self.reason, "version": self.version, "committed": self.committed,
                "known": self.known, "errors": list(self.errors), "init_error": self.init_error, "refit": self.refit}

    @staticmethod
    def from_wire(d: Mapping[str, Any]) -> "WorkerStatus":
        return WorkerStatus(str(d.get("state", "")), str(d.get("reason", "")), str(d.get("version", "")),
                            d.get("committed"), d.get("known"), tuple(str(e) for e in d.get("errors", ())),
                            str(d.get("init_error", "")), str(d.get("refit", "")))


@dataclass(frozen=True)
class WorkerLayout:
    """One vLLM worker's destination pieces as it recorded them (``mr_describe``)."""

    params: tuple[LocalParam, ...]

    def to_wire(self) -> list:
        return [[p.rank, p.name, list(p.shape), p.dtype,
                 [[q.rank, q.local_name, q.canonical, list(q.box.offsets), list(q.box.sizes), q.view.offset,
                   list(q.view.shape), list(q.view.stride)] for q in p.pieces]] for p in self.params]

    @staticmethod
    def from_wire(rows: Any) -> "WorkerLayout":
        def piece(q: list) -> Piece:
            return Piece(int(q[0]), str(q[1]), str(q[2]), Box(tuple(q[3]), tuple(q[4])),
                         View(int(q[5]), tuple(q[6]), tuple(q[7])))

        return WorkerLayout(tuple(LocalParam(int(r[0]), str(r[1]), tuple(r[2]), str(r[3]),
                                             tuple(piece(q) for q in r[4])) for r in rows))


def one_line(exc: BaseException) -> str:
    """The first non-empty line of an error (what a CLI prints after ``error:``)."""
    text = [line.strip() for line in str(exc).strip().splitlines() if line.strip()]
    return text[0] if text else type(exc).__name__


#: The end of an error's own text: the lines after one that ends so are detail (a dead
#: process's last output: ``jobs.grpo.ray_cluster.last_words``), never its most specific line.
DETAIL_MARK = "'s stderr ended with:"


def first_error_line(exc: BaseException | str) -> str:
    """The most specific line of an error: tracebacks end with the raised message, so the
    last line that names an error wins; else the last line (detail after ``DETAIL_MARK``
    left out)."""
    lines = [line.strip() for line in str(exc).strip().splitlines() if line.strip()]
    ends = [i for i, line in enumerate(lines) if line.endswith(DETAIL_MARK)]
    lines = lines[:ends[0]] if ends else lines
    for line in reversed(lines):
        if "Error" in line or "Timeout" in line or "Aborted" in line or "Incomplete" in line:
            return line
    if lines:
        return lines[-1]
    return type(exc).__name__ if isinstance(exc, BaseException) else "error"
