"""Planning cost on full-size layouts (metadata only, one core): layout build, plan, rank slice.

    python scripts/bench_plan.py [--json]

Targets, cheap enough to replan at every engine restart: Qwen3-30B-A3B's default layout
(~300k transfers) under 1 s, Qwen3-235B-A22B (128 -> 64 ranks) and gpt-oss-120b under 2 s,
DeepSeek-V3 (256 -> 256 ranks) and GLM-4.5 under 5 s and DeepSeek-V3 at its published training
layout (1024 -> 64 ranks) under 30 s,
each printed as a PASS/FAIL line on the plan's wall time. Each case also shows the busiest
ranks' bytes and a modelled refit time (8 GPUs per node, trainers and engines on separate nodes).
Not a test: machines are noisy; read the numbers, compare runs side by side
(``plan_cpu_seconds`` suffers less than wall time from a loaded machine).
"""

from __future__ import annotations

import argparse
import json
import time

from mcore_reshard.adapters.megatron.rules import MegatronParallel, megatron_layout
from mcore_reshard.adapters.vllm.rules import VllmParallel, vllm_layout
from mcore_reshard.settings.config import resolve_model
from mcore_reshard.plan import build_plan, plan_report

CASES = [
    ("qwen3-30b-a3b", "default recipe", MegatronParallel(tp=1, pp=2, ep=8, etp=1, dp=8, layer_spec="te", experts="grouped"),
     VllmParallel(tp=2, replicas=8)),
    ("qwen3-235b-a22b", "TP4.PP8(uneven).EP16.ETP1 x DP4 -> vLLM TP8xDP8 EP",
     MegatronParallel(tp=4, pp=8, ep=16, etp=1, dp=4, first_stage_layers=11, last_stage_layers=11, layer_spec="te", experts="grouped"),
     VllmParallel(tp=8, dp=8, enable_ep=True)),
    ("deepseek-v3", "PP16(uneven).EP16 x DP16 -> vLLM TP32xDP8 EP",
     MegatronParallel(tp=1, pp=16, ep=16, etp=1, dp=16, first_stage_layers=3, last_stage_layers=2, layer_spec="te", experts="grouped"),
     VllmParallel(tp=32, dp=8, enable_ep=True)),
    # DeepSeek-V3's published training layout (1024 ranks) into serving layouts (64 ranks).
    ("deepseek-v3", "TP1.PP16(uneven).EP64 x DP64 -> 8 x vLLM TP8 EP",
     MegatronParallel(tp=1, pp=16, ep=64, etp=1, dp=64, first_stage_layers=3, last_stage_layers=2, layer_spec="te", experts="grouped"),
     VllmParallel(tp=8, replicas=8, enable_ep=True)),
    ("deepseek-v3", "TP1.PP16(uneven).EP64 x DP64 -> 2 x vLLM DP-attention TP1xDP32 EP32",
     MegatronParallel(tp=1, pp=16, ep=64, etp=1, dp=64, first_stage_layers=3, last_stage_layers=2, layer_spec="te", experts="grouped"),
     VllmParallel(tp=1, dp=32, replicas=2, enable_ep=True)),
    # gpt-oss and GLM-4.5 (layout/families/): their recipes' layouts and one more each.
    ("gpt-oss-120b", "recipe: TP2.PP2.EP8 x DP8 -> 8 x vLLM TP4",
     MegatronParallel(tp=2, pp=2, ep=8, etp=1, dp=8, layer_spec="te", experts="grouped"), VllmParallel(tp=4, replicas=8)),
    ("gpt-oss-120b", "TP1.PP4.EP32 x DP32 -> 4 x vLLM TP8 EP",
     MegatronParallel(tp=1, pp=4, ep=32, etp=1, dp=32, layer_spec="te", experts="grouped"),
     VllmParallel(tp=8, replicas=4, enable_ep=True)),
    ("glm-4.5", "recipe: TP2.PP8(uneven).EP16 x DP8 -> 8 x vLLM TP8xPP2 EP",
     MegatronParallel(tp=2, pp=8, ep=16, etp=1, dp=8, first_stage_layers=10, last_stage_layers=10, layer_spec="te",
                      experts="grouped"), VllmParallel(tp=8, pp=2, replicas=8, enable_ep=True)),
    ("glm-4.5", "TP4.PP8(uneven).EP32 x DP8 -> vLLM TP8xDP8 EP",
     MegatronParallel(tp=4, pp=8, ep=32, etp=1, dp=8, first_stage_layers=10, last_stage_layers=10, layer_spec="te",
                      experts="grouped"), VllmParallel(tp=8, dp=8, enable_ep=True)),
]


