"""A LoRA policy's adapter refit vs a full refit of the same policy, side by side in one session.

    python scripts/bench_lora.py [--json] [--repeats 3] [--dim 16] [--alpha 32] [--workdir DIR]

A dense random-weight Qwen3 of the bench model's size (``bench_refit.py``: hidden 1024, 8 layers,
vocab 32000; a dense MLP of intermediate 8192 in place of the 16 experts, so about the same
287M parameters = 1.15 GB in fp32: vLLM 0.32's CPU build cannot serve LoRA on a MoE model) goes
from a megatron-core TP2 LoRA policy (Megatron-Bridge's adapters on all four linears, rank
``--dim``, alpha ``--alpha``; base frozen) into one vLLM engine TP2 with LoRA slots.

After one Adam step per round, two refits of the same weights, alternately: the adapter refit
(every refit of a LoRA policy after the first) and a full refit of the policy (base + adapter,
what a merged ``W + BA`` refit moves: every base weight). Both verified by checksums. Printed:
bytes of each (the adapter's against the full one's), seconds (median, min) and their ratio,
and the first refit's. No target: the adapter refit's bytes are the layout's, its seconds are
what they are on this machine.

``--json`` prints exactly one JSON object on stdout; everything else (vLLM logs) goes to stderr.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_refit import BENCH_MODEL, bench_main, bench_parser  # noqa: E402

#: The bench model with a dense MLP of the same parameter count (16 experts x 512 = 8192).
DENSE_MODEL: dict[str, Any] = {k: v for k, v in BENCH_MODEL.items()
                               if k not in ("num_experts", "num_experts_per_tok", "moe_intermediate_size")}
DENSE_MODEL["intermediate_size"] = BENCH_MODEL["num_experts"] * BENCH_MODEL["moe_intermediate_size"]


def parse_args() -> argparse.Namespace:
    ap = bench_parser(__doc__, 3, "rounds (step, adapter refit, full refit)")
    ap.add_argument("--dim", type=int, default=16, help="LoRA rank")
    ap.add_argument("--alpha", type=float, default=32.0, help="LoRA alpha")
    return ap.parse_args()


def run(args: argparse.Namespace, log: Callable[..., None]) -> dict[str, Any]:
    from mcore_reshard.adapters.megatron.rules import MegatronParallel
    from mcore_reshard.adapters.vllm.rules import VllmParallel
    from mcore_reshard.infra.checkpoint import make_tiny_checkpoint
    from mcore_reshard.jobs.refit import local_cluster
    from mcore_reshard.layout import load_model_spec
    from mcore_reshard.layout.lora import PeftConfig
    from mcore_reshard.settings.policy import RefitConfig

    path = Path(args.workdir) / "dense-bench"
    if not (path / "config.json").exists():
        make_tiny_checkpoint(path, overrides=DENSE_MODEL, family="qwen3", dtype="float32")
    spec = load_model_spec(path, dtype="float32")
    peft = PeftConfig(enabled=True, dim=args.dim, alpha=args.alpha)
    refit = RefitConfig(buffer_bytes=args.buffer_mib << 20, timeout_s=600.0, delta="off")
    tokens = [(7 * i + 3) % 1000 for i in range(64)]
    with local_cluster(spec, path, MegatronParallel(tp=2), VllmParallel(tp=2), refit, train={"lr": 1e-3},
                       peft=peft) as c:
        d = c.driver
        full_plan = d.plan
        first = d.refit()
        log(f"first refit (base + adapter): {first.bytes_moved} bytes in {first.seconds:.3f}s")
        rounds: list[dict[str, float]] = []
        for i in range(args.repeats):
            c.pool.train_step([tokens, tokens[::-1]]).wait()
            adapter = d.refit()
            d.plan = full_plan  # the same weights again, every base weight with them (the next refit rejoins)
            full = d.refit()
            assert adapter.verified and full.verified and d.plan is d.adapter_plan
            rounds.append({"adapter_s": adapter.seconds, "full_s": full.seconds, "ratio": full.seconds / adapter.seconds,
                           "adapter_bytes": adapter.bytes_moved, "full_bytes": full.bytes_moved})
            log(f"round {i}: adapter {adapter.seconds:.3f}s, full {full.seconds:.3f}s")
    adapter_bytes, full_bytes = rounds[-1]["adapter_bytes"], rounds[-1]["full_bytes"]
    return {
        "model_params": sum(math.prod(shape) for shape, _ in spec.tensor_table().values()),
        "peft": {"dim": args.dim, "alpha": args.alpha, "modules": list(peft.modules)},
        "first_refit": {"bytes": first.bytes_moved, "seconds": first.seconds},
        "adapter_bytes": adapter_bytes, "full_bytes": full_bytes, "byte_share": adapter_bytes / full_bytes,
        "adapter_seconds_median": statistics.median(r["adapter_s"] for r in rounds),
        "adapter_seconds_min": min(r["adapter_s"] for r in rounds),
        "full_seconds_median": statistics.median(r["full_s"] for r in rounds),
        "full_seconds_min": min(r["full_s"] for r in rounds),
        "speedup_median": statistics.median(r["ratio"] for r in rounds),
        "byte_ratio": full_bytes / adapter_bytes,
        "rounds": rounds,
    }


def table(r: dict[str, Any]) -> str:
    from mcore_reshard.plan.report import format_bytes

    p = r["peft"]
    return "\n".join([
        f"LoRA refit vs full refit: dense model of {r['model_params'] / 1e6:.0f}M parameters (fp32), "
        f"r={p['dim']} alpha={p['alpha']:g} on {', '.join(p['modules'])}, megatron TP2 -> vLLM TP2",
        f"first refit (base + adapter)   {format_bytes(r['first_refit']['bytes'])} in {r['first_refit']['seconds']:.3f}s",
        f"adapter refit                  {format_bytes(r['adapter_bytes'])} ({100 * r['byte_share']:.3f} % of full), "
        f"median {r['adapter_seconds_median']:.3f}s (min {r['adapter_seconds_min']:.3f}s)",
        f"full refit (a merged refit)    {format_bytes(r['full_bytes'])}, median {r['full_seconds_median']:.3f}s "
        f"(min {r['full_seconds_min']:.3f}s)",
        f"speedup (median of rounds)     {r['speedup_median']:.1f}x   byte ratio {r['byte_ratio']:.1f}x",
    ])


def main() -> int:
    return bench_main(parse_args(), run, table)


if __name__ == "__main__":
    sys.exit(main())
