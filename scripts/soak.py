"""Soak test: many refits into one running vLLM engine, then (``--faults``) a fault matrix.

    python scripts/soak.py [--refits 100] [--step-every 10] [--json] [--faults] [key=value ...]

The local job of ``configs/refit.yaml`` (trailing ``key=value`` are Hydra overrides of it; the
tiny checkpoint is written to a temp dir, as ``mcore-reshard refit`` does): megatron-core ranks
-> vLLM engine(s). ``--refits N`` refits run back to back, an optimizer step before every
``--step-every``-th one, so the served weights really change. Per refit: seconds, bytes moved ==
the minimum, verified, and the RSS of every process (this one and all its children) right after
it. Reported: refits ok, seconds per refit (median, p95, max, median of the first 10 vs the last
10), RSS growth per process from refit 10 to refit N, token_mult_prob_error after the last refit.

``--faults``: on the same cluster, after the soak, one row per fault -- provoke it, time the
driver's error, check the error names the failing rank (and for a bit flip the parameter), check
the engine then serves exactly the weights it served before the fault (or refuses with a clear
error), then one normal refit must verify and restore service. Rows: one bit flipped in flight; a
refit request naming a plan digest no rank holds (every rank must stop within seconds, not at
the timeout); last, since it breaks the trainer pool, a training rank dying mid-refit.

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
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable

from bench_refit import stdout_to_stderr  # scripts/ is on sys.path when run as a script

#: A refused refit (nothing moved) must stop every rank within this; a bit flip too (an abort
#: signal, not the timeout).
FAST_ERROR_S = 10.0


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--refits", type=int, default=100, help="refits in the soak (default 100)")
    ap.add_argument("--step-every", type=int, default=10, help="an optimizer step before every K-th refit")
    ap.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    ap.add_argument("--faults", action="store_true", help="after the soak, run the fault matrix")
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
            row.update(seconds=m.seconds, bytes_moved=m.bytes_moved, bytes_min=m.bytes_min, verified=m.verified,
                       bytes_ok=m.bytes_moved == m.bytes_min, peak_extra_bytes=m.peak_extra_bytes,
                       ok=bool(m.verified and m.bytes_moved == m.bytes_min), error="")
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

def refit_with_digest(d: Any, digest: str) -> Any:
    """A refit whose request names ``digest`` (a plan no rank holds): every rank must refuse."""
    return d.refit(request=replace(d.request(), plan_digest=digest))


def fault_row(c: Any, tokens: list[int], name: str, provoke: Callable[[], Any], names_ok: Callable[[str], bool],
              max_seconds: float, restore: bool, bound: float, log: Callable[..., None]) -> dict[str, Any]:
    from mcore_reshard.adapters.vllm.engine import prompt_logprobs

    row: dict[str, Any] = {"fault": name, "seconds": None, "error": "", "names_ok": False, "served": "",
                           "status": None, "restored": "n.a.", "notes": []}
    try:
        c.refit_once()  # engine and trainers on the same weights, group healthy
        c.step(tokens)  # new weights on the trainers, the old ones in the engine
        old = [prompt_logprobs(llm, tokens) for llm in c.engines]
    except Exception as exc:  # noqa: BLE001
        row["notes"].append(f"set-up failed: {type(exc).__name__}: {str(exc)[:300]}")
        row["behaved"] = False
        return row
    t0 = time.monotonic()
    try:
        provoke()
        row["seconds"] = time.monotonic() - t0
        row["error"] = "(no error raised)"
        row["notes"].append("the faulty refit did not raise")
    except Exception as exc:  # noqa: BLE001 - the expected outcome
        row["seconds"] = time.monotonic() - t0
        row["error_type"] = type(exc).__name__
        row["error"] = str(exc)
        row["names_ok"] = names_ok(str(exc))
    log(f"fault {name!r}: {row['seconds']:.2f}s: {row['error'][:300]}")
    try:
        row["status"] = c.driver.status()
        if c.refit.atomic and not all(st.get("state") == "serving" and st.get("committed") is False
                                      for st in row["status"]):
            row["notes"].append(f"driver.status() after the fault is not 'serving, committed=False' on every "
                                f"worker: {row['status']}")
    except Exception as exc:  # noqa: BLE001
        row["status"] = f"{type(exc).__name__}: {str(exc)[:200]}"
        row["notes"].append(f"driver.status() failed: {row['status']}")
    try:
        now = [prompt_logprobs(llm, tokens) for llm in c.engines]
        row["served"] = "old weights" if now == old else "WRONG"
        if now != old:
            row["notes"].append("max |logprob diff| vs before the fault: "
                                f"{max(abs(a - b) for x, y in zip(now, old) for a, b in zip(x, y)):.3g}")
    except Exception as exc:  # noqa: BLE001 - a refusal is fine when it says why
        msg = f"{type(exc).__name__}: {str(exc)}".strip()
        row["served"] = "refused"
        row["refusal"] = msg[:300]
    if restore:
        try:
            m = c.refit_once()
            err = c.logprob_error(tokens)
            row["restore"] = {"seconds": m.seconds, "verified": m.verified, "bytes_ok": m.bytes_moved == m.bytes_min,
                              "token_mult_prob_error": err}
            row["restored"] = "yes" if (m.verified and m.bytes_moved == m.bytes_min and err <= bound) else "no"
        except Exception as exc:  # noqa: BLE001
            row["restored"] = "no"
            row["restore"] = {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}
        log(f"fault {name!r}: restore: {row['restore']}")
    row["in_time"] = row["seconds"] is not None and row["seconds"] <= max_seconds
    row["max_seconds"] = max_seconds
    refusal_clear = row["served"] == "refused" and len(row.get("refusal", "")) > 10
    row["behaved"] = bool(row["error"] != "(no error raised)" and row["names_ok"] and row["in_time"]
                          and (row["served"] == "old weights" or refusal_clear)
                          and (row["restored"] in ("yes", "n.a.")))
    return row


def faults(c: Any, tokens: list[int], bound: float, log: Callable[..., None]) -> list[dict[str, Any]]:
    from mcore_reshard.transport.executor import Fault

    d = c.driver
    timeout = c.refit.timeout_s
    wrong = "0" * 16
    rows = [
        fault_row(c, tokens, "bit flipped in flight (training rank 0, bucket 1)",
                  lambda: d.refit(trainer_command="refit_with_fault", trainer_args=(0, Fault("bitflip", bucket=1))),
                  lambda m: "checksum mismatch" in m and "rank" in m and "model." in m,
                  FAST_ERROR_S, True, bound, log),
        fault_row(c, tokens, "stale plan digest (refused refit)",
                  lambda: refit_with_digest(d, wrong),
                  lambda m: ("training rank" in m or "destination rank" in m) and wrong in m,
                  FAST_ERROR_S, True, bound, log),
        # last: the pool has a dead rank afterwards
        fault_row(c, tokens, "training rank 1 dies mid-refit",
                  lambda: d.refit(trainer_command="refit_and_die", trainer_args=(1, 5)),
                  lambda m: "training rank 1 died" in m,
                  timeout + 15, False, bound, log),
    ]
    return rows


# -- report ---------------------------------------------------------------------------------------

def table(res: dict[str, Any]) -> str:
    from mcore_reshard.plan.report import format_bytes

    s = res["soak"]
    f = lambda x: "n/a" if x is None else f"{x:.3f}"  # noqa: E731
    lines = ["", f"soak: {res['model']} ({res['dtype']}) {res['training']} -> {res['vllm']}, "
             f"verify {res['verify']}, buffer {format_bytes(res['buffer_bytes'])}, "
             f"an optimizer step before every refit i with i % {res['step_every']} == 0 ({s['steps']} steps)",
             f"refits ok: {s['refits_ok']}/{s['refits']} (all verified: {s['all_verified']}, "
             f"all bytes_moved == bytes_min: {s['all_bytes_min']}); soak wall time {s['soak_wall_seconds']:.1f}s",
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
        head = f"{'fault':<52} {'s to error':>10}  {'error (first 100 chars)':<100}  {'served after fault':<18} {'restored':<8} ok"
        lines += ["", head, "-" * len(head)]
        for r in res["faults"]:
            err = " ".join(r["error"].split())[:100]
            secs = "n/a" if r["seconds"] is None else f"{r['seconds']:.2f}"
            lines.append(f"{r['fault']:<52} {secs:>10}  {err:<100}  {r['served']:<18} {r['restored']:<8} "
                         f"{'yes' if r['behaved'] else 'NO'}")
        for r in res["faults"]:
            extra = []
            if not r["names_ok"]:
                extra.append("error does not name the failing rank/parameter as expected")
            if not r.get("in_time", True):
                extra.append(f"took longer than {r['max_seconds']:.0f}s")
            if r.get("refusal"):
                extra.append(f"refusal: {r['refusal'][:200]}")
            if isinstance(r.get("restore"), dict) and r["restore"]:
                extra.append(f"restore: {r['restore']}")
            extra += r["notes"]
            if extra:
                lines.append(f"  {r['fault']}: " + "; ".join(str(e) for e in extra))
    lines += ["", f"RESULT: {'PASS' if res['ok'] else 'FAIL'} (total wall time {res['wall_seconds']:.1f}s, "
              f"cluster start {res['startup_seconds']:.1f}s)"]
    return "\n".join(lines)


def run(args: argparse.Namespace, workdir: Path, log: Callable[..., None]) -> dict[str, Any]:
    from mcore_reshard.config import load_refit_job
    from mcore_reshard.layout import load_model_spec
    from mcore_reshard.refit import TOKEN_MULT_PROB_BOUND, _checkpoint, local_cluster

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
        res["faults"] = faults(c, tokens, bound, log) if args.faults else None
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
