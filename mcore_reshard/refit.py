"""The main job: Megatron-Core ranks -> vLLM workers, refit, verified, against the HF baseline.

Driver process = this one. It starts a vLLM engine (whose workers carry the reshard worker
extension) and a pool of megatron-core training ranks, gathers both sides' descriptors, plans
once (cached), builds the refit group once, and then per refit only ships the plan digest and
lets every rank move its own bytes. Control messages go over queues / ``collective_rpc``;
bytes go over the refit group only.
"""

from __future__ import annotations

import json
import logging
import math
import os
import pickle
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Sequence

from .layout import LayoutError, ModelSpec, SideLayout, load_model_spec

__all__ = ["RefitFailed", "RefitMetrics", "RefitSession", "run_refit_job", "token_mult_prob_error"]


_log = logging.getLogger("mcore_reshard.refit")


class RefitFailed(RuntimeError):
    """A refit failed on some rank; the message carries both sides' first error lines."""


def _first_line(exc: BaseException | str) -> str:
    """The most specific line of an error (tracebacks end with the raised message)."""
    lines = [l.strip() for l in str(exc).strip().splitlines() if l.strip()]
    for l in reversed(lines):
        if "Error" in l or "Timeout" in l:
            return l
    return lines[-1] if lines else type(exc).__name__


@dataclass(frozen=True)
class RefitMetrics:
    """One refit, as reported (``refit --json`` prints these keys)."""

    transport: str
    bytes_moved: int  # over the wire, all ranks
    bytes_min: int  # theoretical minimum for the destination layout
    seconds: float  # wall time at the driver, start to every rank done
    transfer_seconds: float  # slowest rank's data-plane time
    peak_extra_bytes: int  # largest buffer footprint of any rank
    verified: bool  # checksum verification ran and passed on every destination rank
    token_mult_prob_error: float | None = None
    plan_digest: str = ""
    plan_cached: bool = False
    notes: tuple[str, ...] = ()
    #: Slowest rank's seconds per phase (src_/dst_ pack, wire, unpack, verify; apply_open: layers back
    #: to model format, apply_process: vLLM's processing, apply_commit: copy into kernel tensors,
    #: apply_finish; hf_broadcast: gather, root, receive_and_reload). Phases overlap.
    phases: dict[str, float] = field(default_factory=dict)


def after_refit(llm: Any) -> None:
    """Drop vLLM's prefix-cache blocks: they hold KV computed with the previous weights."""
    from .adapters.vllm.engine import after_refit as reset

    reset(llm)


def token_mult_prob_error(gen_logprobs: Sequence[float], train_logprobs: Sequence[float]) -> float:
    """mean(exp(|gen - train|)) over tokens: 1.0 when both sides compute the same model."""
    if len(gen_logprobs) != len(train_logprobs) or not gen_logprobs:
        raise ValueError(f"logprob lengths differ: {len(gen_logprobs)} vs {len(train_logprobs)}")
    return sum(math.exp(abs(a - b)) for a, b in zip(gen_logprobs, train_logprobs)) / len(gen_logprobs)


def _tiny_spec_dir(cfg, workdir: Path) -> Path:
    from .testing.tiny import make_tiny_checkpoint

    ref = str(cfg.model)
    if ref in ("tiny-moe", "tiny-dense"):
        return make_tiny_checkpoint(workdir / ref, moe=ref == "tiny-moe", dtype=str(cfg.dtype), seed=int(cfg.seed))
    path = Path(ref)
    if not (path / "config.json").is_file() or not list(path.glob("*.safetensors")):
        raise LayoutError(f"model {ref!r}: expected tiny-moe, tiny-dense or a HF checkpoint directory with safetensors")
    return path


