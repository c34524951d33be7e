"""Refit benchmark: reshard vs the HF-broadcast baseline, side by side, on a >= 1 GB model.

    python scripts/bench_refit.py [--json] [--repeats 3] [--buffer-mib 128] [--workdir DIR] [key=value ...]

A random-weight Qwen3-MoE (about 1.15 GB in fp32) goes from megatron-core TP2 x EP2 (ETP1, two
CPU processes) into one vLLM engine TP2 (``configs/refit.yaml``; trailing ``key=value`` are
Hydra overrides of it). Both transports run alternately in one session, so machine noise hits
both alike; one untimed warm-up round first. Reported per transport: bytes, seconds (median,
min), peak buffers, verification and token_mult_prob_error after its last refit (each of those
last refits follows an optimizer step, so it really changes the served weights). Also: the
raw gloo bandwidth of one message as large as a destination rank's reshard share (the local
floor) and where reshard's time goes (per-phase ``TransferStats`` plus the vLLM applier).

Targets follow the bytes, printed as PASS/FAIL lines: reshard <= 1.15 x the bandwidth bound
(busiest destination rank's bytes / the concurrent raw per-pair rate + vLLM's own apply time,
measured in the same run) and speedup (median of per-round ratios) >= 0.85 x the byte ratio
bytes_hf_broadcast / bytes_min; and the checksums cost <= 10 % of the refit (each round also
runs the reshard refit with ``verify=off``: the cost is the paired difference). Not a test: the numbers are printed whether or not a target
is met.

``--json`` prints exactly one JSON object on stdout; everything else (vLLM logs) goes to stderr.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any, Callable

#: ~287M parameters = 1.15 GB in fp32: 8 MoE layers of 16 experts (moe_intermediate 512),
#: GQA 16/4 heads of head_dim 64 (vLLM's CPU attention needs head_dim >= 32), vocab 32000.
BENCH_MODEL: dict[str, Any] = dict(
    hidden_size=1024,
    intermediate_size=2048,
    num_hidden_layers=8,
    num_attention_heads=16,
    num_key_value_heads=4,
    head_dim=64,
    vocab_size=32000,
    max_position_embeddings=512,
    num_experts=16,
    num_experts_per_tok=2,
    moe_intermediate_size=512,
)

#: Targets follow the bytes: a bandwidth-bound refit cannot beat the busiest destination
#: rank's bytes over the measured link rate (plus vLLM's own apply work), and its speedup over
#: the HF path cannot beat the byte ratio.
TARGET_OVER_BOUND = 1.15  # reshard seconds <= 1.15 x the bound
TARGET_OF_BYTE_RATIO = 0.85  # speedup >= 0.85 x bytes_hf_broadcast / bytes_min
TARGET_VERIFY_COST = 0.10  # checksums cost <= 10 % of the refit's wall time


# -- set-up ------------------------------------------------------------------------------------

def bench_parser(doc: str, repeats: int, rounds: str) -> argparse.ArgumentParser:
    """The options every benchmark here takes: --json, --repeats, --buffer-mib, --workdir."""
    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    ap.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    ap.add_argument("--repeats", type=int, default=repeats, help=rounds)
    ap.add_argument("--buffer-mib", type=int, default=128, help="refit.buffer_bytes in MiB")
    ap.add_argument("--workdir", default=None, help="where the checkpoint goes (reused when it matches)")
    return ap


def parse_args() -> argparse.Namespace:
    ap = bench_parser(__doc__, 5, "timed rounds (one refit of each transport per round)")
    ap.add_argument("--warmup", type=int, default=1, help="untimed rounds first (first-touch and join costs)")
    ap.add_argument("--layers", type=int, default=BENCH_MODEL["num_hidden_layers"], help="decoder layers")
    ap.add_argument("--experts", type=int, default=BENCH_MODEL["num_experts"], help="experts per layer")
    ap.add_argument("overrides", nargs="*", help="Hydra overrides of configs/refit.yaml, e.g. refit.verify=off")
    return ap.parse_args()


def model_overrides(args: argparse.Namespace) -> dict[str, Any]:
    return dict(BENCH_MODEL, num_hidden_layers=args.layers, num_experts=args.experts)


def checkpoint(workdir: Path, overrides: dict[str, Any], dtype: str, seed: int) -> Path:
    """Write the random checkpoint, or reuse one written with the same settings (saves ~30 s)."""
    from mcore_reshard.infra.checkpoint import make_tiny_checkpoint

    path = workdir / "bench-moe"
    stamp = path / "bench_settings.json"
    settings = json.dumps(dict(overrides, dtype=dtype, seed=seed), sort_keys=True)
    if stamp.is_file() and stamp.read_text() == settings and list(path.glob("*.safetensors")):
        return path
    make_tiny_checkpoint(path, overrides=overrides, moe=True, dtype=dtype, seed=seed)
    stamp.write_text(settings)
    return path


def stdout_to_stderr() -> Callable[[str], None]:
    """Point fd 1 at stderr for this process and every child it starts (vLLM logs to stdout);
    returns a writer to the real stdout, for the results only."""
    sys.stdout.flush()
    real = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)

    def write(text: str) -> None:
        real.write(text + "\n")
        real.flush()

    return write


class RssSampler:
    """Peak summed RSS of this process and its children (trainers, engine, workers): the
    machine is shared, and the HF baseline holds a whole extra model on one trainer."""

    def __init__(self, period_s: float = 0.2) -> None:
        self.peak = 0
        self.min_available = None  # the machine's MemAvailable low point (other users count too)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(period_s,), daemon=True)

    def __enter__(self) -> "RssSampler":
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join(timeout=2)

    def _run(self, period_s: float) -> None:
        import psutil

        me = psutil.Process()
        while not self._stop.wait(period_s):
            total = 0
            for p in [me] + me.children(recursive=True):
                try:
                    total += p.memory_info().rss
                except psutil.Error:
                    pass
            self.peak = max(self.peak, total)
            avail = psutil.virtual_memory().available
            self.min_available = avail if self.min_available is None else min(self.min_available, avail)


# -- the session ---------------------------------------------------------------------------------

def plan_decode_seconds(plan: Any) -> float:
    """What a worker pays once per layout when the plan is shipped: encode, decode + re-hash."""
    from mcore_reshard.plan.wire import slice_from_wire, slice_to_wire

    t0 = time.perf_counter()
    slice_from_wire(json.loads(json.dumps(slice_to_wire(plan.for_rank("dst", 0)))))
    return time.perf_counter() - t0


def run(args: argparse.Namespace, log: Callable[..., None]) -> dict[str, Any]:
    from mcore_reshard.settings.config import load_refit_job
    from mcore_reshard.layout import load_model_spec
    from mcore_reshard.jobs.refit import local_cluster

    job = load_refit_job([f"refit.buffer_bytes={args.buffer_mib << 20}", *args.overrides])
    workdir = Path(args.workdir)
    t0 = time.perf_counter()
    ckpt = checkpoint(workdir, model_overrides(args), job.dtype, job.seed)
    spec = load_model_spec(ckpt, dtype=job.dtype)
    tokens = [int(t) % spec.vocab for t in job.tokens]
    log(f"checkpoint {ckpt} ready in {time.perf_counter() - t0:.1f}s")
    with RssSampler() as rss:
        t0 = time.perf_counter()
        with local_cluster(spec, ckpt, job.training, job.vllm, job.refit, train={"lr": job.lr}) as c:
            log(f"engine(s) + trainers + plan + group ready in {time.perf_counter() - t0:.1f}s")
            bench = timed_rounds(c, args, log)
            bench["checks"] = check_round(c, tokens, log)
            bench["plan_decode_seconds"] = plan_decode_seconds(c.driver.plan)
            bench["plan"] = c.driver.plan
            names = (c.driver.src.name, c.driver.dst.name)
    bench["min_available_bytes"] = rss.min_available
    return summarize(bench, rss.peak, job, spec, names, args)


def one_refit(c: Any, transport: str) -> tuple[Any, dict[str, float]]:
    """One refit, with its per-phase seconds (slowest rank per phase). ``reshard_unverified``:
    the same refit without checksums (what the verification costs is the difference)."""
    if transport == "reshard_unverified":
        from mcore_reshard.wire.protocol import VerifyMode

        m = c.driver.refit(request=replace(c.driver.request(), verify=VerifyMode.OFF))
    else:
        m = c.refit_once(transport)
    return m, dict(m.phases)


def timed_rounds(c: Any, args: argparse.Namespace, log: Callable[..., None]) -> dict[str, Any]:
    """Warm-up rounds, then timed rounds: reshard, hf_broadcast, and the raw floors each round."""
    from mcore_reshard.wire.protocol import RankMap

    d = c.driver
    rank_map = RankMap.disaggregated(d.src.world_size, d.dst.world_size)
    one_pair = [(rank_map.group_rank("src", 0), rank_map.group_rank("dst", 0))]
    all_pairs = [(rank_map.group_rank("src", r % d.src.world_size), rank_map.group_rank("dst", r))
                 for r in range(d.dst.world_size)]
    per_dst = max(d.plan.recv_bytes())
    transports = ("reshard", "hf_broadcast") + (("reshard_unverified",) if c.driver.request().verify.checksums else ())
    out: dict[str, Any] = {"runs": {t: [] for t in transports}, "phases": {t: [] for t in transports},
                           "raw": [], "raw_concurrent": [], "per_dst": per_dst, "concurrent_pairs": len(all_pairs)}
    rounds = args.warmup + args.repeats
    for i in range(rounds):
        timed = i >= args.warmup
        for transport in transports:
            m, ph = one_refit(c, transport)
            log(f"round {i + 1}/{rounds}{'' if timed else ' (warm-up)'}: {transport:<18} {m.seconds:7.3f}s  "
                f"{_phase_line(ph)}")
            if timed:
                out["runs"][transport].append(m)
                out["phases"][transport].append(ph)
        if timed:
            out["raw"].append(c.raw_bandwidth(one_pair, per_dst))
            out["raw_concurrent"].append(c.raw_bandwidth(all_pairs, per_dst))
            log(f"round {i + 1}/{rounds}: raw gloo {per_dst / 2**20:.0f} MiB: {out['raw'][-1] / 1e9:.2f} GB/s one pair, "
                f"{out['raw_concurrent'][-1] / 1e9:.2f} GB/s per pair with {len(all_pairs)} pairs at once")
    return out


def check_round(c: Any, tokens: list[int], log: Callable[..., None]) -> dict[str, dict[str, Any]]:
    """After the timed rounds: per transport an optimizer step (so the engine serves stale
    weights), then one refit, then token_mult_prob_error -- the last refit of each transport
    must really replace the served weights."""
    checks = {}
    for transport in ("reshard", "hf_broadcast"):
        loss = c.step(tokens)
        stale = c.logprob_error(tokens)
        m, ph = one_refit(c, transport)
        err = c.logprob_error(tokens)
        checks[transport] = {"metrics": replace(m, token_mult_prob_error=err), "stale_token_mult_prob_error": stale, "loss": loss,
                             "phases": ph}
        log(f"check: {transport:<12} step loss {loss:.4f}, token_mult_prob_error {stale:.4g} stale -> {err:.6f} "
            f"after the refit ({m.seconds:.3f}s, verified={m.verified})  {_phase_line(ph)}")
    return checks


def _phase_line(ph: dict[str, float]) -> str:
    return " ".join(f"{k}={v:.3f}" for k, v in ph.items() if v >= 0.0005)


# -- report ----------------------------------------------------------------------------------------

def summarize(bench: dict[str, Any], peak_rss: int, job: Any, spec: Any, names: tuple[str, str],
              args: argparse.Namespace) -> dict[str, Any]:
    """The JSON object: per transport the ``refit --json`` keys (seconds = median of the timed
    rounds; token_mult_prob_error from the check round's refit), the comparison and the floor."""
    out: dict[str, Any] = {}
    unverified = bench["runs"].get("reshard_unverified", [])
    for transport, ms in bench["runs"].items():
        if transport == "reshard_unverified":
            continue
        check = bench["checks"][transport]
        secs = [m.seconds for m in ms]
        d = {k: v for k, v in asdict(check["metrics"]).items() if k != "notes"}
        d.update(seconds=statistics.median(secs), seconds_min=min(secs), seconds_all=secs,
                 transfer_seconds=statistics.median(m.transfer_seconds for m in ms),
                 peak_extra_bytes=max(m.peak_extra_bytes for m in ms + [check["metrics"]]),
                 verified=all(m.verified for m in ms + [check["metrics"]]),
                 check_seconds=check["metrics"].seconds,
                 check_phases=check["phases"],
                 stale_token_mult_prob_error=check["stale_token_mult_prob_error"],
                 phases_median={k: statistics.median(p[k] for p in bench["phases"][transport])
                                for k in bench["phases"][transport][0]})
        out[transport] = d
    r, h, per_dst = out["reshard"], out["hf_broadcast"], bench["per_dst"]
    raw_bps, raw_conc = statistics.median(bench["raw"]), statistics.median(bench["raw_concurrent"])
    achieved = per_dst / r["seconds"]
    plan = bench["plan"]
    # Per interleaved round: the ratio of the two transports measured side by side.
    ratios = [hm.seconds / rm.seconds for rm, hm in zip(bench["runs"]["reshard"], bench["runs"]["hf_broadcast"])]
    # vLLM's own apply work (layers back to model format, its processing/repack, the copy into
    # kernel tensors): both transports pay it, no transport can avoid it.
    apply_s = sum(r["phases_median"].get(k, 0.0) for k in ("dst_apply_open", "dst_apply_process", "dst_apply_commit"))
    bound = per_dst / raw_conc + apply_s
    # What the checksums cost: per interleaved round, (verified - unverified) / verified.
    costs = [(rm.seconds - um.seconds) / rm.seconds for rm, um in zip(bench["runs"]["reshard"], unverified)]
    if costs:
        out["reshard_unverified"] = {"seconds": statistics.median(m.seconds for m in unverified),
                                     "seconds_all": [m.seconds for m in unverified],
                                     "phases_median": {k: statistics.median(p[k] for p in bench["phases"]["reshard_unverified"])
                                                       for k in bench["phases"]["reshard_unverified"][0]}}
    gather_bytes = h["bytes_moved"] - plan.bytes_hf_broadcast
    out.update(
        speedup=h["seconds"] / r["seconds"],
        speedup_median=statistics.median(ratios),
        speedup_range=[min(ratios), max(ratios)],
        byte_ratio=plan.bytes_hf_broadcast / plan.bytes_min,
        byte_ratio_with_gather=h["bytes_moved"] / plan.bytes_min,
        hf_gather_bytes=gather_bytes,
        bound_seconds=bound,
        bound_apply_seconds=apply_s,
        fraction_of_bound=r["seconds"] / bound,
        verify_cost_fraction=statistics.median(costs) if costs else None,
        verify_cost_range=[min(costs), max(costs)] if costs else None,
        raw_bytes_per_s=raw_bps,
        fraction_of_raw=achieved / raw_bps,
        bytes_per_dst_rank=per_dst,
        reshard_bytes_per_s_per_dst=achieved,
        raw_bytes_per_s_all=bench["raw"],
        raw_concurrent_bytes_per_s=raw_conc,
        raw_concurrent_pairs=bench["concurrent_pairs"],
        fraction_of_raw_concurrent=achieved / raw_conc,
        targets={"reshard_over_bound_max": TARGET_OVER_BOUND, "speedup_over_byte_ratio_min": TARGET_OF_BYTE_RATIO,
                 "verify_cost_max": TARGET_VERIFY_COST},
        model={"name": spec.name, "bytes": spec.total_bytes(), "dtype": spec.dtype,
               "layers": args.layers, "experts": args.experts,
               "training": names[0], "vllm": names[1]},
        buffer_bytes=job.refit.buffer_bytes,
        verify=job.refit.verify.value,
        apply_mode=job.refit.apply_mode,
        repeats=args.repeats,
        plan_decode_seconds=bench["plan_decode_seconds"],
        peak_rss_bytes=peak_rss,
        min_available_bytes=bench["min_available_bytes"],
    )
    return out


def table(res: dict[str, Any]) -> str:
    from mcore_reshard.plan.report import format_bytes

    head = (f"{'transport':<13} {'moved':>10} {'minimum':>10} {'median s':>9} {'min s':>8} "
            f"{'peak buf':>10} {'verified':>8} {'tok_mult_prob_err':>17}")
    lines = ["", f"model {res['model']['name']} ({format_bytes(res['model']['bytes'])}, "
             f"{res['model']['dtype']}): {res['model']['training']} -> {res['model']['vllm']}, "
             f"buffer {format_bytes(res['buffer_bytes'])}, verify {res['verify']}, apply {res['apply_mode']}, "
             f"{res['repeats']} timed rounds", head, "-" * len(head)]
    for t in ("reshard", "hf_broadcast"):
        m = res[t]
        err = m["token_mult_prob_error"]
        lines.append(f"{t:<13} {format_bytes(m['bytes_moved']):>10} {format_bytes(m['bytes_min']):>10} "
                     f"{m['seconds']:>9.3f} {m['seconds_min']:>8.3f} {format_bytes(m['peak_extra_bytes']):>10} "
                     f"{str(m['verified']):>8} {err if err is None else f'{err:.6f}':>17}")
    ok = lambda good: "PASS" if good else "FAIL"  # noqa: E731
    lo, hi = res["speedup_range"]
    lines += [
        "",
        f"speedup hf_broadcast / reshard, per interleaved round: median {res['speedup_median']:.2f}x "
        f"(range {lo:.2f}x - {hi:.2f}x); byte ratio hf_broadcast / minimum {res['byte_ratio']:.2f}x "
        f"({res['byte_ratio_with_gather']:.2f}x with the HF path's gather)",
        f"bandwidth bound: busiest destination rank {format_bytes(res['bytes_per_dst_rank'])} / "
        f"{res['raw_concurrent_bytes_per_s'] / 1e9:.2f} GB/s per pair + vLLM apply {res['bound_apply_seconds']:.3f}s "
        f"= {res['bound_seconds']:.3f}s; reshard {res['reshard']['seconds']:.3f}s = {res['fraction_of_bound']:.2f}x the bound",
        f"{ok(res['fraction_of_bound'] <= TARGET_OVER_BOUND)}: reshard <= {TARGET_OVER_BOUND}x the bound "
        f"({res['fraction_of_bound']:.2f}x)",
        f"{ok(res['speedup_median'] >= TARGET_OF_BYTE_RATIO * res['byte_ratio'])}: speedup >= {TARGET_OF_BYTE_RATIO} x "
        f"byte ratio ({res['speedup_median']:.2f}x vs {TARGET_OF_BYTE_RATIO * res['byte_ratio']:.2f}x)",
        *([f"{ok(res['verify_cost_fraction'] <= TARGET_VERIFY_COST)}: checksums cost <= "
           f"{TARGET_VERIFY_COST:.0%} of the refit (median per round {res['verify_cost_fraction']:.1%}, range "
           f"{res['verify_cost_range'][0]:.1%} - {res['verify_cost_range'][1]:.1%}; unverified reshard "
           f"{res['reshard_unverified']['seconds']:.3f}s)"] if res.get("verify_cost_fraction") is not None else []),
        f"raw gloo send, {format_bytes(res['bytes_per_dst_rank'])} in one message: "
        f"{res['raw_bytes_per_s'] / 1e9:.2f} GB/s; reshard per destination rank "
        f"{res['reshard_bytes_per_s_per_dst'] / 1e9:.2f} GB/s = {100 * res['fraction_of_raw']:.0f}% of raw",
        f"  with all {res['raw_concurrent_pairs']} pairs sending at once (what a refit does): "
        f"{res['raw_concurrent_bytes_per_s'] / 1e9:.2f} GB/s per pair = {100 * res['fraction_of_raw_concurrent']:.0f}% of it",
        "",
        "where reshard's time goes (medians; slowest rank per phase; phases overlap):",
    ]
    ph = res["reshard"]["phases_median"]
    lines.append("  " + ", ".join(f"{k}={v:.3f}" for k, v in ph.items()))
    lines.append("  hf_broadcast: " + ", ".join(f"{k}={v:.3f}" for k, v in res["hf_broadcast"]["phases_median"].items()))
    lines.append(f"  driver overhead (seconds - slowest rank): reshard "
                 f"{res['reshard']['seconds'] - res['reshard']['transfer_seconds']:.3f}s; plan decode once per layout "
                 f"{res['plan_decode_seconds']:.3f}s; peak RSS of all processes {format_bytes(res['peak_rss_bytes'])}, "
                 f"machine's available memory low point {format_bytes(res['min_available_bytes'] or 0)}")
    ch = res["reshard"]["check_phases"]
    lines.append(f"  check round (refit right after an optimizer step): reshard {res['reshard']['check_seconds']:.3f}s "
                 f"(pack {ch.get('src_pack', 0):.3f}, apply {ch.get('dst_unpack', 0):.3f}), hf_broadcast "
                 f"{res['hf_broadcast']['check_seconds']:.3f}s")
    return "\n".join(lines)


def bench_main(args: argparse.Namespace, run: Callable[..., dict[str, Any]], table: Callable[[dict[str, Any]], str]) -> int:
    """Run ``run(args, log)`` (vLLM's logs on stderr) and print its table or one JSON object on
    stdout; the checkpoint goes away with the run unless ``--workdir`` keeps it."""
    write = stdout_to_stderr()
    log = lambda *a: print(*a, file=sys.stderr, flush=True)  # noqa: E731
    if args.workdir:
        res = run(args, log)
    else:
        with tempfile.TemporaryDirectory(prefix="mcore_reshard_bench_") as tmp:
            args.workdir = tmp
            res = run(args, log)
    write(json.dumps(res) if args.json else table(res))
    return 0


def main() -> int:
    return bench_main(parse_args(), run, table)


if __name__ == "__main__":
    sys.exit(main())
