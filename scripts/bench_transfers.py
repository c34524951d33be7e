"""Per-transfer overhead of the executor's hot path, and what it costs at full size.

    python scripts/bench_transfers.py [--json] [--transfers 20000] [--elements 256] [key=value ...]

A full-size plan has ~300k transfers (Qwen3-30B-A3B, TP1.PP2.EP8 -> 8 x vLLM TP2), so a fixed
cost per transfer (Python, a torch call, a hash call) must not dominate the refit at GPU link
speeds. This measures it on this machine with the real executor: one process that is both the
source and the destination rank (``RankMap.colocated(1)``), so every box is packed, unpacked and
(``verify=checksum``) hashed on both ends, but nothing waits for a wire. The boxes are tiny, so
the time is the per-transfer overhead, not bytes. Then it plans the layout given by the
overrides (``configs/plan.yaml``; default the Qwen3-30B-A3B layout above) and multiplies the
busiest rank's transfer count by the measured cost, next to the plan's modelled refit time.

``--json`` prints one JSON object on stdout.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

from mcore_reshard.settings.config import plan_from_recipe
from mcore_reshard.settings.config import load_plan
from mcore_reshard.layout import Box, LocalParam, Piece, SideLayout, View
from mcore_reshard.plan import build_plan
from mcore_reshard.plan.placed import placement_report, plan_for_placement
from mcore_reshard.infra.ports import free_port
from mcore_reshard.wire.protocol import RankMap, VerifyMode
from mcore_reshard.transport.executor import TransferOptions, execute_plan
from mcore_reshard.transport.group import RefitGroup


def tiny_layout(n: int, elements: int, dtype: str) -> SideLayout:
    """``n`` canonical tensors of ``elements`` each, all held whole by rank 0: one transfer each."""
    params = tuple(
        LocalParam(0, f"p{i}", (elements,), dtype, (Piece(0, f"p{i}", f"t{i}", Box((0,), (elements,)),
                                                          View(0, (elements,), (1,))),))
        for i in range(n))
    return SideLayout("tiny", 1, params, {f"t{i}": ((elements,), dtype) for i in range(n)})


def per_transfer_us(n: int, elements: int, repeats: int) -> dict[str, float]:
    layout = tiny_layout(n, elements, "bfloat16")
    plan = build_plan(layout, layout, bucket_bytes=64 << 20)
    assert len(plan.transfers) == n, len(plan.transfers)
    src = {p.name: torch.randn(elements).to(torch.bfloat16) for p in layout.params}
    dst = {p.name: torch.empty(elements, dtype=torch.bfloat16) for p in layout.params}
    group = RefitGroup.create("127.0.0.1", free_port(), 0, 1, 60.0, True, rank_map=RankMap.colocated(1))
    out = {}
    try:
        for mode in (VerifyMode.OFF, VerifyMode.CHECKSUM):
            secs = []
            for _ in range(repeats + 1):  # the first run allocates buffers: not timed
                t0 = time.perf_counter()
                execute_plan(plan.for_rank("src", 0), plan.for_rank("dst", 0), src, dst, group,
                             TransferOptions(60.0, verify=mode))
                secs.append(time.perf_counter() - t0)
            assert all(torch.equal(src[k], dst[k]) for k in src)
            out[mode.value] = statistics.median(secs[1:]) / n * 1e6
    finally:
        group.close()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--transfers", type=int, default=20000)
    ap.add_argument("--elements", type=int, default=256, help="elements per box (bf16)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("overrides", nargs="*", help="configs/plan.yaml overrides for the full-size layout")
    args = ap.parse_args()
    torch.set_num_threads(1)
    us = per_transfer_us(args.transfers, args.elements, args.repeats)

    recipe = load_plan(args.overrides)
    src, dst, plan = plan_from_recipe(recipe)
    modelled = None
    if recipe.topology is not None:  # the plan `mcore-reshard plan` prints: relays where they help
        where = recipe.topology.place(src.world_size, dst.world_size)
        plan = plan_for_placement(src, dst, where, recipe.topology.links, bucket_bytes=recipe.refit.bucket_bytes)
        modelled = placement_report(plan, src, dst, where, recipe.topology.links).modelled_seconds
    per_src = [0] * plan.num_src
    per_dst = [0] * plan.num_dst
    for t in plan.transfers:
        per_src[t.src] += 1
        per_dst[t.dst] += 1
    busiest = max(max(per_src), max(per_dst))
    res = {
        "us_per_transfer": {k: round(v, 2) for k, v in us.items()},
        "transfers": len(plan.transfers),
        "busiest_rank_transfers": busiest,
        "overhead_seconds_busiest": {k: round(v * busiest / 1e6, 4) for k, v in us.items()},
        "modelled_refit_seconds": modelled,
        "layout": f"{recipe.spec.name}: {src.name} -> {dst.name}",
    }
    if args.json:
        print(json.dumps(res))
        return 0
    print(f"executor overhead per transfer (tiny bf16 boxes of {args.elements}, pack + unpack on one rank):")
    for k, v in us.items():
        print(f"  verify={k:9s} {v:6.2f} us per transfer")
    print(f"full-size layout: {res['layout']}")
    print(f"  {len(plan.transfers):,} transfers; busiest rank {busiest:,}")
    for k, v in res["overhead_seconds_busiest"].items():
        line = f"  per-transfer overhead on the busiest rank, verify={k}: {v:.3f} s"
        if modelled:
            line += f"  ({v / modelled:.0%} of the modelled {modelled:.3f} s refit)"
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