@dataclass
class RefitSession:
    """A live trainer pool + engine pair with a refit group built once and reused."""

    spec: ModelSpec
    checkpoint: Path
    training: Any
    vllm: Any
    refit: Any
    pool: Any = None
    llm: Any = None
    src: SideLayout | None = None
    dst: SideLayout | None = None
    plan: Any = None
    modes: dict[str, str] = field(default_factory=dict)
    _shipped: str = ""  # digest of the plan every rank holds
    _hf_joined: bool = False
    _gather_plan: Any = None

    # -- set-up ------------------------------------------------------------------------
    def start(self) -> "RefitSession":
        if self.training.pp != 1 or self.training.vpp != 1:
            raise LayoutError(f"refit job: the CPU trainer runs one pipeline stage (training.pp={self.training.pp}, "
                              f"training.vpp={self.training.vpp}); the layout rules and planner cover PP/VPP")
        from .transport.group import free_port
        from .adapters.vllm.engine import start_engine
        from .adapters.vllm.transfer_ext import REFIT_EXTENSION
        from .trainer import TrainerPool, TrainerSetup

        direct = self.refit.apply_mode == "direct"
        self.llm = start_engine(str(self.checkpoint), tp=self.vllm.tp, dtype=self.spec.dtype,
                                enable_ep=self.vllm.enable_ep, direct=direct, worker_extension_cls=REFIT_EXTENSION)
        self.pool = TrainerPool(TrainerSetup(self.spec, self.training, str(self.checkpoint), free_port(),
                                             timeout_s=max(self.refit.timeout_s, 120.0)))
        return self

    def describe(self) -> None:
        """Both sides' descriptors -> the plan (built once; cached on the layouts' digests)."""
        from .adapters.vllm.engine import describe as vllm_describe
        from .plan import get_plan

        tensors = self.spec.tensor_table()
        src_params = tuple(p for rank in self.pool.call("describe") for p in rank)
        dst_params = tuple(p for rank in vllm_describe(self.llm) for p in rank)
        self.src = SideLayout(f"megatron(tp={self.training.tp},ep={self.training.ep},etp={self.training.etp_size},"
                              f"pp={self.training.pp},dp={self.training.dp})", self.training.world, src_params, tensors)
        self.dst = SideLayout(f"vllm(tp={self.vllm.tp},ep={self.vllm.enable_ep})", self.vllm.tp, dst_params, tensors)
        self.modes = {}
        for rank_modes in self.llm.collective_rpc("mr_modes"):
            self.modes.update(rank_modes)
        not_direct = tuple(sorted(
            (name, "kernel format differs from model format: written through vLLM's layerwise reload")
            for name, mode in self.modes.items() if mode != "direct"))
        self.plan = get_plan(self.src, self.dst, bucket_bytes=self.refit.bucket_bytes,
                             allow_cast=self.refit.allow_cast, not_direct=not_direct)

    def join(self) -> None:
        """Build the refit group (once; every refit reuses it). After a failed refit the group
        is broken on every rank: call ``join()`` again for a new one."""
        from .transport.group import RankMap, free_port

        rank_map = RankMap.disaggregated(self.src.world_size, self.dst.world_size)
        port, world, t = free_port(), rank_map.world_size, self.refit.timeout_s
        self.pool.submit("join", "127.0.0.1", port, world, rank_map, t)
        self.llm.collective_rpc("mr_join", timeout=self._rpc_timeout(),
                                args=("127.0.0.1", port, world, pickle.dumps(rank_map), t))
        self.pool.collect()

    # -- refits ------------------------------------------------------------------------
    def refit_reshard(self) -> RefitMetrics:
        cached = self._shipped == self.plan.digest()  # planned and shipped by an earlier refit
        verify = self.refit.verify != "off"
        full = self.refit.verify == "full"
        digest = self.ship_plan()
        t0 = time.perf_counter()
        self.pool.submit("refit", digest, verify, self.refit.timeout_s, True)
        replies = self._rpc_with_pool("mr_refit", (digest, verify, self.refit.timeout_s, False, full))
        dst_stats = [stats for stats, _ in replies]
        src_stats = self.pool.collect()
        seconds = time.perf_counter() - t0
        after_refit(self.llm)  # cached KV blocks were computed with the old weights
        notes: tuple[str, ...] = ()
        if full:
            notes = (self.verify_full(),)
        phases = {"src_pack": max(s.pack_s for s in src_stats), "src_wire": max(s.wire_s for s in src_stats),
                  "src_verify": max(s.verify_s for s in src_stats), "dst_wire": max(s.wire_s for s in dst_stats),
                  "dst_unpack": max(s.unpack_s for s in dst_stats), "dst_verify": max(s.verify_s for s in dst_stats)}
        for key in ("open", "process", "commit", "finish"):
            phases[f"apply_{key}"] = max(t[key] for _, t in replies)
        return RefitMetrics(
            transport="reshard",
            bytes_moved=sum(s.bytes_received for s in dst_stats),
            bytes_min=self.plan.bytes_min,
            seconds=seconds,
            transfer_seconds=max(s.seconds for s in src_stats + dst_stats),
            peak_extra_bytes=max(s.peak_extra_bytes for s in src_stats + dst_stats),
            verified=verify and all(s.verified for s in dst_stats),
            plan_digest=self.plan.digest(),
            plan_cached=cached,
            notes=notes,
            phases={k: round(v, 6) for k, v in phases.items()},
        )

    def ship_plan(self) -> str:
        """Give every rank its slice of the plan once per layout; refits then only name the
        plan by digest (and every rank checks all agree before a byte moves)."""
        digest = self.plan.digest()
        if self._shipped != digest:
            src = [self.plan.for_rank("src", r) for r in range(self.src.world_size)]
            self.pool.submit_each("set_plan", [(pickle.dumps(s), digest, s.digest()) for s in src])
            self.pool.collect()
            dst = {r: self.plan.for_rank("dst", r) for r in range(self.dst.world_size)}
            self.llm.collective_rpc("mr_set_plan", timeout=self._rpc_timeout(),
                                    args=({r: pickle.dumps(s) for r, s in dst.items()}, digest,
                                          {r: s.digest() for r, s in dst.items()}))
            self._shipped = digest
        return digest

    def _rpc_timeout(self) -> float:
        """RPC deadline: the data plane gives up after ``timeout_s``; the margin covers the
        apply step and the reply, so a hung worker still cannot hang the driver."""
        return self.refit.timeout_s + 120.0

    def _rpc_with_pool(self, method: str, args: tuple) -> list:
        """Run a data-plane worker RPC while the pool runs its submitted command. Workers answer
        ``("ok", result)`` or ``("error", message)``; on any error the pool's side is collected
        too and one error names every failing rank of both sides."""
        replies = [pickle.loads(b) for b in self.llm.collective_rpc(method, timeout=self._rpc_timeout(), args=args)]
        errors = [f"vLLM worker {r}: {_first_line(msg)}" for r, (kind, msg) in enumerate(replies) if kind == "error"]
        if not errors:
            return [value for _, value in replies]
        try:
            self.pool.collect()
        except Exception as pool_exc:  # noqa: BLE001 - reported together
            errors.append(f"training side: {_first_line(pool_exc)}")
        raise RefitFailed("; ".join(errors))

    def verify_full(self) -> str:
        """Gather canonical tensors from the trainers and compare every destination piece with
        what each worker holds (live parameter where the kernel keeps model format, else the
        received copy). Raises naming the parameter and rank of the first mismatch."""
        import torch

        from .layout.torch_views import box_slices, local_view
        from .transport.group import RefitError

        trainer_locals = self.pool.call("local_tensors")
        canonical: dict[str, torch.Tensor] = {}
        for p in self.src.params:
            for q in p.pieces:
                t = canonical.get(q.canonical)
                if t is None:
                    shape, _ = self.src.tensors[q.canonical]
                    t = canonical[q.canonical] = torch.full(tuple(shape), float("nan"),
                                                            dtype=trainer_locals[p.rank][p.name].dtype)
                t[box_slices(q.box)] = local_view(trainer_locals[p.rank][p.name].contiguous(), q.view)
        compared = {"live": 0, "received": 0}
        for rank, blob in enumerate(self.llm.collective_rpc("mr_received")):
            held = pickle.loads(blob)
            for p in self.dst.params:
                if p.rank != rank:
                    continue
                tensor, where = held[p.name]
                for q in p.pieces:
                    if not torch.equal(local_view(tensor.contiguous(), q.view), canonical[q.canonical][box_slices(q.box)]):
                        raise RefitError(f"full verification: {p.name} on destination rank {rank} ({where}) differs "
                                         f"from training's {q.canonical} at box {q.box}")
                    compared[where] += q.numel
        return (f"full verification: {compared['live']} live and {compared['received']} received elements equal "
                f"the gathered canonical tensors")

    def refit_hf_broadcast(self) -> RefitMetrics:
        from .transport.group import free_port
        from .baseline import gather_layout
        from .plan import get_plan

        tensors = self.src.tensors
        if self._gather_plan is None:
            self._gather_plan = pickle.dumps(get_plan(self.src, gather_layout(tensors),
                                                      bucket_bytes=self.refit.bucket_bytes))
        if not self._hf_joined:
            port, world = free_port(), 1 + self.dst.world_size
            self.pool.submit("hf_join", "127.0.0.1", port, world, self.refit.timeout_s)
            self.llm.collective_rpc("mr_hf_join", timeout=self._rpc_timeout(),
                                    args=("127.0.0.1", port, world, self.refit.timeout_s))
            self.pool.collect()
            self._hf_joined = True
        t0 = time.perf_counter()
        self.pool.submit("hf_send", self._gather_plan, self.refit.buffer_bytes, self.refit.timeout_s)
        dst_stats = self._rpc_with_pool("mr_hf_receive", (self.refit.buffer_bytes, self.refit.timeout_s))
        src_stats = self.pool.collect()
        seconds = time.perf_counter() - t0
        after_refit(self.llm)
        gather_bytes = sum(s["gather"].bytes_received for s in src_stats if s)
        phases = {"gather": max(s["gather"].seconds for s in src_stats if s),
                  "root": max(s["seconds"] for s in src_stats if s),
                  "receive_and_reload": max(s.seconds for s in dst_stats)}
        return RefitMetrics(
            transport="hf_broadcast",
            bytes_moved=gather_bytes + sum(s.bytes_received for s in dst_stats),
            bytes_min=self.plan.bytes_min,
            seconds=seconds,
            transfer_seconds=max([s.seconds for s in dst_stats] + [s["seconds"] for s in src_stats if s]),
            peak_extra_bytes=max([s.peak_extra_bytes for s in dst_stats] + [s["peak_extra_bytes"] for s in src_stats if s]),
            verified=False,
            notes=("no checksum verification on the baseline path; checked by logprobs",),
            phases={k: round(v, 6) for k, v in phases.items()},
        )

    def raw_bandwidth(self, pairs: Sequence[tuple[int, int]], nbytes: int) -> float:
        """The local floor: one ``nbytes`` gloo message per (source, destination) group-rank
        pair, all pairs at once over the refit group; bytes/s of the slowest pair."""
        t = self.refit.timeout_s
        self.pool.submit("raw_bandwidth", list(pairs), nbytes, t)
        got = self.llm.collective_rpc("mr_raw_bandwidth", timeout=self._rpc_timeout(), args=(list(pairs), nbytes, t))
        self.pool.collect()
        return min(float(g) for g in got if g is not None)

    def refit_once(self, transport: str) -> RefitMetrics:
        m = self.refit_reshard() if transport == "reshard" else self.refit_hf_broadcast()
        _log.info("refit %s: %d bytes moved (minimum %d) in %.3fs, peak extra %d bytes, verified=%s, phases %s",
                  m.transport, m.bytes_moved, m.bytes_min, m.seconds, m.peak_extra_bytes, m.verified, m.phases)
        return m

    # -- checks ------------------------------------------------------------------------
    def logprob_error(self, tokens: Sequence[int]) -> float:
        from .adapters.vllm.engine import prompt_logprobs

        train = self.pool.call("logprobs", list(tokens))[0]
        gen = prompt_logprobs(self.llm, list(tokens))
        return token_mult_prob_error(gen, train)

    def step(self, tokens: Sequence[int], lr: float) -> float:
        return self.pool.call("step", list(tokens), lr)[0]

    def close(self) -> None:
        from .adapters.vllm.engine import stop_engine

        if self.pool is not None:
            self.pool.close()
            self.pool = None
        if self.llm is not None:
            try:
                self.llm.collective_rpc("mr_leave")
            except Exception:  # noqa: BLE001 - best effort before the engine goes
                pass
            stop_engine(self.llm)
            self.llm = None


