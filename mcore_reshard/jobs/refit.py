"""The local refit job (``mcore-reshard refit``, ``make demo``): megatron-core training ranks
in local processes -> one or more vLLM engines, refit, verified, trained, refit again, and
compared with the HF-broadcast baseline on the same weights.

This module only starts processes and reports; the refit itself is the driver's
(``driver.py``), the checks are ``verify.py``'s, the baseline is ``hf_broadcast.py``'s (a
second transport behind the driver's one interface).
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence, TypeVar

from ..adapters.vllm.plugin import BACKEND
from ..infra.checkpoint import make_tiny_checkpoint
from ..infra.vlm import expand_images, pixel_values
from ..refit.driver import RefitDriver, ReshardTransport, Transport
from ..refit.engines import engine_world
from ..errors import RefitFailed
from ..layout import ModelSpec, load_model_spec
from ..layout.quant import BlockFp8
from ..refit.metrics import RefitMetrics
from ..plan import plan_report
from ..plan.report import format_bytes
from ..plan.placed import RankPlacement
from ..infra.ports import free_port
from ..wire.protocol import VerifyMode
from ..settings import TINY_MODELS
from ..training.pool import LocalTrainerGroup, TrainerSetup
from ..wire.canary import TOKEN_MULT_PROB_BOUND
from ..refit.verify import full_verification, token_mult_prob_error

T = TypeVar("T")

__all__ = ["LocalCluster", "colocated_placement", "local_cluster", "RefitFailed", "RefitMetrics", "run_refit_job", "token_mult_prob_error"]


@dataclass
class LocalCluster:
    """A trainer pool and ``replicas`` vLLM engines on this machine, with a driver on them."""

    spec: ModelSpec
    checkpoint: Path
    training: Any  # MegatronParallel
    vllm: Any  # VllmParallel
    refit: Any  # RefitConfig
    pool: Any = None
    engines: list = field(default_factory=list)
    driver: RefitDriver | None = None
    #: The transports this job runs, by ``refit.transport`` name (one instance each: a
    #: transport keeps its state between refits).
    transports: dict[str, Transport] = field(default_factory=lambda: job_transports())
    #: How the trainer pool was started (``restart_trainers`` starts the same again).
    setup: Any = None
    placement: Any = None

    def restart_trainers(self) -> None:
        """A new trainer pool from the checkpoint (a restarted training job after a rank died)
        and a new driver on the same engines; the next refit joins a new refit group."""
        if self.pool is not None:
            self.pool.close()
        if self.driver is not None:
            self.driver.close()
        self.pool = None
        self.setup = replace(self.setup, port=free_port())
        self.pool = LocalTrainerGroup(self.setup)
        self.driver = RefitDriver(self.pool, self.engines, self.refit, self.spec, placement=self.placement,
                                  transport=self.transports[self.refit.transport], peft=self.setup.peft,
                                  frozen=frozen_of(self.spec, self.setup.train))
        self.driver.__enter__()

    def refit_once(self, transport: str | None = None) -> RefitMetrics:
        """One refit with the configured (or given) transport; ``verify=full`` adds the
        element-wise comparison where the transport verified (checksums) what it moved."""
        request, sides = self.driver.request(), self.driver.plan_sides()
        m = self.driver.refit(request, transport=self.transports[transport or self.refit.transport])
        return self._full_check(request, m, sides)

    def refit_while(self, during: Callable[[], T], faults: Any = None) -> tuple[RefitMetrics, T]:
        """An overlapped refit with ``during()`` run on this thread while the weights move
        (the engines serve the old weights meanwhile): ``(metrics, during's result)``.
        ``verify=full`` adds the element-wise comparison, as :meth:`refit_once`."""
        request, sides = self.driver.request(), self.driver.plan_sides()
        pending = self.driver.begin_refit(request, faults=faults)
        try:
            result = during()
        finally:
            m = pending.finish()
        return self._full_check(request, m, sides), result

    def _full_check(self, request: Any, m: RefitMetrics, sides: tuple) -> RefitMetrics:
        """``verify=full``: the element-wise comparison of what the refit's plan covers (``sides``:
        a LoRA policy's later refits the adapter, a frozen tower's all but the tower), where the
        refit verified (checksums)."""
        if request.verify is VerifyMode.FULL and m.verified:
            note = full_verification(*sides, self.pool.local_tensors().wait(), self.engines)
            m = replace(m, notes=m.notes + (note,))
        return m

    def logprob_error(self, tokens: Sequence[int], image: Any = None) -> float:
        """token_mult_prob_error of every engine against a megatron forward; the worst one.
        ``image``: a vision-language policy's prompt image (a PIL image), which the engines
        take as it is and the trainers as its pixel values (the checkpoint's image processor)."""
        from ..adapters.vllm.engine import prompt_logprobs

        images, seq = self._with_image(tokens, image)
        train = self.pool.logprobs([seq], **images).wait()[0][0]
        return max(token_mult_prob_error(prompt_logprobs(llm, list(tokens), image=image), train)
                   for llm in self.engines)

    def _with_image(self, tokens: Sequence[int], image: Any) -> tuple[dict, list[int]]:
        """The trainers' form of a prompt with one image placeholder per image: its pixel
        values, and the sequence with each placeholder expanded as vLLM's processor does."""
        if image is None:
            return {}, list(tokens)
        v = self.spec.vision
        return {"images": [pixel_values(self.checkpoint, [image])]}, expand_images(tokens, v.image_token, v.patches)

    def step(self, tokens: Sequence[int], lr: float | None = None, image: Any = None) -> float:
        """One optimizer step on every trainer (``lr``: instead of the configured one; ``image``
        as :meth:`logprob_error`'s)."""
        images, seq = self._with_image(tokens, image)
        return self.pool.train_step([seq], lr, **images).wait()[0]

    def raw_bandwidth(self, pairs: Sequence[tuple[int, int]], nbytes: int) -> float:
        """The local floor: one ``nbytes`` gloo message per (source, destination) group-rank
        pair over the refit group, all pairs at once; bytes/s of the slowest pair."""
        from ..adapters.vllm.engine import raw_bandwidth

        t = self.refit.timeout_s
        pairs = [(int(a), int(b)) for a, b in pairs]
        probing = self.pool.raw_bandwidth(pairs, nbytes, t)
        got: list = []
        errors = self.driver.calls.on(lambda d, _: got.extend(raw_bandwidth(d.engine, pairs, nbytes, t)),
                                        what="raw_bandwidth")
        got += probing.wait()
        if errors:
            raise RefitFailed("raw bandwidth probe: " + "; ".join(errors))
        return min(float(g) for g in got if g is not None)


def frozen_of(spec: ModelSpec, train: dict | None) -> frozenset[str]:
    """The tensors a policy's training settings freeze (``freeze_vision_model`` /
    ``freeze_vision_projection``): its refits move them once."""
    train = train or {}
    return spec.frozen_tensors(bool(train.get("freeze_vision_model")), bool(train.get("freeze_vision_projection")))


def job_transports() -> dict[str, Transport]:
    """The local job's transports: shard to shard, and the HF baseline it is compared with."""
    from ..refit.transports.hf_broadcast import HFBroadcastTransport

    return {"reshard": ReshardTransport(), "hf_broadcast": HFBroadcastTransport()}


def engine_extension(transports: Sequence[Transport]) -> str:
    """The worker extension engines need to run every one of ``transports`` with the
    diagnostics (the baseline's extends the diagnostics one)."""
    from ..adapters.vllm.worker import REFIT_EXTENSION

    return next((t.worker_extension for t in transports if t.worker_extension), REFIT_EXTENSION)


def colocated_placement(num_src: int, num_dst: int) -> Any:
    """The local job's colocated mode: training rank i and vLLM worker i share device i, all on
    one node. On CPU a device is a label: the processes stay separate, their same-device bytes
    move through shared memory."""
    return RankPlacement.colocated(num_src, num_dst, gpus_per_node=max(num_src, num_dst, 1))


def policy_engine_args(peft: Any = None, speculative_config: dict | None = None,
                       fp8: BlockFp8 | None = None) -> dict[str, Any]:
    """vLLM engine arguments a policy's engines need: LoRA slots for a LoRA policy's adapter,
    ``speculative_config`` for an MTP draft, block FP8 for ``fp8`` (``VllmParallel.fp8``; none
    for a full policy without a draft in its own dtype)."""
    out: dict[str, Any] = {}
    if fp8 is not None:
        out.update(fp8.engine_config())
    if peft is not None and peft.enabled:
        out.update(enable_lora=True, max_lora_rank=peft.engine_rank, max_loras=peft.max_loras)
    if speculative_config:
        out["speculative_config"] = dict(speculative_config)
    return out


@contextmanager
def local_cluster(spec: ModelSpec, checkpoint: Path, training: Any, vllm: Any, refit: Any, *,
                  train: dict | None = None, engines: list | None = None,
                  sync_before_refit: bool = True, placement: Any = None,
                  async_engine: bool = False, peft: Any = None,
                  speculative_config: dict | None = None) -> Iterator[LocalCluster]:
    """Start ``vllm.replicas`` engines (weight-transfer backend ``mcore_reshard`` plus the
    worker extension every transport of the job needs, diagnostics included) and the trainer
    pool, open a driver on them, and close all of it.
    ``engines``: use these running engines instead (they are left running: several trainer
    layouts can refit one engine in turn, each joining a new refit group). ``placement``: where
    each rank sits (``plan.placed.RankPlacement``; default: ``refit.placement=colocated`` builds
    :func:`colocated_placement`, else no placement, direct plans). ``async_engine``: start
    vLLM's ``AsyncLLM`` (:class:`~mcore_reshard.adapters.vllm.engine.AsyncEngine`: clients keep
    generating while the driver's calls run) instead of the offline ``LLM``. ``peft``: a LoRA
    policy (``layout.lora.PeftConfig``): engines with LoRA slots, trainers with adapters, and a
    driver whose refits after the first move the adapter only. ``speculative_config``: vLLM's
    (``{"method": "mtp", "num_speculative_tokens": 1}``): engines that draft with the checkpoint's
    MTP layers, trainers built with megatron's MTP block, and refits that move both in one vote."""
    from ..adapters.vllm.engine import start_async_engine, start_engine, stop_engine

    start = start_async_engine if async_engine else start_engine
    c = LocalCluster(spec, checkpoint, training, vllm, refit)
    extension = engine_extension(list(c.transports.values()))
    own = engines is None
    if not own:
        c.engines = list(engines)
    try:
        for _ in range(vllm.replicas if own else 0):
            c.engines.append(start(str(checkpoint), tp=vllm.tp, dtype=spec.dtype, enable_ep=vllm.enable_ep,
                                   direct=refit.apply_mode == "direct", worker_extension_cls=extension,
                                   weight_transfer_config={"backend": BACKEND},
                                   **policy_engine_args(peft, speculative_config, vllm.fp8)))
        c.setup = TrainerSetup(spec, training, str(checkpoint), free_port(), timeout_s=max(refit.timeout_s, 120.0),
                               train=dict(train or {}), sync_before_refit=sync_before_refit, peft=peft,
                               mtp=bool(speculative_config))
        c.pool = LocalTrainerGroup(c.setup)
        if placement is None and getattr(refit, "placement", "separate") == "colocated":
            placement = colocated_placement(training.world_size, sum(map(engine_world, c.engines)))
        c.placement = placement
        c.driver = RefitDriver(c.pool, c.engines, refit, spec, placement=placement,
                               transport=c.transports[refit.transport], peft=peft, frozen=frozen_of(spec, train))
        c.driver.__enter__()
        try:
            yield c
        finally:
            c.driver.close()
    finally:
        if c.pool is not None:
            c.pool.close()
        for llm in c.engines if own else ():
            stop_engine(llm)


def run_refit_job(job: Any, *, as_json: bool = False) -> int:
    """``mcore-reshard refit``: ``job`` is ``config.load_refit_job``'s validated RefitJob."""
    # vLLM logs to stdout by default; the report (and --json's one object) owns stdout.
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    if job.workdir:
        return _run_job(job, Path(job.workdir), as_json)
    with tempfile.TemporaryDirectory(prefix="mcore_reshard_") as tmp:
        return _run_job(job, Path(tmp), as_json)


def _checkpoint(job: Any, workdir: Path) -> Path:
    if job.checkpoint is not None:
        return Path(job.checkpoint)
    return make_tiny_checkpoint(workdir / job.model, family=TINY_MODELS[job.model], dtype=job.dtype, seed=job.seed)


def _run_job(job: Any, workdir: Path, as_json: bool) -> int:
    ckpt = _checkpoint(job, workdir)
    spec = load_model_spec(ckpt, dtype=job.dtype)
    tokens = list(job.tokens)
    log = (lambda *a: print(*a, file=sys.stderr)) if as_json else print
    with local_cluster(spec, ckpt, job.training, job.vllm, job.refit, train={"lr": job.lr},
                       async_engine=job.async_engine,
                       speculative_config=None if job.speculative is None else job.speculative.to_vllm()) as c:
        d = c.driver
        log(plan_report(d.plan).table(f"refit plan: {spec.name} ({spec.dtype}) {job.src.name if job.src else d.src.name}"
                                      f" -> {d.dst.name}"))
        results = []
        first = replace(c.refit_once(), token_mult_prob_error=c.logprob_error(tokens))
        results.append(("refit 1 (initial weights)", first))
        losses = [c.step(tokens) for _ in range(job.steps)]
        stale = c.logprob_error(tokens)
        second = replace(c.refit_once(), token_mult_prob_error=c.logprob_error(tokens))
        results.append((f"refit 2 (after {len(losses)} step(s), loss {losses[0]:.4f})", second))
        baseline = None
        if job.compare_hf and job.refit.transport == "reshard":
            baseline = replace(c.refit_once("hf_broadcast"), token_mult_prob_error=c.logprob_error(tokens))
            results.append(("hf_broadcast baseline (same weights)", baseline))
        report = plan_report(d.plan)
    if as_json:
        out = {k: v for k, v in asdict(second).items() if k != "notes"}
        out.update(stale_token_mult_prob_error=stale, plan=report.to_json(),
                   refits=[dict(asdict(m), label=label) for label, m in results],
                   engines=job.vllm.replicas, training_ranks=job.training.world_size)
        if baseline is not None:
            out["hf_broadcast"] = asdict(baseline)
            out["speedup_vs_hf_broadcast"] = baseline.seconds / second.seconds
        print(json.dumps(out))
    else:
        print(_table(results, stale, baseline, second))
    bound = TOKEN_MULT_PROB_BOUND[job.dtype]
    ok = all(m.token_mult_prob_error is not None and m.token_mult_prob_error <= bound for _, m in results)
    ok = ok and all(m.verified for _, m in results if m.transport == "reshard" and job.refit.verify.checksums)
    return 0 if ok else 1


def _table(results, stale: float, baseline, reshard) -> str:
    head = (f"{'refit':<44} {'transport':<13} {'moved':>11} {'full':>11} {'minimum':>11} {'changed':>8} "
            f"{'seconds':>8} {'peak buf':>10} {'verified':>8} {'tok_mult_prob_err':>17}")
    lines = ["", head, "-" * len(head)]
    for label, m in results:
        changed = f"{100 * m.delta_fraction:.2f}%" if m.delta else "full"
        lines.append(f"{label:<44} {m.transport:<13} {format_bytes(m.bytes_moved):>11} {format_bytes(m.bytes_full):>11} "
                     f"{format_bytes(m.bytes_min):>11} {changed:>8} {m.seconds:>8.3f} "
                     f"{format_bytes(m.peak_extra_bytes):>10} {str(m.verified):>8} {m.token_mult_prob_error:>17.6f}")
    why = next((m.delta_reason for label, m in results[1:] if m.transport == "reshard" and not m.delta), "")
    if why:
        lines.append(f"refit 2 was full: {why}")
    lines.append(f"before refit 2 the engine still served the old weights: token_mult_prob_error {stale:.6f}")
    if baseline is not None:
        lines.append(f"reshard vs hf_broadcast: {baseline.bytes_moved / max(reshard.bytes_moved, 1):.2f}x fewer bytes, "
                     f"{baseline.seconds / reshard.seconds:.2f}x the speed (tiny model: fixed costs dominate; "
                     f"see scripts/bench_refit.py)")
    return "\n".join(lines)