#: Plan-time targets (seconds, one core) printed as PASS/FAIL lines.
TARGETS = {"qwen3-30b-a3b": 1.0, "qwen3-235b-a22b": 2.0, "deepseek-v3": 5.0, "gpt-oss-120b": 2.0, "glm-4.5": 5.0}
#: 1024 training ranks: the issue's bound for DeepSeek-V3 at its published layout.
TARGETS_1024 = 30.0
#: NCCL M2N's published DeepSeek-V3 refit (256 GB200, its own layouts): shown beside the model.
PUBLISHED = "NCCL M2N: DeepSeek-V3 refit 1.45 s on 256 GB200"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    rows = []
    for model, what, mpar, vpar in CASES:
        spec = resolve_model(model)
        t0 = time.perf_counter()
        src = megatron_layout(spec, mpar)
        dst = vllm_layout(spec, vpar)
        t1, c1 = time.perf_counter(), time.process_time()
        plan = build_plan(src, dst, bucket_bytes=1 << 30)
        t2, c2 = time.perf_counter(), time.process_time()
        mine = plan.for_rank("dst", 0)
        t3 = time.perf_counter()
        rep = plan_report(plan)
        from mcore_reshard.plan.placed import Links, placement_report
        from mcore_reshard.settings.topology import TopologyConfig

        placed = placement_report(plan, src, dst, TopologyConfig().place(src.world_size, dst.world_size), Links())
        target = TARGETS_1024 if src.world_size >= 1024 else TARGETS.get(model)
        rows.append(dict(model=model, layout=what, src_ranks=src.world_size, dst_ranks=dst.world_size,
                         src_pieces=sum(len(p.pieces) for p in src.params), dst_pieces=sum(len(p.pieces) for p in dst.params),
                         layout_seconds=round(t1 - t0, 3), plan_seconds=round(t2 - t1, 3), plan_cpu_seconds=round(c2 - c1, 3),
                         slice_seconds=round(t3 - t2, 3),
                         num_transfers=rep.num_transfers, num_buckets=rep.num_buckets, rank0_transfers=len(mine.transfers),
                         bytes_min=rep.bytes_min, bytes_planned=rep.bytes_planned, bytes_hf_broadcast=rep.bytes_hf_broadcast,
                         hf_over_planned=round(rep.bytes_hf_broadcast / rep.bytes_planned, 2),
                         send_max_over_mean=round(rep.max_send_bytes / rep.mean_send_bytes, 3),
                         max_send_bytes=rep.max_send_bytes, max_recv_bytes=rep.max_recv_bytes,
                         bytes_inter_node=placed.bytes_inter_node, modelled_seconds=round(placed.modelled_seconds, 4),
                         published=PUBLISHED if model == "deepseek-v3" else None,
                         target_seconds=target, meets_target=t2 - t1 < (target or float("inf"))))
    if args.json:
        print(json.dumps(rows, indent=1))
        return
    for r in rows:
        print(f"{r['model']}: {r['layout']} ({r['src_ranks']} -> {r['dst_ranks']} ranks)")
        print(f"  pieces src/dst {r['src_pieces']}/{r['dst_pieces']}, layouts {r['layout_seconds']} s, "
              f"plan {r['plan_seconds']} s (cpu {r['plan_cpu_seconds']} s), rank slice {r['slice_seconds']} s")
        print(f"  transfers {r['num_transfers']} in {r['num_buckets']} buckets; bytes planned == min: "
              f"{r['bytes_planned'] == r['bytes_min']}; HF broadcast / planned = {r['hf_over_planned']}x; "
              f"send max/mean {r['send_max_over_mean']}")
        print(f"  busiest sender {r['max_send_bytes'] / 2**30:.2f} GiB, receiver {r['max_recv_bytes'] / 2**30:.2f} GiB; "
              f"modelled refit {r['modelled_seconds']} s (8 GPUs/node, separate nodes, 450 / 50 GB/s)"
              + (f"; {r['published']}" if r["published"] else ""))
    for r in rows:
        if r["target_seconds"] is not None:
            verdict = "PASS" if r["meets_target"] else "FAIL"
            print(f"{verdict}: {r['model']} plans in {r['plan_seconds']} s (target < {r['target_seconds']:g} s; "
                  f"cpu {r['plan_cpu_seconds']} s)")


if __name__ == "__main__":
    main()