def run_refit_job(overrides: Sequence[str], *, as_json: bool = False) -> int:
    """``mcore-reshard refit``: see ``configs/refit.yaml``."""
    from .adapters.megatron.rules import MegatronParallel
    from .adapters.vllm.rules import VllmParallel
    from .config import build_dataclass, compose
    from .policy import RefitConfig

    # vLLM logs to stdout by default; the report (and --json's one object) owns stdout.
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    cfg = compose("refit", overrides)
    training = build_dataclass(MegatronParallel, cfg.training, "training")
    vllm = build_dataclass(VllmParallel, cfg.vllm, "vllm")
    refit = build_dataclass(RefitConfig, cfg.refit, "refit")
    if not refit.enabled:
        raise LayoutError("refit.enabled is false: nothing to run")
    if int(cfg.job.steps) < 1:
        raise LayoutError(f"job.steps={cfg.job.steps}: the job takes at least one optimizer step between its refits")
    if vllm.pp != 1 or vllm.dp != 1 or vllm.replicas != 1:
        raise LayoutError("refit job: one vLLM engine with pp=1, dp=1 runs on this machine (vllm.pp/dp/replicas)")
    if cfg.job.workdir:
        return _run_job(cfg, Path(cfg.job.workdir), training, vllm, refit, as_json)
    with tempfile.TemporaryDirectory(prefix="mcore_reshard_") as tmp:
        return _run_job(cfg, Path(tmp), training, vllm, refit, as_json)


