"""A Megatron-FSDP policy refitting one vLLM engine, against the same policy without FSDP, side by
side in one session.

    python scripts/bench_fsdp.py [--json] [--repeats 5] [--workdir DIR]

The bench model (``bench_refit.py``: a random-weight Qwen3-MoE, hidden 1024, 8 layers, 16
experts, vocab 32000: about 287M parameters, 1.15 GB in fp32) on two megatron-core training
ranks, data-parallel 2, refits a vLLM TP1 engine (the same engine for every layout):

* ``fsdp``: Megatron-FSDP (``use_custom_fsdp``, ``optim_grads_params``): each rank holds only its
  rows of every parameter, and sends them;
* ``ddp``: megatron's DDP with the distributed optimizer and its overlapped parameter all-gather
  (NeMo RL's settings): both ranks hold every parameter whole (the planner picks one replica
  per piece by load) once the refit has forced the all-gather the next forward would run
  (``Policy.sync_params``: each rank updated only its own shard in the step);
* ``ddp-gathered``: the same with ``overlap_param_gather=False``: the optimizer step gathers, so
  the refit finds the parameters whole (the all-gather is paid in the step instead).

Each refit sends whole boxes (``delta=off``), verified by checksums, after a warm-up refit. Printed
per layout: bytes moved against the engine's minimum, the most any training rank sent, the peak
extra memory on a training rank (packing buffers: a bucket at most, never a parameter), refit
seconds (median) and the ratio to ``ddp``'s. Not a test: the numbers are printed whatever they are.

``--json`` prints exactly one JSON object on stdout; everything else (vLLM logs) goes to stderr.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_refit import BENCH_MODEL, bench_main, bench_parser  # noqa: E402

#: layout -> (Megatron-FSDP, TrainSettings overrides)
LAYOUTS = {"fsdp": (True, {}), "ddp": (False, {}), "ddp-gathered": (False, {"overlap_param_gather": False})}


def parse_args() -> argparse.Namespace:
    ap = bench_parser(__doc__, 5, "timed refits per layout")
    ap.add_argument("--order", default=",".join(LAYOUTS), help="the layouts, in the order they run")
    return ap.parse_args()


def run(args: argparse.Namespace, log: Callable[..., None]) -> dict[str, Any]:
    from mcore_reshard.adapters.megatron.rules import MegatronParallel
    from mcore_reshard.adapters.vllm.engine import start_engine, stop_engine
    from mcore_reshard.adapters.vllm.plugin import BACKEND
    from mcore_reshard.adapters.vllm.rules import VllmParallel
    from mcore_reshard.adapters.vllm.worker import REFIT_EXTENSION
    from mcore_reshard.infra.checkpoint import make_tiny_checkpoint
    from mcore_reshard.jobs.refit import local_cluster
    from mcore_reshard.layout import load_model_spec
    from mcore_reshard.settings.policy import RefitConfig

    path = Path(args.workdir) / "bench-moe-fp32"
    if not (path / "config.json").exists():
        make_tiny_checkpoint(path, overrides=BENCH_MODEL, moe=True, dtype="float32")
    spec = load_model_spec(path, dtype="float32")
    refit = RefitConfig(buffer_bytes=args.buffer_mib << 20, timeout_s=600.0, delta="off")
    llm = start_engine(str(path), tp=1, dtype="float32", worker_extension_cls=REFIT_EXTENSION,
                       weight_transfer_config={"backend": BACKEND})
    out: dict[str, Any] = {"model_params": sum(math.prod(s) for s, _ in spec.tensor_table().values()),
                           "layouts": {}}
    try:
        for layout in args.order.split(","):
            fsdp, settings = LAYOUTS[layout]
            training = MegatronParallel(dp=2, fsdp=fsdp)
            with local_cluster(spec, path, training, VllmParallel(tp=1), refit, train={"lr": 1e-3, **settings},
                               engines=[llm]) as c:
                c.refit_once()  # warm-up: joins, first touch
                runs = []
                for i in range(args.repeats):
                    m = c.refit_once()
                    src = [r for r in c.driver.last_reports if r.side == "src"]
                    assert m.verified and m.at_minimum
                    runs.append({"seconds": m.seconds, "bytes": m.bytes_moved, "min": m.bytes_min,
                                 "max_sent": max(r.bytes_sent for r in src),
                                 "peak_extra": max(r.peak_extra_bytes for r in src), "phases": m.phases})
                    log(f"{layout} refit {i}: {m.seconds:.3f}s")
            out["layouts"][layout] = {
                "bytes": runs[-1]["bytes"], "bytes_min": runs[-1]["min"],
                "max_sent": max(r["max_sent"] for r in runs), "peak_extra": max(r["peak_extra"] for r in runs),
                "median_s": statistics.median(r["seconds"] for r in runs),
                "seconds": [r["seconds"] for r in runs],
                "src_phases": {k: round(statistics.median(r["phases"].get(k, 0.0) for r in runs), 3)
                               for k in runs[-1]["phases"] if k.startswith("src_")}}
    finally:
        stop_engine(llm)
    base = out["layouts"]["ddp"]["median_s"]
    for r in out["layouts"].values():
        r["vs_ddp"] = r["median_s"] / base
    out["buffer_bytes"] = refit.buffer_bytes
    return out


def table(r: dict[str, Any]) -> str:
    from mcore_reshard.plan.report import format_bytes

    lines = [f"Megatron-FSDP vs DDP as a refit source: MoE of {r['model_params'] / 1e6:.0f}M parameters (fp32), "
             f"2 training ranks (dp=2) -> one vLLM TP1 engine, refit buffer {format_bytes(r['buffer_bytes'])}",
             f"{'layout':<13} {'moved':>12} {'minimum':>12} {'max sent/rank':>14} {'peak extra/rank':>16} "
             f"{'median s':>9} {'vs ddp':>7}"]
    for name, x in r["layouts"].items():
        lines.append(f"{name:<13} {format_bytes(x['bytes']):>12} {format_bytes(x['bytes_min']):>12} "
                     f"{format_bytes(x['max_sent']):>14} {format_bytes(x['peak_extra']):>16} {x['median_s']:>9.3f} "
                     f"{x['vs_ddp']:>6.2f}x")
    for name, x in r["layouts"].items():
        top = sorted(x["src_phases"].items(), key=lambda kv: -kv[1])[:4]
        lines.append(f"{name} training ranks' slowest phases (median s): " + ", ".join(f"{k} {v:.3f}" for k, v in top))
    return "\n".join(lines)


def main() -> int:
    return bench_main(parse_args(), run, table)


if __name__ == "__main__":
    sys.exit(main())
