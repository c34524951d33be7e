"""Soak test: many refits into one running vLLM engine, then (``--faults``) a fault matrix.

    python scripts/soak.py [--refits 100] [--step-every 10] [--json] [--faults] [key=value ...]

The local job of ``configs/refit.yaml`` (trailing ``key=value`` are Hydra overrides of it; the
tiny checkpoint is written to a temp dir, as ``mcore-reshard refit`` does): megatron-core ranks
-> vLLM engine(s). ``--refits N`` refits run back to back, an optimizer step before every
``--step-every``-th one, so the served weights really change. Per refit: seconds, bytes moved ==
the minimum, verified, and the RSS of every process (this one and all its children) right after
it. Reported: refits ok, seconds per refit (median, p95, max, median of the first 10 vs the last
10), RSS growth per process from refit 10 to refit N, token_mult_prob_error after the last refit.

``--faults``: on the same cluster, after the soak, the fault matrix (README "Reliability" is its
output): a process killed or stalled at each protocol step -- mid-transfer, after its last byte,
after its vote, the store's host between two workers reading the decision, a vLLM worker stalled
past the timeout, a vLLM worker dying -- in both commit modes (``refit.atomic`` true and false),
plus a vLLM worker stopped past the timeout and resumed (refused at once, then readmitted by the
same driver), three new drivers that each label their refit 1 alike around a split commit, and
the attacks a second process on the store can make (a replayed vote, garbage at an abort key,
and ``testing.attacks``: garbage or a replayed decision over the decision key, each key kind
deleted, garbage in the abort hint). Per row: the seconds until the driver's error (every rank had
stopped by then), whether it names the failing rank, what ``generate`` and ``enqueue`` +
``wait_for_completion`` served afterwards (old, new, or refused -- never a mix), and whether
the next refit restored the same engine (after restarting the trainer pool where a training
rank died, or replacing the engine where it died).

A readable table goes to stdout (``--json``: exactly one JSON object); vLLM's logs go to
stderr. Exit code 0 when every refit verified and every fault row behaved, else 1.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable

from bench_refit import stdout_to_stderr  # scripts/ is on sys.path when run as a script

#: A refused refit (nothing moved) must stop every rank within this; a bit flip too (an abort
#: signal, not the timeout).
FAST_ERROR_S = 5.0


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--refits", type=int, default=100, help="refits in the soak (default 100)")
    ap.add_argument("--step-every", type=int, default=10, help="an optimizer step before every K-th refit")
    ap.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    ap.add_argument("--faults", action="store_true", help="after the soak, run the fault matrix")
    ap.add_argument("--only", default="", help="with --faults: only the rows whose name contains this")
    ap.add_argument("overrides", nargs="*", help="Hydra overrides of configs/refit.yaml, e.g. refit.verify=off")
    args = ap.parse_args()
    if args.refits < 1 or args.step_every < 1:
        ap.error("--refits and --step-every must be >= 1")
    return args


# -- RSS -----------------------------------------------------------------------------------------

def rss_sample(labels: dict[int, str] | None = None) -> dict[str, int]:
    """RSS of this process and every descendant, keyed ``name:pid`` (``labels``: names by pid,
    e.g. the training ranks, which are all called ``python``)."""
    import psutil

    labels = dict(labels or {})
    me = psutil.Process()
    labels[me.pid] = "soak (driver)"
    out: dict[str, int] = {}
    for p in [me] + me.children(recursive=True):
        try:
            out[f"{labels.get(p.pid) or p.name()}:{p.pid}"] = p.memory_info().rss
        except psutil.Error:
            pass
    return out


def rss_growth(samples: list[dict[str, int]]) -> dict[str, dict[str, float]]:
    """Per process alive in both: RSS at refit 10 (or the first refit when fewer than 10) and at
    the last refit, and the growth in percent; plus the sum over those processes."""
    if not samples:
        return {}
    base_i = min(9, len(samples) - 1)
    base, last = samples[base_i], samples[-1]
    out: dict[str, dict[str, float]] = {}
    for key in sorted(set(base) & set(last)):
        out[key] = {"from_refit": base_i + 1, "rss_from": base[key], "rss_to": last[key],
                    "growth_pct": 100.0 * (last[key] - base[key]) / max(base[key], 1)}
    common = set(base) & set(last)
    b, l_ = sum(base[k] for k in common), sum(last[k] for k in common)
    out["TOTAL"] = {"from_refit": base_i + 1, "rss_from": b, "rss_to": l_, "growth_pct": 100.0 * (l_ - b) / max(b, 1)}
    return out


# -- the soak ------------------------------------------------------------------------------------

def percentile(xs: list[float], q: float) -> float:
    s = sorted(xs)
    if not s:
        return float("nan")
    k = (len(s) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def soak(c: Any, tokens: list[int], args: argparse.Namespace, log: Callable[..., None]) -> dict[str, Any]:
    rows: list[dict[str, Any]] = []
    samples: list[dict[str, int]] = []
    labels = {p.pid: f"training rank {r}" for r, p in enumerate(getattr(c.pool, "procs", []))}
    t_all = time.perf_counter()
    for i in range(1, args.refits + 1):
        row: dict[str, Any] = {"refit": i, "stepped": False}
        try:
            if i % args.step_every == 0:
                row["loss"] = c.step(tokens)
                row["stepped"] = True
                row["stale_token_mult_prob_error"] = c.logprob_error(tokens)
            m = c.refit_once()
            row.update(seconds=m.seconds, bytes_moved=m.bytes_moved, bytes_full=m.bytes_full, bytes_min=m.bytes_min,
                       delta=m.delta, verified=m.verified, bytes_ok=m.at_minimum,
                       peak_extra_bytes=m.peak_extra_bytes, ok=bool(m.verified and m.at_minimum), error="")
        except Exception as exc:  # noqa: BLE001 - recorded; the next refit rejoins
            row.update(seconds=None, verified=False, bytes_ok=False, ok=False,
                       error=f"{type(exc).__name__}: {str(exc)[:300]}")
        samples.append(rss_sample(labels))
        row["rss"] = samples[-1]
        rows.append(row)
        extra = (f" (after a step, loss {row['loss']:.4f}, stale err {row['stale_token_mult_prob_error']:.4f})"
                 if row["stepped"] and "loss" in row else "")
        log(f"refit {i}/{args.refits}: " + (f"{row['seconds']:.3f}s verified={row['verified']} "
                                            f"bytes==min={row['bytes_ok']}" if row["error"] == "" else
                                            f"FAILED {row['error']}") + extra)
    total_s = time.perf_counter() - t_all
    err = c.logprob_error(tokens)
    secs = [r["seconds"] for r in rows if r["seconds"] is not None]
    first, last = secs[:10], secs[-10:]
    return {
        "refits": len(rows),
        "refits_ok": sum(r["ok"] for r in rows),
        "all_verified": all(r["verified"] for r in rows),
        "all_bytes_min": all(r["bytes_ok"] for r in rows),
        "steps": sum(r["stepped"] for r in rows),
        "soak_wall_seconds": total_s,
        "seconds_median": statistics.median(secs) if secs else None,
        "seconds_p95": percentile(secs, 0.95) if secs else None,
        "seconds_max": max(secs) if secs else None,
        "seconds_first10_median": statistics.median(first) if first else None,
        "seconds_last10_median": statistics.median(last) if last else None,
        "token_mult_prob_error": err,
        "rss_growth": rss_growth(samples),
        "rss_samples": samples,
        "per_refit": rows,
    }


# -- the fault matrix ----------------------------------------------------------------------------

@dataclass(frozen=True)
class FaultCase:
    """One row: how to provoke it, what the error must name, how fast (a death is visible at
    once; only a stopped peer waits for the timeout), and what must be restarted after it."""

    name: str
    provoke: Callable[[Any], Any]  # given the cluster
    names: Callable[[str], bool]
    max_seconds: Callable[[float], float]
    #: "trainers" (a training rank died) | "engine" (the engine died) | "resume" (a stopped
    #: worker: wait until the same driver readmits its engine) | ""
    restart: str = ""


def _cases() -> list[FaultCase]:
    from mcore_reshard.refit.driver import ENGINE_GRACE_S
    from mcore_reshard.wire.faults import EngineFault, Faults, TrainerFault
    from mcore_reshard.wire.faults import Fault

    wrong = "0" * 16
    fast = lambda t: FAST_ERROR_S  # noqa: E731
    return [
        FaultCase("bit flipped in flight (training rank 0, bucket 1)",
                  lambda c: c.driver.refit(faults=Faults(TrainerFault(0, Fault("bitflip", bucket=1)))),
                  lambda m: "checksum mismatch" in m and "model." in m, fast),
        FaultCase("stale plan digest (refused before a byte moves)",
                  lambda c: c.driver.refit(request=replace(c.driver.request(), plan_digest=wrong)),
                  # every refusing worker is named, not only the engine's last one
                  lambda m: wrong in m and "vLLM destination rank 0" in m and "vLLM destination rank 1" in m, fast),
        FaultCase("training rank 1 dies mid-transfer",
                  lambda c: c.driver.refit(faults=Faults(TrainerFault(1, die_after_reads=5))),
                  lambda m: "training rank 1 died" in m, fast, "trainers"),
        FaultCase("training rank 1 dies after its last byte, before its vote",
                  lambda c: c.driver.refit(faults=Faults(TrainerFault(1, Fault("exit", at="before_vote")))),
                  lambda m: "training rank 1 died" in m, fast, "trainers"),
        FaultCase("training rank 1 dies after its vote",
                  lambda c: c.driver.refit(faults=Faults(TrainerFault(1, Fault("exit", at="after_vote")))),
                  lambda m: "training rank 1 died" in m, fast, "trainers"),
        FaultCase("store host (training rank 0) dies between two workers reading the decision",
                  lambda c: c.driver.refit(faults=Faults(TrainerFault(0, Fault("exit", at="after_decision", seconds=0.5)),
                                                  EngineFault(1, Fault("sleep", at="after_vote", seconds=2.0)))),
                  lambda m: "training rank 0 died" in m, fast, "trainers"),
        FaultCase("vLLM worker 1 stalled past the timeout before its vote (silent peer)",
                  lambda c: c.driver.refit(faults=Faults(engine=EngineFault(1, Fault(
                      "sleep", at="before_vote", seconds=c.driver.refit_config.timeout_s + 2)))),
                  lambda m: "no vote" in m and "destination rank 1" in m, lambda t: t + FAST_ERROR_S),
        FaultCase("vLLM worker 1 stopped past the timeout and the engine's grace (unresponsive), then resumed",
                  # blocking: unresponsive after the timeout and the grace (7 s); overlapped: the
                  # swap waits for the worker's vote (it serves the old weights meanwhile) and
                  # fails when the worker resumes, on its no-vote abort
                  _stopped_worker, lambda m: "engine 0 is unresponsive" in m or (
                      "no vote" in m and "destination rank 1" in m), lambda t: STOP_S + FAST_ERROR_S, "resume"),
        FaultCase("three new drivers each label their refit 1 'refit-1'; the second is split by the store host's death",
                  _three_drivers, lambda m: "engine 0 is gated" in m, lambda t: 3 * FAST_ERROR_S + 2 * 60.0),
        FaultCase("a store writer deletes every vote, decision and copy as written; vLLM worker 1 reads 3 s late",
                  # the coordinator decides (commit once it caught every "ok", else abort at its
                  # deadline); a rank that voted ok and cannot read that is unsure (gated)
                  _persistent_writer, lambda m: "could not learn the refit's decision" in m or "engine 0 is gated" in m,
                  lambda t: WRITER_TIMEOUT_S + 3.0 + 2.0 + FAST_ERROR_S),
        FaultCase("every abort hint deleted as written; training rank 1 raises mid-transfer",
                  _raising_trainer_without_hints, lambda m: "injected failure" in m and "unresponsive" not in m, fast),
        FaultCase("a refit fails at finish_weight_update; a plain caller's start_weight_update right after",
                  _start_after_failed_finish, lambda m: "checksum mismatch" in m and "already active" not in m, fast),
        # last: the engine is gone afterwards and is replaced
        FaultCase("vLLM worker 1 dies mid-transfer",
                  lambda c: c.driver.refit(faults=Faults(engine=EngineFault(1, exit_after_writes=3))),
                  # every rank of the refit knows at once; vLLM's core then waits on the dead
                  # worker's reply without a deadline, so the driver names the engine
                  # unresponsive after its grace (driver.ENGINE_GRACE_S) once every trainer is
                  # done: refused until it answers, which a dead worker's engine never does
                  lambda m: "engine 0 is dead" in m or "engine 0 is unresponsive" in m,
                  lambda t: ENGINE_GRACE_S + 2 * FAST_ERROR_S, "engine"),
    ]


#: The store-writer row's refit timeout (short: its unsure ranks wait it out, plus the grace).
WRITER_TIMEOUT_S = 6.0


def _persistent_writer(c: Any) -> None:
    """An outside writer on the refit store (a client of training rank 0's store: no secret)
    deletes every vote, decision and signed copy as soon as each is written, and vLLM worker 1
    reads the decision 3 s late (``testing.attacks.Deleter``)."""
    from mcore_reshard.testing.attacks import Deleter
    from mcore_reshard.wire.faults import EngineFault, Fault, Faults

    d = c.driver
    with Deleter(_store_client(c), ("vote", "decision", "decided")):
        d.refit(request=replace(d.request(), timeout_s=WRITER_TIMEOUT_S),
                faults=Faults(engine=EngineFault(1, Fault("sleep", at="after_vote", seconds=3.0))))


def _raising_trainer_without_hints(c: Any) -> None:
    """Training rank 1's refit fails mid-transfer (it posts its abort and votes no) while an
    outside writer deletes every abort hint as it appears: the ranks still waiting for its bytes
    find the abort by the slow scan, and the engine, which answers, is not named unresponsive."""
    from mcore_reshard.testing.attacks import Deleter
    from mcore_reshard.wire.faults import Faults, TrainerFault

    with Deleter(_store_client(c), ("hint",)):
        c.driver.refit(faults=Faults(TrainerFault(1, raise_after_reads=5)))


def _store_client(c: Any) -> Any:
    """A client of the refit group's store, as any process on the network can open one."""
    from datetime import timedelta

    import torch.distributed as dist

    d = c.driver
    d.ensure_connected()
    return dist.TCPStore(d.join_info.host, d.join_info.port, is_master=False, timeout=timedelta(seconds=10))


def _start_after_failed_finish(c: Any) -> None:
    """A refit that fails at ``finish_weight_update`` (a flipped bit), then what a plain caller
    does next: ``start_weight_update`` -- refused ("already active") while vLLM left the raising
    worker's session open -- and ``finish_weight_update``. Raises the refit's error."""
    from mcore_reshard.errors import RefitFailed
    from mcore_reshard.wire.faults import Fault, Faults, TrainerFault

    try:
        c.driver.refit(faults=Faults(TrainerFault(0, Fault("bitflip", bucket=1))))
    except RefitFailed as exc:
        failed = exc
    else:
        raise RuntimeError("the refit with a flipped bit committed")
    llm = c.engines[0]
    llm.start_weight_update()
    llm.finish_weight_update()
    raise failed


#: The stopped-worker row: its refit's timeout and the engine's grace (short, so that the row
#: does not wait the configured timeout twice), and how long the worker stays stopped.
STOP_TIMEOUT_S, STOP_GRACE_S, STOP_S = 5.0, 2.0, 14.0


def _stopped_worker(c: Any) -> None:
    """Worker 1 stops answering before its vote, past the refit's timeout and the engine's
    grace: the driver names the engine unresponsive and sends it nothing until its stuck call
    returns (then readmits it, gated, without a new driver: ``restart="resume"``)."""
    from mcore_reshard.refit.driver import ENGINE_GRACE_S
    from mcore_reshard.wire.faults import EngineFault, Faults
    from mcore_reshard.wire.faults import Fault

    d = c.driver
    d.engine_grace_s = STOP_GRACE_S
    try:
        d.refit(request=replace(d.request(), timeout_s=STOP_TIMEOUT_S),
                faults=Faults(engine=EngineFault(1, Fault("sleep", at="before_vote", seconds=STOP_S))))
    finally:
        d.engine_grace_s = ENGINE_GRACE_S


def _new_driver(c: Any) -> Any:
    """A new driver on the same trainers and engines (a restarted framework): it numbers its
    refits from 1 again."""
    from mcore_reshard.refit.driver import RefitDriver

    config = c.driver.refit_config
    c.driver.close()
    c.driver = RefitDriver(c.pool, c.engines, config, c.spec, transport=c.transports[c.refit.transport])
    c.driver.__enter__()
    return c.driver


def _three_drivers(c: Any) -> None:
    """Driver A's refit 1 commits, driver B's refit 1 is split by the store host's death
    (worker 0 commits, worker 1 cannot learn the decision), driver C (after the trainers are
    restarted) fails its refit 1 cleanly. All three label their refit "refit-1": the engine
    must stay gated, whatever the labels say. Raises C's error."""
    from mcore_reshard.errors import RefitFailed
    from mcore_reshard.wire.faults import EngineFault, Faults, TrainerFault
    from mcore_reshard.wire.faults import Fault

    a = _new_driver(c)
    a.refit(request=replace(a.request(), version="refit-1"))
    c.step(_TOKENS)
    b = _new_driver(c)
    try:
        b.refit(request=replace(b.request(), version="refit-1"),
                faults=Faults(TrainerFault(0, Fault("exit", at="after_decision", seconds=0.5)),
                              EngineFault(1, Fault("sleep", at="after_vote", seconds=2.0))))
    except RefitFailed:
        pass
    c.restart_trainers()
    c.driver.refit_config = b.refit_config
    d = c.driver
    d.refit(request=replace(d.request(), version="refit-1", plan_digest="0" * 16))


#: The fault matrix's prompt (``_three_drivers`` takes an optimizer step on it).
_TOKENS: list[int] = []


def _classify(now: Any, old: list[float], new: list[float], bound: float) -> str:
    from mcore_reshard.refit.verify import token_mult_prob_error

    if isinstance(now, str):
        return now
    if now == old:
        return "old"
    if token_mult_prob_error(now, new) <= bound:
        return "new"
    return "MIXED"


def _through_enqueue(llm: Any, tokens: list[int]) -> tuple[Any, Any]:
    """``enqueue`` + ``wait_for_completion`` (``testing.clients.Enqueued``): the prompt's logprobs,
    or "refused (queued, no model step)" and the request still waiting for them."""
    from mcore_reshard.testing.clients import Enqueued

    req = Enqueued(llm, tokens)
    if req.waiting(3.0):
        return "refused (queued, no model step)", req
    return req.logprobs(), None


def fault_row(c: Any, tokens: list[int], case: FaultCase, atomic: bool, bound: float,
              log: Callable[..., None]) -> dict[str, Any]:
    from mcore_reshard.adapters.vllm.engine import check_serving, prompt_logprobs
    from mcore_reshard.errors import EngineUnresponsive, RefitIncomplete

    row: dict[str, Any] = {"fault": case.name, "atomic": atomic, "seconds": None, "error": "", "names_ok": False,
                           "generate": "", "enqueue": "", "idle": "", "restored": "no", "notes": []}
    c.driver.refit_config = replace(c.refit, atomic=atomic)
    try:
        c.refit_once()  # engine and trainers on the same weights, group healthy
        c.step(tokens)  # new weights on the trainers, the old ones in the engine
        llm = c.engines[0]
        old = prompt_logprobs(llm, tokens)
        new = c.pool.logprobs([tokens]).wait()[0][0]
    except Exception as exc:  # noqa: BLE001
        row["notes"].append(f"set-up failed: {type(exc).__name__}: {str(exc)[:300]}")
        row["behaved"] = False
        return row
    _TOKENS[:] = tokens
    t0 = time.monotonic()
    try:
        case.provoke(c)
        row["error"] = "(no error raised)"
    except Exception as exc:  # noqa: BLE001 - the expected outcome
        row["error"] = f"{type(exc).__name__}: {exc}"
        row["names_ok"] = case.names(str(exc))
    row["seconds"] = time.monotonic() - t0
    log(f"fault {case.name!r} (atomic={atomic}): {row['seconds']:.2f}s: {row['error'][:300]}")
    waiting = None
    if case.restart != "engine":
        try:
            check_serving(llm)
            now: Any = prompt_logprobs(llm, tokens)
        except RefitIncomplete:
            now = "refused (gated)"
        except EngineUnresponsive:
            now = "refused at once (unresponsive)"
        row["generate"] = _classify(now, old, new, bound)
        try:
            now, waiting = _through_enqueue(llm, tokens)
            row["enqueue"] = _classify(now, old, new, bound)
        except Exception as exc:  # noqa: BLE001
            row["enqueue"] = f"error: {type(exc).__name__}: {str(exc)[:100]}"
    else:
        row["generate"] = row["enqueue"] = "engine dead (replaced)"
    row["idle"] = idle_after(c, case)
    try:
        if case.restart == "engine":
            replace_engine(c)
        elif case.restart == "trainers":
            row["survivors_exit_s"] = survivors_exit(c)
            row["notes"].append(f"the surviving training ranks left in {row['survivors_exit_s']:.2f}s")
            c.restart_trainers()
        elif case.restart == "resume":
            row["readmitted_after_s"] = wait_readmitted(c, t0)
            row["notes"].append(f"readmitted by the same driver {row['readmitted_after_s']:.1f}s after the fault")
        m = c.refit_once()
        err = c.logprob_error(tokens)
        row["restore"] = {"seconds": m.seconds, "verified": m.verified, "bytes_ok": m.at_minimum, "delta": m.delta,
                          "token_mult_prob_error": err}
        row["restored"] = "yes" if (m.verified and m.at_minimum and err <= bound) else "no"
        if waiting is not None:  # the queued request ran after the restoring refit, on its weights only
            ran = waiting.logprobs(60.0)
            row["enqueue"] += "; ran after the restore on the restored weights" if ran == prompt_logprobs(
                c.engines[0], tokens) else "; ran after the restore on OTHER weights"
    except Exception as exc:  # noqa: BLE001
        row["restore"] = {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}
    c.driver.refit_config = c.refit
    log(f"fault {case.name!r}: generate={row['generate']} enqueue={row['enqueue']} restored={row['restored']}")
    row["max_seconds"] = case.max_seconds(c.refit.timeout_s)
    row["in_time"] = row["seconds"] <= row["max_seconds"]
    served_ok = all(not v.startswith(("MIXED", "error")) and "OTHER" not in v for v in (row["generate"], row["enqueue"]))
    row["behaved"] = bool(row["error"] != "(no error raised)" and row["names_ok"] and row["in_time"] and served_ok
                          and row["restored"] == "yes" and row.get("survivors_exit_s", 0.0) < FAST_ERROR_S
                          and row["idle"] == "yes")
    return row


def idle_after(c: Any, case: FaultCase) -> str:
    """"yes" when, once the failure settled, no thread of a surviving refit process -- the
    engine's workers, the training ranks alive -- uses CPU (``testing.idle``); else the busy
    threads. A dead engine's workers are gone (its trainers are measured)."""
    from mcore_reshard.testing.idle import busy

    pids = [p.pid for p in getattr(c.pool, "procs", []) if p.is_alive()]
    if case.restart != "engine" and c.driver.engine_infos[0].diagnostics and 0 not in c.driver.dead:
        try:
            pids += [int(i["pid"]) for i in c.engines[0].collective_rpc("mr_rank_info", timeout=30)]
        except Exception as exc:  # noqa: BLE001 - named in the row
            return f"workers not asked: {type(exc).__name__}"
    time.sleep(1.5)  # vLLM's workers poll their queue for a second after each call
    hot = busy(pids, seconds=1.5)
    return "yes" if not hot else "BUSY " + ", ".join(f"{k}: {v:.2f} cores" for k, v in hot.items())


def survivors_exit(c: Any) -> float:
    """Seconds the training ranks still alive after a rank died take to leave (pool close)."""
    t0 = time.monotonic()
    c.pool.close()
    return time.monotonic() - t0


def wait_readmitted(c: Any, since: float, limit_s: float = 60.0) -> float:
    """Wait until the driver takes its unresponsive engine back; seconds since ``since``."""
    while c.driver.dead and time.monotonic() - since < limit_s:
        c.driver.readmit()
        time.sleep(0.5)
    return time.monotonic() - since


def replace_engine(c: Any) -> None:
    """A dead engine is replaced by a new one on the same checkpoint, with a new trainer pool
    and driver (as a framework restarts a failed rollout worker)."""
    from mcore_reshard.adapters.vllm.engine import start_engine, stop_engine
    from mcore_reshard.adapters.vllm.plugin import BACKEND
    from mcore_reshard.adapters.vllm.worker import REFIT_EXTENSION

    for llm in c.engines:
        try:
            stop_engine(llm)
        except Exception:  # noqa: BLE001 - it is dead already
            pass
    c.engines[:] = [start_engine(str(c.checkpoint), tp=c.vllm.tp, dtype=c.spec.dtype, enable_ep=c.vllm.enable_ep,
                                 direct=c.refit.apply_mode == "direct", worker_extension_cls=REFIT_EXTENSION,
                                 weight_transfer_config={"backend": BACKEND}) for _ in range(c.vllm.replicas)]
    c.restart_trainers()


def control_plane_rows(log: Callable[..., None]) -> list[dict[str, Any]]:
    """Faults only a second process on the store can cause, tried on a live two-rank group of
    this process: a signed vote of the previous refit replayed into this one, and garbage at
    the key of a rank's abort. No engine is involved; the rows say what each rank decided."""
    import secrets
    import threading

    import torch

    from mcore_reshard.errors import RefitAborted
    from mcore_reshard.infra.ports import free_port
    from mcore_reshard.testing.attacks import STORE_ATTACKS
    from mcore_reshard.transport.group import RankMap, RefitGroup

    def pair() -> dict[int, Any]:
        rm, port, nonce, groups = RankMap.disaggregated(1, 1), free_port(), secrets.token_hex(8), {}
        th = threading.Thread(target=lambda: groups.update({1: RefitGroup.create(
            "127.0.0.1", port, 1, 2, 10.0, False, rank_map=rm, secret="job", nonce=nonce)}))
        th.start()
        groups[0] = RefitGroup.create("127.0.0.1", port, 0, 2, 10.0, True, rank_map=rm, secret="job", nonce=nonce)
        th.join(20)
        return groups

    rows = []
    g = pair()
    try:
        for x in g.values():
            x.control.begin_refit(1)
        th = threading.Thread(target=lambda: g[1].control.decide(True, None))
        th.start()
        g[0].control.decide(True, None)
        th.join(10)
        replay = g[0].store.get(g[0].control._slot("vote", 1, 0, 1))
        for x in g.values():
            x.control.begin_refit(2)
        g[0].store.set(g[0].control._slot("vote", 2, 0, 1), replay)  # rank 1 failed and never votes
        t0 = time.monotonic()
        d = g[0].control.decide(True, None, timeout_s=1.0)
        rows.append({"fault": "replayed signed 'ok' vote of the previous refit", "atomic": "n/a",
                     "seconds": time.monotonic() - t0, "error": "; ".join(d.errors), "names_ok": True,
                     "generate": "n/a (no engine)", "enqueue": "n/a (no engine)", "restored": "n/a",
                     "notes": [f"rejected values: {dict(g[0].rejected)}"],
                     "behaved": (not d.commit) and g[0].rejected["vote"] >= 1})
    finally:
        for x in g.values():
            x.close(barrier=False)
    g = pair()
    try:
        for x in g.values():
            x.control.begin_refit(1)
        g[0].store.set(g[0].control._slot("abort", 1, 0, 1), "garbage")
        g[0].store.add(g[0].control._slot("hint", 1, 0, -1), 7)
        work = g[0].recv(torch.empty(1), 1, 9)
        threading.Timer(0.3, g[1].post_abort, args=("source rank 1: failed",)).start()
        t0 = time.monotonic()
        try:
            g[0].wait_work(work, 10.0)
            err = "(no abort)"
        except RefitAborted as exc:
            err = str(exc)
        secs = time.monotonic() - t0
        rows.append({"fault": "garbage at a rank's abort key, then its real abort", "atomic": "n/a", "seconds": secs,
                     "error": err, "names_ok": "source rank 1" in err, "generate": "n/a (no engine)",
                     "enqueue": "n/a (no engine)", "restored": "n/a", "notes": [f"rejected: {dict(g[0].rejected)}"],
                     "behaved": "source rank 1" in err and secs < 2.0})
    finally:
        for x in g.values():
            x.close(barrier=False)
    rows += [store_attack_row(attack) for attack in STORE_ATTACKS]
    for r in rows:
        secs = "hung" if r["seconds"] is None else f"{r['seconds']:.2f}s"
        log(f"control plane: {r['fault']}: {r['error'][:200]} ({secs})")
    return rows


def store_attack_row(attack: Callable[[], Any]) -> dict[str, Any]:
    """One store writer's attack (``testing.attacks``) as a row: it behaved when every rank was
    done in time (never hung) and no rank aborted where another committed (a rank that cannot
    learn the decision is ``unknown``: its engine stays gated, never serves a mix)."""
    a = attack()
    outcomes = [o if isinstance(o, str) else "exchanged" for o in a.outcomes]
    split = "commit" in outcomes and "abort" in outcomes
    err = "; ".join(sorted({e for e in a.errors if e})) or "(none)"
    return {"fault": f"store writer: {a.name}", "atomic": "n/a", "seconds": a.slowest, "error": err,
            "names_ok": True, "generate": "n/a (no engine)", "enqueue": "n/a (no engine)", "restored": "n/a",
            "notes": [f"ranks: {', '.join(outcomes)}", f"rejected: {a.rejected}"],
            "behaved": a.slowest is not None and a.slowest < a.limit_s and not split and "hung" not in outcomes}


def faults(c: Any, tokens: list[int], bound: float, log: Callable[..., None], only: str = "") -> list[dict[str, Any]]:
    """Every case in both commit modes (atomic and streaming; with ``refit.overlap`` atomic only:
    an overlapped refit cannot stream); the engine-killing case once, last; then the
    control-plane rows."""
    cases = [c_ for c_ in _cases() if only in c_.name]
    modes = (True,) if c.refit.overlap else (True, False)
    rows = [fault_row(c, tokens, case, atomic, bound, log) for atomic in modes
            for case in cases if case.restart != "engine"]
    rows += [fault_row(c, tokens, case, True, bound, log) for case in cases if case.restart == "engine"]
    return rows + (control_plane_rows(log) if not only else [])


# -- report ---------------------------------------------------------------------------------------

def table(res: dict[str, Any]) -> str:
    from mcore_reshard.plan.report import format_bytes

    s = res["soak"]
    f = lambda x: "n/a" if x is None else f"{x:.3f}"  # noqa: E731
    lines = ["", f"soak: {res['model']} ({res['dtype']}) {res['training']} -> {res['vllm']}, "
             f"verify {res['verify']}, buffer {format_bytes(res['buffer_bytes'])}, "
             f"an optimizer step before every refit i with i % {res['step_every']} == 0 ({s['steps']} steps)",
             f"refits ok: {s['refits_ok']}/{s['refits']} (all verified: {s['all_verified']}, "
             f"every refit at the minimum (a delta at most its changes): {s['all_bytes_min']}); soak wall time {s['soak_wall_seconds']:.1f}s",
             f"seconds per refit: median {f(s['seconds_median'])}, p95 {f(s['seconds_p95'])}, max {f(s['seconds_max'])}; "
             f"median of first 10 {f(s['seconds_first10_median'])} vs last 10 {f(s['seconds_last10_median'])}",
             f"token_mult_prob_error after the last refit: {s['token_mult_prob_error']:.6f} "
             f"(bound {res['bound']})", ""]
    head = f"{'process':<28} {'rss@refit ' + str(next(iter(s['rss_growth'].values()), {}).get('from_refit', '?')):>14} " \
           f"{'rss@refit ' + str(s['refits']):>14} {'growth':>9}"
    lines += [head, "-" * len(head)]
    for k, g in s["rss_growth"].items():
        lines.append(f"{k:<28} {format_bytes(g['rss_from']):>14} {format_bytes(g['rss_to']):>14} {g['growth_pct']:>8.2f}%")
    if res.get("faults") is not None:
        lines += ["", "| fault | atomic | s until every rank knew | generate served | enqueue served | "
                      "idle after | next refit restored | ok |", "|---|---|---|---|---|---|---|---|"]
        for r in res["faults"]:
            secs = "n/a" if r["seconds"] is None else f"{r['seconds']:.2f}"
            lines.append(f"| {r['fault']} | {r['atomic']} | {secs} | {r['generate']} | {r['enqueue']} | "
                         f"{r.get('idle') or 'n/a'} | {r['restored']} | {'yes' if r['behaved'] else 'NO'} |")
        lines.append("")
        for r in res["faults"]:
            extra = [f"error: {' '.join(r['error'].split())[:240]}"]
            if not r["names_ok"]:
                extra.append("error does not name the failing rank/parameter as expected")
            if not r.get("in_time", True):
                extra.append(f"took longer than {r['max_seconds']:.0f}s")
            if isinstance(r.get("restore"), dict) and "error" in r["restore"]:
                extra.append(f"restore: {r['restore']}")
            extra += r["notes"]
            lines.append(f"  {r['fault']} (atomic={r['atomic']}): " + "; ".join(str(e) for e in extra))
    lines += ["", f"RESULT: {'PASS' if res['ok'] else 'FAIL'} (total wall time {res['wall_seconds']:.1f}s, "
              f"cluster start {res['startup_seconds']:.1f}s)"]
    return "\n".join(lines)


def run(args: argparse.Namespace, workdir: Path, log: Callable[..., None]) -> dict[str, Any]:
    from mcore_reshard.settings.config import load_refit_job
    from mcore_reshard.layout import load_model_spec
    from mcore_reshard.jobs.refit import TOKEN_MULT_PROB_BOUND, _checkpoint, local_cluster

    t_start = time.perf_counter()
    job = load_refit_job(list(args.overrides))
    ckpt = _checkpoint(job, workdir)
    spec = load_model_spec(ckpt, dtype=job.dtype)
    tokens = [int(t) % spec.vocab for t in job.tokens]
    bound = TOKEN_MULT_PROB_BOUND[job.dtype]
    res: dict[str, Any] = {"model": spec.name, "dtype": job.dtype, "verify": job.refit.verify.value,
                           "buffer_bytes": job.refit.buffer_bytes, "step_every": args.step_every, "bound": bound}
    t0 = time.perf_counter()
    with local_cluster(spec, ckpt, job.training, job.vllm, job.refit, train={"lr": job.lr}) as c:
        res["startup_seconds"] = time.perf_counter() - t0
        res["training"], res["vllm"] = c.driver.src.name, c.driver.dst.name
        log(f"cluster ready in {res['startup_seconds']:.1f}s")
        res["soak"] = soak(c, tokens, args, log)
        res["faults"] = faults(c, tokens, bound, log, args.only) if args.faults else None
    s = res["soak"]
    ok = s["refits_ok"] == s["refits"] and s["token_mult_prob_error"] <= bound
    if res["faults"] is not None:
        ok = ok and all(r["behaved"] for r in res["faults"])
    res["ok"] = bool(ok)
    res["wall_seconds"] = time.perf_counter() - t_start
    return res


def main() -> int:
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    args = parse_args()
    write = stdout_to_stderr()
    log = lambda *a: print(*a, file=sys.stderr, flush=True)  # noqa: E731
    try:
        with tempfile.TemporaryDirectory(prefix="mcore_reshard_soak_") as tmp:
            res = run(args, Path(tmp), log)
    except Exception as exc:  # noqa: BLE001 - one clear line (and the JSON object) instead of a bare traceback
        traceback.print_exc()
        msg = f"{type(exc).__name__}: {exc}"
        write(json.dumps({"ok": False, "error": msg}) if args.json else f"error: {msg}")
        return 1
    if args.json:
        out = dict(res)
        out["soak"] = {k: v for k, v in res["soak"].items() if k != "rss_samples"}
        write(json.dumps(out, default=str))
    else:
        write(table(res))
    return 0 if res["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
