"""Blocking vs overlapped refits (``refit.overlap``), side by side in one session.

    python scripts/bench_overlap.py [--json] [--repeats 3] [--tiny] [--buffer-mib 128] [--workdir DIR] [key=value ...]

The bench model of ``bench_refit.py`` (a ~1.15 GB random Qwen3-MoE, megatron TP2 x EP2 into one
vLLM engine TP2; ``--tiny``: the tiny MoE of ``make demo``). Each round runs, in turn:

- a blocking refit: the engine serves nothing from its pause to its resume (``pause_seconds``,
  about the whole refit);
- an overlapped refit with a fixed greedy decode workload run meanwhile on the same engine:
  the engine pauses only for the swap (``pause_seconds``), and the workload's tokens/s is set
  against the same workload on an idle engine, measured in the same round.

Printed: per mode the refit's seconds and the engine's unavailable seconds (median over the
rounds), the ratio of the overlapped pause to the blocking refit (target <= 5 %, a PASS/FAIL
line), and decode tokens/s idle vs during a background receive. On a 2-core machine the
background receive and the decode share the cores, so the decode slows while bytes move; the
ratio says by how much. Not a test: numbers are printed whether or not the target is met.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_refit import BENCH_MODEL, checkpoint, stdout_to_stderr  # noqa: E402

TARGET_PAUSE_OF_BLOCKING = 0.05  # overlapped pause <= 5 % of the blocking refit's time
PROMPTS = [[11, 42, 7, 99, 123, 5, 77, 300], [8, 64, 512, 3, 250, 17, 901, 46]]


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    ap.add_argument("--repeats", type=int, default=3, help="timed rounds (one refit of each mode per round)")
    ap.add_argument("--tiny", action="store_true", help="the tiny MoE of make demo instead of the bench model")
    ap.add_argument("--decode-tokens", type=int, default=32, help="greedy tokens per prompt of the workload")
    ap.add_argument("--buffer-mib", type=int, default=128, help="refit.buffer_bytes in MiB")
    ap.add_argument("--workdir", default=None, help="where the checkpoint goes (reused when it matches)")
    ap.add_argument("overrides", nargs="*", help="Hydra overrides of configs/refit.yaml")
    return ap.parse_args()


def run(args: argparse.Namespace, log: Callable[..., None]) -> dict[str, Any]:
    from mcore_reshard.adapters.vllm.engine import greedy
    from mcore_reshard.checkpoint import make_tiny_checkpoint
    from mcore_reshard.jobs.refit import local_cluster
    from mcore_reshard.layout import load_model_spec
    from mcore_reshard.settings.config import load_refit_job

    job = load_refit_job([f"refit.buffer_bytes={args.buffer_mib << 20}", *args.overrides])
    workdir = Path(args.workdir)
    if args.tiny:
        ckpt = make_tiny_checkpoint(workdir / "tiny-moe", moe=True, dtype=job.dtype, seed=job.seed)
    else:
        ckpt = checkpoint(workdir, dict(BENCH_MODEL), job.dtype, job.seed)
    spec = load_model_spec(ckpt, dtype=job.dtype)
    prompts = [[t % spec.vocab for t in p] for p in PROMPTS]
    rounds: list[dict[str, float]] = []
    with local_cluster(spec, ckpt, job.training, job.vllm, job.refit, train={"lr": job.lr}) as c:
        llm = c.engines[0]

        def workload() -> float:
            t0 = time.perf_counter()
            greedy(llm, prompts, args.decode_tokens)
            return len(prompts) * args.decode_tokens / (time.perf_counter() - t0)

        c.refit_once()  # warm-up: join, first touch
        workload()
        for i in range(args.repeats):
            blocking = c.refit_once()
            idle_tps = workload()
            overlapped, during_tps = c.refit_while(workload)
            assert blocking.verified and overlapped.verified and overlapped.overlapped
            rounds.append({"blocking_seconds": blocking.seconds, "blocking_pause_seconds": blocking.pause_seconds,
                           "overlapped_seconds": overlapped.seconds,
                           "overlapped_pause_seconds": overlapped.pause_seconds,
                           "idle_tokens_per_s": idle_tps, "during_tokens_per_s": during_tps,
                           "shadow_peak_extra_bytes": overlapped.peak_extra_bytes,
                           "bytes_moved": overlapped.bytes_moved, "bytes_min": overlapped.bytes_min})
            log(f"round {i + 1}/{args.repeats}: blocking {blocking.seconds:.3f}s (engine paused "
                f"{blocking.pause_seconds:.3f}s); overlapped {overlapped.seconds:.3f}s, engine paused "
                f"{overlapped.pause_seconds * 1e3:.1f} ms; decode {idle_tps:.1f} tok/s idle, {during_tps:.1f} during")
    med = {k: statistics.median(r[k] for r in rounds) for k in rounds[0]}
    ratio = med["overlapped_pause_seconds"] / med["blocking_seconds"]
    return {"model": "tiny-moe" if args.tiny else "bench-moe", "rounds": rounds, "median": med,
            "pause_of_blocking": ratio, "pause_target": TARGET_PAUSE_OF_BLOCKING,
            "pause_pass": ratio <= TARGET_PAUSE_OF_BLOCKING,
            "decode_during_of_idle": med["during_tokens_per_s"] / med["idle_tokens_per_s"]}


def table(res: dict[str, Any]) -> str:
    m = res["median"]
    return "\n".join([
        f"overlapped vs blocking refits, {res['model']}, median of {len(res['rounds'])} round(s)",
        f"  blocking refit            {m['blocking_seconds']:.3f} s; engine unavailable {m['blocking_pause_seconds']:.3f} s",
        f"  overlapped refit          {m['overlapped_seconds']:.3f} s; engine unavailable "
        f"{m['overlapped_pause_seconds'] * 1e3:.1f} ms (pause, swap, version, resume)",
        f"  pause / blocking refit    {res['pause_of_blocking'] * 100:.2f} %  "
        f"{'PASS' if res['pause_pass'] else 'FAIL'} (target <= {res['pause_target'] * 100:.0f} %)",
        f"  decode tokens/s           {m['idle_tokens_per_s']:.1f} idle, {m['during_tokens_per_s']:.1f} during a "
        f"background receive ({res['decode_during_of_idle']:.2f}x)",
        f"  shadow + buffers (peak)   {m['shadow_peak_extra_bytes'] / 2**20:.1f} MiB per rank; bytes moved "
        f"{m['bytes_moved'] / 2**20:.1f} MiB (minimum {m['bytes_min'] / 2**20:.1f} MiB)",
    ])


def main() -> int:
    args = parse_args()
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


if __name__ == "__main__":
    sys.exit(main())
