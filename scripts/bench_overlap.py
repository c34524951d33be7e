"""Blocking vs overlapped refits (``refit.overlap``), side by side in one session.

    python scripts/bench_overlap.py [--json] [--repeats 3] [--tiny] [--buffer-mib 128] [--workdir DIR] [key=value ...]

The bench model of ``bench_refit.py`` (a ~1.15 GB random Qwen3-MoE, megatron TP2 x EP2 into one
vLLM engine TP2 run as ``AsyncLLM``, the engine behind ``vllm serve``; ``--tiny``: the tiny MoE
of ``make demo``). A greedy decode workload (two streamed requests) runs on the engine in each
of three phases per round: alone; across a blocking refit (the engine serves nothing from its
pause to its resume: ``pause_seconds``, about the whole refit); across an overlapped refit
(the engine pauses only for the swap).

Printed (median over the rounds): per mode the refit's seconds and the engine's pause, the
ratio of the overlapped pause to the blocking refit (target <= 5 %, a PASS/FAIL line), the
largest gap between two tokens a client saw (idle, across each kind of refit), and the
workload's tokens/s in each phase. On a 2-core machine the background receive and the decode
share the cores, so the decode slows while bytes move; the ratio says by how much. Not a test:
numbers are printed whether or not the target is met.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_refit import BENCH_MODEL, bench_main, checkpoint  # noqa: E402

TARGET_PAUSE_OF_BLOCKING = 0.05  # overlapped pause <= 5 % of the blocking refit's time
PROMPTS = [[11, 42, 7, 99, 123, 5, 77, 300], [8, 64, 512, 3, 250, 17, 901, 46]]


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    ap.add_argument("--repeats", type=int, default=3, help="timed rounds (one refit of each mode per round)")
    ap.add_argument("--tiny", action="store_true", help="the tiny MoE of make demo instead of the bench model")
    ap.add_argument("--decode-tokens", type=int, default=96, help="greedy tokens per request of the workload")
    ap.add_argument("--buffer-mib", type=int, default=128, help="refit.buffer_bytes in MiB")
    ap.add_argument("--workdir", default=None, help="where the checkpoint goes (reused when it matches)")
    ap.add_argument("overrides", nargs="*", help="Hydra overrides of configs/refit.yaml")
    return ap.parse_args()


async def _stream(engine: Any, prompts: list[list[int]], n: int, started: Any) -> list[list[float]]:
    """Greedy requests for every prompt at once, streamed (vLLM's ``AsyncLLM``, as a server's
    clients see it): the arrival time of each prompt's every token."""
    import asyncio
    import uuid

    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    sp = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, output_kind=RequestOutputKind.DELTA)

    async def one(prompt: list[int]) -> list[float]:
        times: list[float] = []
        async for out in engine.generate({"prompt_token_ids": prompt}, sp, request_id=uuid.uuid4().hex):
            times.extend([time.perf_counter()] * len(out.outputs[0].token_ids))
            if len(times) >= 4:
                started.set()
        return times

    return list(await asyncio.gather(*(one(p) for p in prompts)))


def _decode(times: list[list[float]]) -> tuple[float, float]:
    """(tokens/s over the workload, the largest gap between two tokens of one request)."""
    t0, t1 = min(t[0] for t in times), max(t[-1] for t in times)
    gap = max(b - a for t in times for a, b in zip(t, t[1:]))
    return sum(map(len, times)) / (t1 - t0), gap


