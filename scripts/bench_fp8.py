"""bf16 vs block-FP8 refits into the same layout, side by side in one run.

    python scripts/bench_fp8.py [--json] [--rounds 3] [--layers 8] [--experts 16] [--buffer-mib 128]

The bench model of ``bench_refit.py`` with 128-wide heads (8 query / 4 KV heads of 128, so every
shard on both sides is whole 128x128 blocks), random bf16 weights from N(0, 0.02), trained in
megatron-core TP2 x EP2 (bf16 ``Float16Module``, DDP, distributed optimizer) and refit into the
layout of one vLLM engine of TP2: once as a bf16 engine holds it, once as an ``fp8_per_block``
engine does (codes + fp32 block scales, the router, norms, embeddings and LM head in bf16), the
senders quantizing with vLLM's formula. The destinations are two processes holding that layout
(a live FP8 engine is `tests/test_fp8_live.py`, on CPUs with AMX tiles), so the numbers are the
transfer's: bytes, seconds (medians of ``--rounds``, the two kinds alternating), each sender's
quantization time, every refit verified by checksums. Then ``token_mult_prob_error`` of FP8
weights against the bf16 ones in one HF model (what the quantization alone costs the rollout
policy). Targets, PASS/FAIL: FP8 bytes of the quantized tensors <= 0.52 x their bf16 bytes.

``--json`` prints exactly one JSON object on stdout.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from itertools import product
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_refit import BENCH_MODEL, bench_main  # noqa: E402

WEIGHT_STD = 0.02
TARGET_RATIO = 0.52
#: ``BENCH_MODEL`` with heads of 128 (the hidden size and MLPs unchanged).
FP8_BENCH_MODEL = dict(BENCH_MODEL, num_attention_heads=8, num_key_value_heads=4, head_dim=128)
KINDS = ("bf16", "fp8")


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    ap.add_argument("--rounds", type=int, default=3, help="refits of each kind (alternating)")
    ap.add_argument("--layers", type=int, default=BENCH_MODEL["num_hidden_layers"], help="decoder layers")
    ap.add_argument("--experts", type=int, default=BENCH_MODEL["num_experts"], help="experts per layer")
    ap.add_argument("--buffer-mib", type=int, default=128, help="refit buffer per rank in MiB (a bucket is half)")
    ap.add_argument("--workdir", default=None, help="where the checkpoint goes")
    return ap.parse_args()


def trainer_job(ctx: Any, ckpt: str, par: Any, layouts: list, rounds: int, outboxes: list, bucket_bytes: int) -> dict:
    """One training rank: build the production stack, plan both layouts, refit them in turn."""
    import torch.distributed as dist

    from mcore_reshard.adapters.megatron.build import init_megatron
    from mcore_reshard.adapters.megatron.endpoint import TrainerEndpoint
    from mcore_reshard.adapters.megatron.train import TrainSettings, build_policy
    from mcore_reshard.adapters.vllm.rules import vllm_layout
    from mcore_reshard.infra.checkpoint import load_canonical
    from mcore_reshard.layout import SideLayout, load_model_spec
    from mcore_reshard.plan import build_plan, plan_report
    from mcore_reshard.plan.wire import slice_to_wire
    from mcore_reshard.infra.ports import free_port
    from mcore_reshard.wire.protocol import JoinInfo, RankMap, RefitRequest

    spec = load_model_spec(ckpt, dtype="bfloat16")
    init_megatron(par, ctx.rank, ctx.world_size, ctx.master_addr, ctx.master_port)
    policy = build_policy(spec, par, TrainSettings(dtype="bfloat16"))
    policy.load_canonical(load_canonical(ckpt))
    ep = TrainerEndpoint(policy.chunks, spec, sync_params=policy.sync_params)
    every: list = [None] * ctx.world_size
    dist.all_gather_object(every, ep.describe())
    src = SideLayout("megatron", ctx.world_size, tuple(p for r in every for p in r), spec.tensor_table())
    dsts = [vllm_layout(spec, v) for v in layouts]
    plans = [build_plan(src, d, bucket_bytes=bucket_bytes) for d in dsts]
    boxed = [free_port() if ctx.rank == 0 else None]
    dist.broadcast_object_list(boxed, src=0)
    rank_map = RankMap.disaggregated(src.world_size, dsts[0].world_size)
    info = JoinInfo("127.0.0.1", boxed[0], rank_map.world_size, rank_map, 300.0, secret="bench-fp8")
    seq = [(k, RefitRequest(plans[k].digest(), timeout_s=300.0, delta="off", epoch=e + 1))
           for e, (_, k) in enumerate(product(range(rounds), range(len(plans))))]
    if ctx.rank == 0:
        for r, box in enumerate(outboxes):
            box.put({"join": info.to_wire(), "digests": [p.digest() for p in plans],
                     "slices": [slice_to_wire(p.for_rank("dst", r)) for p in plans],
                     "seq": [(k, q.to_wire()) for k, q in seq]})
    ep.join(info)
    out = []
    for k, request in seq:
        ep.set_plan(slice_to_wire(plans[k].for_rank("src", ctx.rank)), plans[k].digest())
        t0 = time.perf_counter()
        report = ep.refit(request)
        out.append((k, time.perf_counter() - t0, report.to_wire()))
    ep.leave()
    fp8 = plan_report(plans[1])
    return {"refits": out, "bytes_min": [p.bytes_min for p in plans], "quantized_bytes": fp8.quantized_bytes,
            "quantized_bytes_unquantized": fp8.quantized_bytes_unquantized, "quantized_tensors": len(fp8.quantized)}


def destination_main(rank: int, inbox: Any, results: Any, layouts: list, spec: Any) -> None:
    """One destination rank: hold both layouts (zeroed tensors), receive every refit in turn."""
    import torch

    from mcore_reshard.adapters.vllm.rules import vllm_layout
    from mcore_reshard.wire.protocol import JoinInfo, RefitRequest
    from mcore_reshard.transport.participant import IN_PLACE, RefitEndpoint
    from mcore_reshard.transport.executor import TensorSink
    from mcore_reshard.transport.views import TORCH_DTYPES

    out: dict[str, Any] = {"refits": []}
    try:
        torch.set_num_threads(1)
        held = [{p.name: torch.zeros(p.shape, dtype=TORCH_DTYPES[p.dtype]) for p in vllm_layout(spec, v).for_rank(rank)}
                for v in layouts]
        msg = inbox.get(timeout=900)
        ep = RefitEndpoint("dst", rank)
        ep.join(JoinInfo.from_wire(msg["join"]))
        for k, wire in msg["seq"]:
            request = RefitRequest.from_wire(wire)
            ep.set_plan(msg["slices"][k], msg["digests"][k])
            t0 = time.perf_counter()
            outcome, report = ep.refit(request, {}, TensorSink(held[k]), IN_PLACE)
            out["refits"].append((k, time.perf_counter() - t0, outcome.commit, outcome.errors,
                                  None if report is None else report.to_wire()))
        ep.leave()
    except BaseException:  # noqa: BLE001
        import traceback

        out["crash"] = traceback.format_exc()
    results.put((rank, out))


def run(args: argparse.Namespace, log: Any) -> dict[str, Any]:
    import torch.multiprocessing as mp

    from mcore_reshard.adapters.megatron.rules import MegatronParallel
    from mcore_reshard.adapters.vllm.rules import VllmParallel
    from mcore_reshard.infra.checkpoint import make_tiny_checkpoint
    from mcore_reshard.layout import load_model_spec
    from mcore_reshard.wire.protocol import RankReport
    from mcore_reshard.testing.worlds import run_world

    overrides = dict(FP8_BENCH_MODEL, num_hidden_layers=args.layers, num_experts=args.experts)
    ckpt = make_tiny_checkpoint(Path(args.workdir) / "bench-fp8-moe", overrides=overrides, moe=True, dtype="bfloat16",
                                seed=0, weight_std=WEIGHT_STD)
    spec = load_model_spec(ckpt, dtype="bfloat16")
    par = MegatronParallel(tp=2, ep=2, etp=1)
    layouts = [VllmParallel(tp=2), VllmParallel(tp=2, quantization="fp8_per_block")]
    ctx = mp.get_context("spawn")
    manager = ctx.Manager()
    t0 = time.perf_counter()
    try:
        inboxes, results = [manager.Queue() for _ in range(2)], ctx.Queue()
        procs = [ctx.Process(target=destination_main, args=(r, inboxes[r], results, layouts, spec), daemon=True)
                 for r in range(2)]
        for p in procs:
            p.start()
        trainers: dict[str, Any] = {}

        def train() -> None:
            try:
                trainers["ranks"] = run_world(trainer_job, 2, (str(ckpt), par, layouts, args.rounds, inboxes,
                                                                (args.buffer_mib << 20) // 2), timeout_s=1800)
            except BaseException as exc:  # noqa: BLE001 - re-raised below
                trainers["error"] = exc

        t = threading.Thread(target=train)
        t.start()
        dst = dict(results.get(timeout=1800) for _ in procs)
        t.join(timeout=600)
        for p in procs:
            p.join(timeout=30)
    finally:
        manager.shutdown()
    if "error" in trainers:
        raise trainers["error"]
    crashed = [d["crash"] for d in dst.values() if "crash" in d]
    if crashed:
        raise RuntimeError(crashed[0])
    log(f"{2 * args.rounds} refits in {time.perf_counter() - t0:.1f}s")
    ranks = trainers["ranks"]
    out: dict[str, Any] = {"model": {k: overrides[k] for k in ("hidden_size", "num_hidden_layers", "num_experts",
                                                               "moe_intermediate_size", "head_dim")},
                           "weight_std": WEIGHT_STD, "rounds": args.rounds, "kinds": {}}
    for k, kind in enumerate(KINDS):
        walls = []
        for i in range(args.rounds):
            # one refit's time: the slowest rank of it (trainers and destinations)
            mine = [[w for kk, w, _ in r["refits"] if kk == k][i] for r in ranks]
            mine += [[w for kk, w, *_ in d["refits"] if kk == k][i] for d in dst.values()]
            walls.append(max(mine))
        reps = [RankReport.from_wire(rep) for r in ranks for kk, _, rep in r["refits"] if kk == k]
        commits = [c for d in dst.values() for kk, _, c, *_ in d["refits"] if kk == k]
        out["kinds"][kind] = {
            "bytes": ranks[0]["bytes_min"][k], "seconds": statistics.median(walls), "all_seconds": walls,
            "verified": all(r.verified for r in reps) and all(commits),
            "quantize_s_per_rank": [statistics.median(RankReport.from_wire(rep).phases.get("quantize", 0.0)
                                                      for kk, _, rep in r["refits"] if kk == k) for r in ranks],
            "pack_s_per_rank": [statistics.median(RankReport.from_wire(rep).phases.get("pack", 0.0)
                                                  for kk, _, rep in r["refits"] if kk == k) for r in ranks],
        }
    q = ranks[0]
    out["quantized"] = {"tensors": q["quantized_tensors"], "fp8_bytes": q["quantized_bytes"],
                        "bf16_bytes": q["quantized_bytes_unquantized"],
                        "ratio": q["quantized_bytes"] / q["quantized_bytes_unquantized"]}
    b, f = out["kinds"]["bf16"], out["kinds"]["fp8"]
    out["ratios"] = {"bytes": f["bytes"] / b["bytes"], "seconds": f["seconds"] / b["seconds"]}
    out["target"] = {"quantized_ratio_max": TARGET_RATIO, "pass": out["quantized"]["ratio"] <= TARGET_RATIO}
    out["token_mult_prob_error_w8a16"] = fp8_logprob_error(ckpt, [t % spec.vocab for t in TOKENS])
    return out


#: The local refit job's tokens (``configs/refit.yaml``), teacher-forced.
TOKENS = [11, 42, 7, 99, 123, 5, 77, 300, 8, 64, 512, 3, 250, 17, 901, 46]


def fp8_logprob_error(ckpt: Path, tokens: list[int]) -> float:
    """``token_mult_prob_error`` of the FP8 engine's weights against the bf16 policy's, in one
    HF model (the same kernels for both, so only the weights differ): every tensor an
    ``fp8_per_block`` engine quantizes is replaced by its codes x scales, as vLLM's W8A16 CPU
    kernel computes with them (transformers fuses experts as ``gate_up_proj`` [E, 2F, H]:
    quantized per expert, the same blocks when F is a multiple of 128)."""
    import torch
    import transformers

    from mcore_reshard.layout.quant import BlockFp8
    from mcore_reshard.transport.quantize import per_block_fp8
    from mcore_reshard.refit.verify import token_mult_prob_error

    model = transformers.AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.bfloat16).eval()
    ids = torch.tensor([tokens])

    def logprobs() -> list[float]:
        with torch.no_grad():
            lp = torch.log_softmax(model(ids).logits.float(), dim=-1)[0, :-1]
        return lp.gather(1, ids[0, 1:, None])[:, 0].tolist()

    bf16 = logprobs()
    quant = BlockFp8()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if quant.quantizes(name) or name.endswith(("experts.gate_up_proj", "experts.down_proj")):
                codes, scales = per_block_fp8(p.data)
                full = scales.repeat_interleave(128, -2).repeat_interleave(128, -1)
                p.data.copy_((codes.float() * full[..., :p.shape[-2], :p.shape[-1]]).to(p.dtype))
    return token_mult_prob_error(logprobs(), bf16)


def _mib(n: float) -> str:
    return f"{n / 2**20:.1f} MiB"


def table(res: dict[str, Any]) -> str:
    m, b, f, q = res["model"], res["kinds"]["bf16"], res["kinds"]["fp8"], res["quantized"]
    lines = [f"bf16 vs block-FP8 refit: megatron TP2xEP2 (bf16) -> vLLM TP2 layout, {m['num_hidden_layers']} layers, "
             f"{m['num_experts']} experts, hidden {m['hidden_size']}, medians of {res['rounds']}",
             f"{'':22}{'bf16':>14}{'fp8':>14}{'fp8/bf16':>10}",
             f"{'bytes moved':22}{_mib(b['bytes']):>14}{_mib(f['bytes']):>14}{res['ratios']['bytes']:>10.3f}",
             f"{'seconds':22}{b['seconds']:>14.3f}{f['seconds']:>14.3f}{res['ratios']['seconds']:>10.3f}",
             f"{'verified':22}{str(b['verified']):>14}{str(f['verified']):>14}",
             f"quantized tensors: {q['tensors']}, {_mib(q['fp8_bytes'])} of codes + scales for {_mib(q['bf16_bytes'])} "
             f"in bf16 ({q['ratio']:.3f}x; target <= {res['target']['quantized_ratio_max']}: "
             f"{'PASS' if res['target']['pass'] else 'FAIL'})",
             "sender quantization per training rank: " + ", ".join(f"{s:.3f} s" for s in f["quantize_s_per_rank"])
             + "  (pack incl. it: " + ", ".join(f"{s:.3f} s" for s in f["pack_s_per_rank"]) + "; bf16 pack: "
             + ", ".join(f"{s:.3f} s" for s in b["pack_s_per_rank"]) + ")",
             f"token_mult_prob_error, FP8 weights (W8A16) vs the bf16 policy, one HF model: "
             f"{res['token_mult_prob_error_w8a16']:.4f}  (NeMo RL / NVIDIA: < 1.03-1.05 is acceptable)"]
    return "\n".join(lines)


def main() -> int:
    return bench_main(parse_args(), run, table)


if __name__ == "__main__":
    sys.exit(main())
