"""The canary vote (``refit.canary``): what it costs, what it catches, and that it never cries wolf.

    python scripts/bench_canary.py [--soak 100] [--repeats 5] [--skip-bench] [--json]

Three parts, each printed as a table:

* **cost** on the bench model (``bench_refit.py``'s ~1.15 GB Qwen3-MoE, megatron TP2xEP2 ->
  vLLM TP2): reshard refits with the canary off, with its reference computed by the trainers
  before the refit (the first design), and deferred (the default: the trainers compute it inside
  the refit after their last byte, while the engines stage), the three alternating in one
  session, each after an optimizer step; the canary's own seconds on the trainers and on the
  engines (their phases in the reports), and each mode's whole refit against the refit without
  it, in % of the refit.
* **soak**: ``--soak`` refits of a tiny tied dense model in fp32 (TP2 -> TP2) and in bf16
  (TP1 -> TP1), each after an optimizer step, with the canary on: false alarms (must be 0)
  and the worst error seen against the bound.
* **detections**: each injected fault in its own refit (a layout with two heads swapped on
  both sides, post-load processing skipped for one layer, a tied head left stale) must fail
  the refit with the old weights served; checksums pass for all of them.

Not a test: numbers are printed whatever they are; ``tests/test_canary.py`` asserts the behaviour.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

TOKENS = [11, 42, 7, 99, 123, 5, 77, 300, 8, 64, 512, 3]


def cost(workdir: Path, repeats: int, bound: float, log: Any) -> dict[str, Any]:
    from bench_refit import BENCH_MODEL, checkpoint

    from mcore_reshard.jobs.refit import local_cluster
    from mcore_reshard.layout import load_model_spec
    from mcore_reshard.settings.config import load_refit_job

    job = load_refit_job([f"refit.buffer_bytes={128 << 20}", "refit.canary=true", f"refit.canary_bound={bound}"])
    ckpt = checkpoint(workdir, dict(BENCH_MODEL), job.dtype, job.seed)
    spec = load_model_spec(ckpt, dtype=job.dtype)
    toks = [t % spec.vocab for t in TOKENS]
    modes = ("off", "first", "deferred")
    rows: dict[str, list[float]] = {k: [] for k in (*modes, "reference_first", "reference_deferred", "engine",
                                                     "first_pct", "deferred_pct")}
    with local_cluster(spec, ckpt, job.training, job.vllm, job.refit, train={"lr": job.lr}) as c:
        d = c.driver
        for r in range(repeats + 1):
            pair: dict[str, float] = {}
            for mode in modes[r % 3:] + modes[:r % 3]:  # each mode first in turn
                c.step(toks)
                t0 = time.perf_counter()
                request = replace(d.request(), canary=None if mode == "off" else d.canary(now=mode == "first"))
                t_ref = time.perf_counter() - t0  # first: the trainers' reference, computed here
                m = d.refit(request)
                pair[mode] = time.perf_counter() - t0
                assert m.verified
                if mode == "first":
                    pair["reference_first"] = t_ref
                if mode == "deferred":
                    pair["reference_deferred"] = m.phases.get("src_canary_reference", 0.0)
                    pair["engine"] = m.phases.get("dst_canary", 0.0)
            if r == 0:
                continue  # warm-up
            pair["first_pct"] = pair["first"] / pair["off"] - 1.0
            pair["deferred_pct"] = pair["deferred"] / pair["off"] - 1.0
            for k, v in pair.items():
                rows[k].append(v)
            log(f"round {r}: off {pair['off']:.3f}s, reference first {pair['first']:.3f}s "
                f"({pair['reference_first']:.3f}s of it), deferred {pair['deferred']:.3f}s "
                f"(trainers' reference {pair['reference_deferred']:.3f}s, engines' phase {pair['engine']:.3f}s)")
    med = {k: statistics.median(v) for k, v in rows.items()}
    return {"median": med, "rounds": rows}


def _cluster(ckpt: Path, dtype: str, tp: int, lr: float = 0.05) -> Any:
    from mcore_reshard.adapters.megatron.rules import MegatronParallel
    from mcore_reshard.adapters.vllm.rules import VllmParallel
    from mcore_reshard.jobs.refit import local_cluster
    from mcore_reshard.layout import load_model_spec
    from mcore_reshard.settings.policy import RefitConfig

    spec = load_model_spec(ckpt, dtype=dtype)
    return local_cluster(spec, ckpt, MegatronParallel(tp=tp), VllmParallel(tp=tp),
                         RefitConfig(timeout_s=60.0, canary=True), train={"lr": lr})


def soak(workdir: Path, n: int, lr: float, log: Any) -> dict[str, Any]:
    from mcore_reshard.errors import RefitFailed
    from mcore_reshard.infra.checkpoint import make_tiny_checkpoint

    out = {}
    for dtype, tp in (("float32", 2), ("bfloat16", 1)):
        ckpt = make_tiny_checkpoint(workdir / f"soak-{dtype}", overrides={"tie_word_embeddings": True},
                                    dtype=dtype, seed=5)
        alarms, worst, seconds, canary = 0, 1.0, [], []
        with _cluster(ckpt, dtype, tp, lr) as c:
            bound = c.driver.request().canary.bound
            for i in range(n):
                c.step(TOKENS)
                t0 = time.perf_counter()
                try:
                    m = c.refit_once()
                    seconds.append(time.perf_counter() - t0)
                    canary.append(m.phases.get("dst_canary", 0.0))
                except RefitFailed as exc:
                    alarms += 1
                    log(f"{dtype} refit {i}: FALSE ALARM {str(exc)[:300]}")
                    continue
                if i % 10 == 9:
                    worst = max(worst, c.logprob_error(TOKENS))
        out[dtype] = {"refits": n, "lr": lr, "false_alarms": alarms, "bound": bound, "worst_error_after": worst,
                      "refit_s": statistics.median(seconds) if seconds else None,
                      "canary_s": statistics.median(canary) if canary else None}
        log(f"soak {dtype}: {out[dtype]}")
    return out


def detections(workdir: Path, log: Any) -> dict[str, Any]:
    from mcore_reshard.adapters.vllm.engine import prompt_logprobs
    from mcore_reshard.errors import RefitFailed
    from mcore_reshard.infra.checkpoint import make_tiny_checkpoint
    from mcore_reshard.testing.wrong_layouts import swap_canonical_rows
    from mcore_reshard.wire.faults import EngineFault, Faults

    ckpt = make_tiny_checkpoint(workdir / "detect", overrides={"tie_word_embeddings": True}, dtype="float32", seed=5)
    out = {}
    with _cluster(ckpt, "float32", 2) as c:
        d = c.driver
        c.refit_once()
        dst = [p.name for p in d.dst.params]

        def one(name: str, run: Any, last: bool = False) -> None:
            c.step(TOKENS)
            old = prompt_logprobs(c.engines[0], TOKENS)
            try:
                run()
                out[name] = {"caught": False}
            except RefitFailed as exc:
                line = str(exc)
                out[name] = {"caught": "CanaryFailed" in line or "canary" in line,
                             "old_weights_served": prompt_logprobs(c.engines[0], TOKENS) == old,
                             "line": line[line.find("engine of"):][:160]}
            log(f"{name}: {out[name]}")
            if not last:  # the engine heals with a correct refit (the untied head stays: last)
                c.refit_once()

        good = d.src

        def swapped() -> None:
            hd = c.spec.head_dim
            d.src = swap_canonical_rows(good, "model.layers.0.self_attn.v_proj.weight", 0, hd, hd)
            d.make_plan()
            try:
                d.refit()
            finally:
                d.src = good
                d.make_plan()

        one("two heads swapped on both sides", swapped)
        o_proj = next(n for n in dst if n.endswith("layers.1.self_attn.o_proj.weight"))
        one("post-load processing skipped (o_proj)",
            lambda: d.refit(faults=Faults(engine=EngineFault(rank=(0, 1), skip_processing=o_proj))))
        one("tied head updated on one side only",
            lambda: d.refit(faults=Faults(engine=EngineFault(rank=(0, 1), untie_head=True))), last=True)
    return out


def table(res: dict[str, Any]) -> str:
    lines = [""]
    if "cost" in res:
        m = res["cost"]["median"]
        lines += ["canary cost on the bench model (median of rounds, the three modes alternating)",
                  f"  refit, canary off                    {m['off'] * 1e3:9.1f} ms",
                  f"  refit, reference computed first      {m['first'] * 1e3:9.1f} ms   "
                  f"(+{m['first_pct'] * 100:.1f} % of the refit; the reference {m['reference_first'] * 1e3:.1f} ms)",
                  f"  refit, reference deferred (default)  {m['deferred'] * 1e3:9.1f} ms   "
                  f"(+{m['deferred_pct'] * 100:.1f} % of the refit)",
                  f"    trainers' reference, in the refit  {m['reference_deferred'] * 1e3:9.1f} ms",
                  f"    engines' canary phase              {m['engine'] * 1e3:9.1f} ms", ""]
    if "soak" in res:
        lines.append(f"{'soak':<10} {'lr':>7} {'refits':>6} {'false alarms':>12} {'bound':>7} {'worst err':>10} {'refit':>8} {'canary':>8}")
        for dtype, s in res["soak"].items():
            lines.append(f"{dtype:<10} {s['lr']:>7g} {s['refits']:>6} {s['false_alarms']:>12} {s['bound']:>7} "
                         f"{s['worst_error_after']:>10.6f} {s['refit_s'] * 1e3:>6.1f}ms {s['canary_s'] * 1e3:>6.1f}ms")
        lines.append("")
    if "detections" in res:
        lines.append(f"{'injected fault':<42} {'caught':>7} {'old served':>10}")
        for name, r in res["detections"].items():
            lines.append(f"{name:<42} {str(r['caught']):>7} {str(r.get('old_weights_served', '')):>10}")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--soak", type=int, default=100, help="refits per dtype in the soak (0: none)")
    ap.add_argument("--lr", type=float, default=1e-3, help="the soak's learning rate (every step changes every weight)")
    ap.add_argument("--repeats", type=int, default=5, help="paired rounds on the bench model")
    ap.add_argument("--skip-detections", action="store_true", help="no injected faults")
    ap.add_argument("--skip-bench", action="store_true", help="no cost rounds on the bench model")
    ap.add_argument("--bound", type=float, default=0.0, help="refit.canary_bound of the cost rounds (0: the precision's)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    from bench_refit import stdout_to_stderr

    write = stdout_to_stderr()  # vLLM's logs go to stderr; the table (or JSON) alone to stdout
    log = lambda *a: print(*a, file=sys.stderr, flush=True)  # noqa: E731
    res: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="mcore_reshard_canary_") as tmp:
        work = Path(tmp)
        if not args.skip_detections:
            res["detections"] = detections(work, log)
        if args.soak:
            res["soak"] = soak(work, args.soak, args.lr, log)
        if not args.skip_bench:
            res["cost"] = cost(work, args.repeats, args.bound, log)
    write(json.dumps(res) if args.json else table(res))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
