"""The hybrid families' full-size refits on metadata alone: plan time, bytes against the HF
broadcast, and what an FFN-only reshard (NeMo RL's ``nccl_reshard``) would still broadcast.

    python scripts/bench_hybrid.py [--json]

For each hybrid recipe (``recipes/grpo-*``: Nemotron-H-8B, Nemotron-Nano-9B-v2, Qwen3-Next-80B-A3B):
the layouts of both sides built from the family's table, the plan (wall and CPU seconds, one
core, no placement: ``mcore-reshard plan --recipe`` adds relays and the modelled time), its
bytes at the per-rank minimum against the HF broadcast (every inference rank receives the
whole model), and the canonical tensors by class -- FFN (MLP / expert / shared-expert
projections: what ``nccl_reshard`` moves shard to shard), the hybrid mixers (Mamba2 / GDN),
attention, and the rest (embedding, head, norms, routers) -- with the bytes each class is at
the minimum and under a broadcast. An FFN-only reshard moves the FFN at the minimum and
broadcasts every other class; the last columns say how much of that broadcast the hybrid
mixers are, and what this planner moves for them instead.
Not a test: machines are noisy; the bytes are exact, the seconds are this machine's.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

from mcore_reshard.adapters.megatron.rules import megatron_layout
from mcore_reshard.adapters.vllm.rules import vllm_layout
from mcore_reshard.layout import DTYPE_BYTES
from mcore_reshard.jobs.grpo.recipe import load_grpo_recipe
from mcore_reshard.plan import build_plan

RECIPES = ["nemotron-h-8b", "nemotron-nano-9b-v2", "qwen3-next-80b-a3b"]
REPO = Path(__file__).resolve().parents[1]
#: Classes of canonical tensors, in the table's terms (a block's megatron symbol).
CLASSES = ("ffn", "hybrid_mixer", "attention", "other")


def tensor_classes(spec) -> dict[str, str]:
    """canonical name -> class, read from the family's table: rows of ``M`` / ``G`` blocks are
    the hybrid mixer, of ``*`` blocks attention, the projections of ``-`` / ``E`` blocks FFN;
    layer norms, routers and the rows outside the layers are ``other``."""
    fam, flags = spec.family, spec.family.flags(spec)
    out = {}
    for layer in range(spec.num_layers):
        prefix = fam.hf_layer.format(layer=layer)
        for _, block in fam.layer_blocks(spec, layer):
            experts = range(spec.num_experts) if block.experts else (None,)
            for row in block.rows:
                if not fam.present(row, flags):
                    continue
                leaf = row.hf.rsplit(".", 2)[-2] if row.hf.endswith(".weight") else row.hf
                if row.hf in ("norm.weight", "input_layernorm.weight", "post_attention_layernorm.weight"):
                    cls = "other"  # the layer's own norm
                elif block.symbol in ("M", "G"):
                    cls = "hybrid_mixer"
                elif block.symbol == "*":
                    cls = "attention"
                elif leaf in ("gate_proj", "up_proj", "down_proj"):
                    cls = "ffn"
                else:
                    cls = "other"  # router, its bias, the shared expert's gate
                for e in experts:
                    out[prefix + (row.hf if e is None else row.hf.format(e=e))] = cls
    return out


def class_bytes(spec, dst) -> dict[str, dict[str, int]]:
    """Per class: bytes in the model, at the per-rank minimum (every destination piece once),
    and under the HF broadcast (the model on every inference rank)."""
    classes = tensor_classes(spec)
    out = {c: {"model": 0, "minimum": 0, "broadcast": 0} for c in CLASSES}
    for name, (shape, dt) in dst.tensors.items():
        cls = classes.get(name, "other")
        out[cls]["model"] += math.prod(shape) * DTYPE_BYTES[dt]
    for lp in dst.params:
        for p in lp.pieces:
            cls = classes.get(p.canonical, "other")
            out[cls]["minimum"] += math.prod(p.box.sizes) * DTYPE_BYTES[dst.tensors[p.canonical][1]]
    for c in CLASSES:
        out[c]["broadcast"] = out[c]["model"] * dst.world_size
    return out


def case(name: str) -> dict:
    recipe = load_grpo_recipe(REPO / "recipes" / f"grpo-{name}-megatron-reshard.yaml")
    spec, training, vllm, refit = recipe.spec, recipe.training, recipe.vllm, recipe.refit
    t0, c0 = time.perf_counter(), time.process_time()
    src, dst = megatron_layout(spec, training), vllm_layout(spec, vllm)
    t1, c1 = time.perf_counter(), time.process_time()
    plan = build_plan(src, dst, bucket_bytes=refit.bucket_bytes, allow_cast=refit.allow_cast)
    t2, c2 = time.perf_counter(), time.process_time()
    cls = class_bytes(spec, dst)
    rest = [c for c in CLASSES if c != "ffn"]
    ffn_only = cls["ffn"]["minimum"] + sum(cls[c]["broadcast"] for c in rest)
    broadcast_rest = sum(cls[c]["broadcast"] for c in rest)
    return dict(
        model=name, training=src.name, vllm=f"tp={vllm.tp} pp={vllm.pp} dp={vllm.dp} replicas={vllm.replicas}",
        dst_ranks=dst.world_size, layout_seconds=round(t1 - t0, 3), plan_seconds=round(t2 - t1, 3),
        plan_cpu_seconds=round(c2 - c1, 3), transfers=len(plan.transfers),
        bytes_min=plan.bytes_min, bytes_planned=plan.bytes_planned, bytes_hf_broadcast=plan.bytes_hf_broadcast,
        classes=cls, ffn_only_reshard_bytes=ffn_only, ffn_only_broadcast_bytes=broadcast_rest,
        hybrid_share_of_ffn_only_broadcast=cls["hybrid_mixer"]["broadcast"] / broadcast_rest,
        hybrid_share_of_model=cls["hybrid_mixer"]["model"] / sum(c["model"] for c in cls.values()),
    )


def gib(n: int) -> str:
    return f"{n / 2**30:.2f}"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    rows = [case(n) for n in RECIPES]
    if args.json:
        print(json.dumps(rows, indent=1))
        return
    print(f"{'model':<20} {'dst':>4} {'layout s':>8} {'plan s':>7} {'min GiB':>8} {'HF bc GiB':>9} {'ratio':>6} "
          f"{'FFN-only GiB':>12} {'its bc GiB':>10} {'hybrid bc GiB':>13} {'hybrid share':>12} {'hybrid min GiB':>14}")
    for r in rows:
        h = r["classes"]["hybrid_mixer"]
        print(f"{r['model']:<20} {r['dst_ranks']:>4} {r['layout_seconds']:>8.3f} {r['plan_seconds']:>7.3f} "
              f"{gib(r['bytes_min']):>8} {gib(r['bytes_hf_broadcast']):>9} {r['bytes_hf_broadcast'] / r['bytes_min']:>5.1f}x "
              f"{gib(r['ffn_only_reshard_bytes']):>12} {gib(r['ffn_only_broadcast_bytes']):>10} {gib(h['broadcast']):>13} "
              f"{100 * r['hybrid_share_of_ffn_only_broadcast']:>11.1f}% {gib(h['minimum']):>14}")
    for r in rows:
        print(f"{r['model']}: {r['training']} -> vLLM {r['vllm']}; model by class (GiB): "
              + ", ".join(f"{c} {gib(v['model'])}" for c, v in r["classes"].items()))


if __name__ == "__main__":
    main()