def _run_job(cfg, workdir: Path, training, vllm, refit, as_json: bool) -> int:
    from .plan import plan_report

    ckpt = _tiny_spec_dir(cfg, workdir)
    spec = load_model_spec(ckpt, dtype=str(cfg.dtype))
    tokens = [int(t) % spec.vocab for t in cfg.job.tokens]
    log = (lambda *a: print(*a, file=sys.stderr)) if as_json else print
    # Both layouts from metadata first: impossible sizes fail here, before any process starts.
    from .adapters.megatron.rules import megatron_layout
    from .adapters.vllm.rules import vllm_layout

    megatron_layout(spec, training)
    vllm_layout(spec, vllm)

    session = RefitSession(spec, ckpt, training, vllm, refit)
    try:
        session.start()
        session.describe()
        session.join()
        log(plan_report(session.plan).table(f"refit plan: {spec.name} ({spec.dtype}) {session.src.name} -> {session.dst.name}"))
        results = []
        first = session.refit_once(refit.transport)
        first = _with_error(first, session.logprob_error(tokens))
        results.append(("refit 1 (initial weights)", first))
        losses = [session.step(tokens, float(cfg.job.lr)) for _ in range(int(cfg.job.steps))]
        stale = session.logprob_error(tokens)
        second = _with_error(session.refit_once(refit.transport), session.logprob_error(tokens))
        results.append((f"refit 2 (after {len(losses)} step(s), loss {losses[0]:.4f})", second))
        baseline = None
        if cfg.job.compare_hf and refit.transport == "reshard":
            baseline = _with_error(session.refit_hf_broadcast(), session.logprob_error(tokens))
            results.append(("hf_broadcast baseline (same weights)", baseline))
    finally:
        session.close()

    if as_json:
        out = {k: v for k, v in asdict(second).items() if k != "notes"}
        out.update(stale_token_mult_prob_error=stale, plan=plan_report(session.plan).to_json(),
                   refits=[dict(asdict(m), label=l) for l, m in results])
        if baseline is not None:
            out["hf_broadcast"] = asdict(baseline)
            out["speedup_vs_hf_broadcast"] = baseline.seconds / second.seconds
        print(json.dumps(out))
    else:
        print(_table(results, stale, baseline, second))
    ok = all(m.token_mult_prob_error is not None and m.token_mult_prob_error < 1.05 for _, m in results)
    ok = ok and all(m.verified for _, m in results if m.transport == "reshard" and refit.verify != "off")
    return 0 if ok else 1


