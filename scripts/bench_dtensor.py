"""A DTensor policy (FSDP2, TP, neither) refitting one vLLM engine, side by side in one session.

    python scripts/bench_dtensor.py [--json] [--repeats 5] [--workdir DIR]

A dense random-weight Qwen2 of the bench model's size (``bench_refit.py``: hidden 1024, 8
layers, vocab 32000; a dense MLP of intermediate 8192 in place of the experts: about 287M
parameters, 1.15 GB in fp32) on two gloo training ranks, built as NeMo RL's DTensor backend
builds it (``testing.dtensor``), refits a vLLM TP1 engine through vLLM's trainer API
(``TrainerShards(DTensorEndpoint(model, spec))``), in three layouts of the same policy:

* ``fsdp2``: ``fully_shard`` over dp=2 (each rank holds half of every parameter);
* ``tp2``: ``parallelize_module`` over tp=2 (half of every projection, the rest replicated);
* ``replicated``: both ranks hold the whole model (data parallel without FSDP).

Each refit sends whole boxes (``delta=off``), verified by checksums. Printed per layout: bytes
moved against the engine's minimum, the most any training rank sent, the peak extra memory on
a source rank (packing buffers: a bucket, never a parameter), refit seconds (median) and their
ratio to the replicated layout's; for ``fsdp2`` also what a gather-first refit pays before
sending a byte (``full_tensor()`` of every parameter on every rank, as an HF-conversion path
does). Not a test: the numbers are printed whatever they are.

``--json`` prints exactly one JSON object on stdout; everything else (vLLM logs) goes to stderr.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_lora import DENSE_MODEL  # noqa: E402 - the bench model's size, its experts as one dense MLP
from bench_refit import stdout_to_stderr  # noqa: E402
LAYOUTS = {"fsdp2": (2, 1, True), "tp2": (1, 2, True), "replicated": (2, 1, False)}  # dp, tp, fully_shard


def bench_job(ctx: Any, ckpt: str, layout: str, info: dict, repeats: int, calls: Any, replies: Any) -> dict:
    """One layout on one training rank: a warm-up refit, then ``repeats`` timed ones."""
    import torch
    import torch.distributed as dist
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    from mcore_reshard.adapters.dtensor import DTensorEndpoint
    from mcore_reshard.adapters.vllm.backend import ReshardTrainerInitInfo, TrainerShards
    from mcore_reshard.layout import load_model_spec
    from mcore_reshard.testing.dtensor import build_dtensor_policy
    from mcore_reshard.testing.trainer_api import ForwardingClient

    dist.init_process_group("gloo", init_method=f"tcp://{ctx.master_addr}:{ctx.master_port}", rank=ctx.rank,
                            world_size=ctx.world_size)
    dp, tp, shard = LAYOUTS[layout]
    spec = load_model_spec(ckpt, dtype="float32")
    if shard:
        model = build_dtensor_policy(ckpt, dp, tp)
    else:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32)
    engine = WeightTransferTrainerFactory.trainer_init(
        ReshardTrainerInitInfo(rank=ctx.rank, **info), client=ForwardingClient(calls, replies),
        source=TrainerShards(DTensorEndpoint(model, spec)))
    seconds, sent, peak = [], [], []
    for r in range(repeats + 1):
        dist.barrier()
        t0 = time.perf_counter()
        engine.send_weights()
        if r:
            seconds.append(time.perf_counter() - t0)
    src = [x for x in engine.last_reports if x is not None and x.side == "src"]
    dst = [x for x in engine.last_reports if x is not None and x.side == "dst"]
    out = {"seconds": seconds, "bytes_min": engine.plans.plan.bytes_min,
           "received": sum(x.bytes_received - x.bytes_headers for x in dst),
           "max_sent": max(x.bytes_sent for x in src), "peak_extra": max(x.peak_extra_bytes for x in src),
           "verified": all(x.verified for x in engine.last_reports if x is not None)}
    engine.shutdown()
    if shard and dp > 1:  # what a gather-first path pays before its first byte
        dist.barrier()
        t0 = time.perf_counter()
        full = {n: p.full_tensor() for n, p in model.named_parameters()}
        out["gather_s"] = time.perf_counter() - t0
        out["gathered_bytes"] = sum(t.numel() * t.element_size() for t in full.values())
    dist.destroy_process_group()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    write = stdout_to_stderr()

    from mcore_reshard.adapters.vllm.engine import prompt_logprobs, start_engine, stop_engine
    from mcore_reshard.adapters.vllm.plugin import BACKEND
    from mcore_reshard.infra.checkpoint import make_tiny_checkpoint
    from mcore_reshard.plan.report import format_bytes
    from mcore_reshard.testing.trainer_api import drive_trainer_api
    from mcore_reshard.testing.worlds import run_world

    work = Path(args.workdir or tempfile.mkdtemp(prefix="mr_bench_dtensor_"))
    ckpt = work / "bench-dense-qwen2"
    if not ckpt.exists():
        make_tiny_checkpoint(ckpt, overrides=DENSE_MODEL, family="qwen2", dtype="float32")
    llm = start_engine(str(ckpt), tp=1, weight_transfer_config={"backend": BACKEND})
    info = {"engine_tp": 1, "timeout_s": 300.0, "delta": "off"}
    results: dict[str, Any] = {}
    try:
        for layout in LAYOUTS:
            ranks, _ = drive_trainer_api(llm, lambda q, layout=layout: run_world(
                bench_job, 2, (str(ckpt), layout, info, args.repeats) + q, timeout_s=1800, threads=1),
                lambda step: None)
            r0 = ranks[0]
            results[layout] = {**{k: v for k, v in r0.items() if k != "seconds"},
                               "median_s": statistics.median(r0["seconds"]), "seconds": r0["seconds"]}
            print(f"{layout}: {results[layout]}", file=sys.stderr)
        results["served_after"] = prompt_logprobs(llm, [11, 42, 7, 99, 123])[:2]
    finally:
        stop_engine(llm)
    base = results["replicated"]["median_s"]
    if args.json:
        write(json.dumps(results))
        return
    write("")
    write(f"{'layout':<11} {'moved':>10} {'minimum':>10} {'max sent/rank':>14} {'peak extra/rank':>16} "
          f"{'refit s':>8} {'vs replicated':>14}")
    for layout in LAYOUTS:
        r = results[layout]
        write(f"{layout:<11} {format_bytes(r['received']):>10} {format_bytes(r['bytes_min']):>10} "
              f"{format_bytes(r['max_sent']):>14} {format_bytes(r['peak_extra']):>16} {r['median_s']:>8.3f} "
              f"{r['median_s'] / base:>13.2f}x")
    f = results["fsdp2"]
    write(f"fsdp2 gather-first (full_tensor of every parameter, before any byte is sent): {f['gather_s']:.3f} s, "
          f"{format_bytes(f['gathered_bytes'])} materialized on every rank")
    write(f"every refit verified: {all(results[k]['verified'] for k in LAYOUTS)}")


if __name__ == "__main__":
    main()