def run(args: argparse.Namespace, log: Callable[..., None]) -> dict[str, Any]:
    import threading
    from dataclasses import replace

    from mcore_reshard.adapters.vllm.engine import start_async_engine, stop_engine
    from mcore_reshard.adapters.vllm.plugin import BACKEND
    from mcore_reshard.adapters.vllm.worker import REFIT_EXTENSION
    from mcore_reshard.infra.checkpoint import make_tiny_checkpoint
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
    engine = start_async_engine(str(ckpt), tp=job.vllm.tp, dtype=job.dtype, direct=job.refit.apply_mode == "direct",
                                worker_extension_cls=REFIT_EXTENSION, weight_transfer_config={"backend": BACKEND})
    blocking_cfg, overlap_cfg = replace(job.refit, overlap=False), replace(job.refit, overlap=True)
    rounds: list[dict[str, float]] = []
    try:
        with local_cluster(spec, ckpt, job.training, job.vllm, blocking_cfg, train={"lr": job.lr},
                           engines=[engine]) as c:

            def workload(during: Callable[[], Any] | None = None) -> tuple[float, float, Any]:
                """The decode workload, with ``during()`` run on this thread once it is decoding."""
                started = threading.Event()
                fut = engine.submit(_stream(engine.engine, prompts, args.decode_tokens, started))
                started.wait(120)
                got = during() if during is not None else None
                tps, gap = _decode(fut.result(timeout=600))
                return tps, gap, got

            def refit(cfg: Any) -> Any:
                c.driver.refit_config = cfg
                return c.driver.refit()

            refit(blocking_cfg)  # warm-up: join, first touch
            workload()
            for i in range(args.repeats):
                idle_tps, idle_gap, _ = workload()
                block_tps, block_gap, blocking = workload(lambda: refit(blocking_cfg))
                over_tps, over_gap, overlapped = workload(lambda: refit(overlap_cfg))
                assert blocking.verified and overlapped.verified and overlapped.overlapped
                rounds.append({"blocking_seconds": blocking.seconds, "blocking_pause_seconds": blocking.pause_seconds,
                               "overlapped_seconds": overlapped.seconds,
                               "overlapped_pause_seconds": overlapped.pause_seconds,
                               "idle_tokens_per_s": idle_tps, "blocking_tokens_per_s": block_tps,
                               "during_tokens_per_s": over_tps, "idle_max_gap_seconds": idle_gap,
                               "blocking_max_gap_seconds": block_gap, "overlapped_max_gap_seconds": over_gap,
                               "shadow_peak_extra_bytes": overlapped.peak_extra_bytes,
                               "bytes_moved": overlapped.bytes_moved, "bytes_min": overlapped.bytes_min})
                log(f"round {i + 1}/{args.repeats}: blocking {blocking.seconds:.3f}s (engine paused "
                    f"{blocking.pause_seconds:.3f}s, largest token gap {block_gap:.3f}s); overlapped "
                    f"{overlapped.seconds:.3f}s (engine paused {overlapped.pause_seconds * 1e3:.1f} ms, largest gap "
                    f"{over_gap * 1e3:.1f} ms); decode {idle_tps:.1f} tok/s idle, {block_tps:.1f} with a blocking "
                    f"refit, {over_tps:.1f} with an overlapped one")
    finally:
        stop_engine(engine)
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
        f"  blocking refit            {m['blocking_seconds']:.3f} s; engine paused {m['blocking_pause_seconds']:.3f} s",
        f"  overlapped refit          {m['overlapped_seconds']:.3f} s; engine paused "
        f"{m['overlapped_pause_seconds'] * 1e3:.1f} ms (pause, swap, status, prefix cache, version, resume)",
        f"  pause / blocking refit    {res['pause_of_blocking'] * 100:.2f} %  "
        f"{'PASS' if res['pause_pass'] else 'FAIL'} (target <= {res['pause_target'] * 100:.0f} %)",
        f"  largest token gap         {m['idle_max_gap_seconds'] * 1e3:.1f} ms idle, "
        f"{m['blocking_max_gap_seconds'] * 1e3:.1f} ms across a blocking refit, "
        f"{m['overlapped_max_gap_seconds'] * 1e3:.1f} ms across an overlapped one",
        f"  decode tokens/s           {m['idle_tokens_per_s']:.1f} idle, {m['blocking_tokens_per_s']:.1f} with a "
        f"blocking refit, {m['during_tokens_per_s']:.1f} with an overlapped one ({res['decode_during_of_idle']:.2f}x idle)",
        f"  shadow + buffers (peak)   {m['shadow_peak_extra_bytes'] / 2**20:.1f} MiB per rank; bytes moved "
        f"{m['bytes_moved'] / 2**20:.1f} MiB (minimum {m['bytes_min'] / 2**20:.1f} MiB)",
    ])


def main() -> int:
    return bench_main(parse_args(), run, table)


if __name__ == "__main__":
    sys.exit(main())