def _with_error(m: RefitMetrics, err: float) -> RefitMetrics:
    from dataclasses import replace

    return replace(m, token_mult_prob_error=err)


def _table(results, stale: float, baseline, reshard) -> str:
    from .plan.report import format_bytes

    head = f"{'refit':<44} {'transport':<13} {'moved':>11} {'minimum':>11} {'seconds':>8} {'peak buf':>10} {'verified':>8} {'tok_mult_prob_err':>17}"
    lines = ["", head, "-" * len(head)]
    for label, m in results:
        lines.append(f"{label:<44} {m.transport:<13} {format_bytes(m.bytes_moved):>11} {format_bytes(m.bytes_min):>11} "
                     f"{m.seconds:>8.3f} {format_bytes(m.peak_extra_bytes):>10} {str(m.verified):>8} "
                     f"{m.token_mult_prob_error:>17.6f}")
    lines.append(f"before refit 2 the engine still served the old weights: token_mult_prob_error {stale:.6f}")
    if baseline is not None:
        lines.append(f"reshard vs hf_broadcast: {baseline.bytes_moved / max(reshard.bytes_moved, 1):.2f}x fewer bytes, "
                     f"{baseline.seconds / reshard.seconds:.2f}x the speed (tiny model: fixed costs dominate; "
                     f"see scripts/bench_refit.py)")
    return "\n".join(lines)
