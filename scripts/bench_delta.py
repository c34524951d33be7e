"""Delta vs full refits after real Adam steps, side by side in one session.

    python scripts/bench_delta.py [--json] [--lrs 3e-7,1e-6,1e-5] [--repeats 3] [--grpo-steps 6] [key=value ...]

The bench model of ``bench_refit.py`` (a random Qwen3-MoE, ~287M parameters) in bf16, its
matrices drawn from N(0, 0.02) -- the ``initializer_range`` of published Qwen3 and Llama
configs (trained checkpoints spread a little wider, sigma ~0.03-0.04, so fewer of their bf16
elements change per step: these fractions are on the high side) -- goes from megatron-core
TP2 x EP2 (bf16 Float16Module, DDP, distributed optimizer: fp32 main weights, Adam) into one
vLLM engine TP2 (``configs/refit.yaml``; trailing ``key=value`` override it).

For each learning rate: one warm-up Adam step, then ``--repeats`` rounds of: a refit that
syncs the baseline, one Adam step, the delta refit of that step (``refit.delta=auto``), and a
full refit of the same weights (``refit.delta=off``). Every refit is verified by checksums of
the whole boxes. Printed per lr: bf16 elements changed per step, bytes and seconds of the
delta and full refits (medians) and their ratios, the boxes sent unchanged / sparse / dense,
the baseline each rank keeps, and token_mult_prob_error after the last delta. Then the tiny
GRPO recipe's refit bytes per step (``--grpo-steps``; 0 skips it). Targets, printed as
PASS/FAIL: at lr <= 1e-6 delta bytes <= 10 % and delta seconds <= 25 % of the full refit; at
1e-5 never more bytes than full (beyond the 8-byte header per box).

``--json`` prints exactly one JSON object on stdout; everything else (vLLM logs) goes to stderr.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_refit import BENCH_MODEL, bench_main  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
#: N(0, 0.02): Qwen3's and Llama's ``initializer_range``.
WEIGHT_STD = 0.02
TARGET_BYTES = 0.10  # delta bytes <= 10 % of the full refit at lr <= 1e-6
TARGET_SECONDS = 0.25  # delta seconds <= 25 % of the full refit at lr <= 1e-6


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    ap.add_argument("--lrs", default="3e-7,1e-6,1e-5", help="Adam learning rates, comma separated")
    ap.add_argument("--repeats", type=int, default=3, help="rounds (step, delta refit, full refit) per lr")
    ap.add_argument("--buffer-mib", type=int, default=128, help="refit.buffer_bytes in MiB")
    ap.add_argument("--layers", type=int, default=BENCH_MODEL["num_hidden_layers"], help="decoder layers")
    ap.add_argument("--experts", type=int, default=BENCH_MODEL["num_experts"], help="experts per layer")
    ap.add_argument("--grpo-steps", type=int, default=6, help="steps of the tiny GRPO recipe (0: skip)")
    ap.add_argument("--workdir", default=None, help="where the checkpoint goes (reused when it matches)")
    ap.add_argument("overrides", nargs="*", help="Hydra overrides of configs/refit.yaml")
    return ap.parse_args()


def checkpoint(workdir: Path, overrides: dict[str, Any], dtype: str, seed: int) -> Path:
    from mcore_reshard.infra.checkpoint import make_tiny_checkpoint

    path = workdir / "bench-delta-moe"
    stamp = path / "bench_settings.json"
    settings = json.dumps(dict(overrides, dtype=dtype, seed=seed, weight_std=WEIGHT_STD), sort_keys=True)
    if stamp.is_file() and stamp.read_text() == settings and list(path.glob("*.safetensors")):
        return path
    make_tiny_checkpoint(path, overrides=overrides, moe=True, dtype=dtype, seed=seed, weight_std=WEIGHT_STD)
    stamp.write_text(settings)
    return path


def _row(m: Any) -> dict[str, Any]:
    return {"seconds": m.seconds, "bytes_moved": m.bytes_moved, "bytes_full": m.bytes_full,
            "bytes_headers": m.bytes_headers, "delta": m.delta, "delta_fraction": m.delta_fraction,
            "delta_boxes": m.delta_boxes, "verified": m.verified, "delta_state_bytes": m.delta_state_bytes,
            "delta_reason": m.delta_reason, "phases": dict(m.phases)}


def run(args: argparse.Namespace, log: Callable[..., None]) -> dict[str, Any]:
    from mcore_reshard.errors import RefitFailed
    from mcore_reshard.jobs.refit import local_cluster
    from mcore_reshard.layout import load_model_spec
    from mcore_reshard.settings.config import load_refit_job

    job = load_refit_job([f"refit.buffer_bytes={args.buffer_mib << 20}", "dtype=bfloat16", *args.overrides])
    overrides = dict(BENCH_MODEL, num_hidden_layers=args.layers, num_experts=args.experts)
    ckpt = checkpoint(Path(args.workdir), overrides, job.dtype, job.seed)
    spec = load_model_spec(ckpt, dtype=job.dtype)
    tokens = [int(t) % spec.vocab for t in job.tokens]
    lrs = [float(x) for x in args.lrs.split(",")]
    out: dict[str, Any] = {"lrs": {}, "weight_std": WEIGHT_STD, "dtype": job.dtype}
    t0 = time.perf_counter()
    with local_cluster(spec, ckpt, job.training, job.vllm, job.refit, train={"lr": lrs[0]}) as c:
        log(f"engine + trainers ready in {time.perf_counter() - t0:.1f}s")
        d = c.driver
        out["bytes_min"] = d.plan.bytes_min
        auto, full = d.request(), replace(d.request(), delta="off")

        def refit(request: Any) -> Any:
            m = d.refit(request=request)
            if not m.verified:
                raise RefitFailed("a refit of the benchmark was not verified")
            return m

        refit(auto)
        for lr in lrs:
            c.step(tokens, lr=lr)  # warm-up: Adam's first step at this lr moves every element by lr
            rounds = []
            for i in range(args.repeats):
                refit(auto)  # the baseline: what the engine holds before the step
                c.step(tokens, lr=lr)
                dm = refit(auto)
                fm = refit(full)
                if not dm.delta:
                    raise RefitFailed(f"expected a delta refit at lr {lr}: {dm.delta_reason}")
                rounds.append({"delta": _row(dm), "full": _row(fm)})
                log(f"lr {lr:g} round {i}: {100 * dm.delta_fraction:.2f}% changed, delta {dm.bytes_moved} B "
                    f"{dm.seconds:.3f}s vs full {fm.bytes_moved} B {fm.seconds:.3f}s")
            tmpe = c.logprob_error(tokens)
            out["lrs"][f"{lr:g}"] = _summarize(lr, rounds, tmpe, d.plan.itemsize)
    if args.grpo_steps:
        out["grpo"] = grpo_bytes(args.grpo_steps, log)
    return out


def _summarize(lr: float, rounds: list[dict[str, Any]], tmpe: float, itemsize: int) -> dict[str, Any]:
    med = statistics.median
    delta_bytes = med(r["delta"]["bytes_moved"] for r in rounds)
    full_bytes = med(r["full"]["bytes_moved"] for r in rounds)
    delta_s = med(r["delta"]["seconds"] for r in rounds)
    full_s = med(r["full"]["seconds"] for r in rounds)
    worst = max(r["delta"]["bytes_moved"] - r["delta"]["bytes_headers"] - r["full"]["bytes_moved"] for r in rounds)
    res = {
        "rounds": rounds, "changed_fraction": med(r["delta"]["delta_fraction"] for r in rounds),
        "delta_bytes": delta_bytes, "full_bytes": full_bytes, "bytes_ratio": delta_bytes / full_bytes,
        "delta_seconds": delta_s, "full_seconds": full_s, "seconds_ratio": delta_s / full_s,
        "delta_boxes": rounds[-1]["delta"]["delta_boxes"], "header_bytes": rounds[-1]["delta"]["bytes_headers"],
        "delta_state_bytes": rounds[-1]["delta"]["delta_state_bytes"], "token_mult_prob_error": tmpe,
        "all_verified": all(r[k]["verified"] for r in rounds for k in ("delta", "full")),
        "bytes_per_changed_element": (delta_bytes - rounds[-1]["delta"]["bytes_headers"])
        / max(1.0, med(r["delta"]["delta_fraction"] for r in rounds) * full_bytes / itemsize),
    }
    if lr <= 1e-6:
        res["targets"] = {"bytes": res["bytes_ratio"] <= TARGET_BYTES, "seconds": res["seconds_ratio"] <= TARGET_SECONDS}
    else:
        res["targets"] = {"never_worse_bytes": worst <= 0}
    return res


def grpo_bytes(steps: int, log: Callable[..., None]) -> dict[str, Any]:
    """The tiny GRPO recipe's refit bytes per step (moved vs what a full refit moves)."""
    from mcore_reshard.jobs.grpo.loop import GrpoRun
    from mcore_reshard.jobs.grpo.recipe import load_grpo_recipe

    recipe = load_grpo_recipe(ROOT / "recipes" / "grpo-tiny-moe-cpu.yaml", [f"grpo.max_num_steps={steps}"])
    with tempfile.TemporaryDirectory(prefix="mr_bench_delta_grpo_") as tmp, GrpoRun(recipe, workdir=tmp) as run:
        for s in range(steps):
            m = run.step(s)
            log(f"grpo step {s}: refit {m.refit_bytes_moved} of {m.refit_bytes_full} bytes "
                f"({100 * m.refit_delta_fraction:.1f}% changed)")
    return {"steps": [{k: v for k, v in asdict(h).items() if k.startswith("refit_") or k in ("step", "reward")}
                      for h in run.history]}


def table(res: dict[str, Any]) -> str:
    mib = lambda b: f"{b / 2**20:.2f} MiB"  # noqa: E731
    lines = [f"delta vs full refits, bench model in {res['dtype']} (weights N(0, {res['weight_std']})), "
             f"minimum {mib(res['bytes_min'])}; medians of the rounds",
             f"{'lr':>7} {'changed':>8} {'delta':>11} {'full':>11} {'bytes':>7} {'delta s':>8} {'full s':>8} "
             f"{'time':>6} {'boxes u/s/d':>13} {'B/changed':>9} {'tmpe':>8} {'verified':>8}"]
    for lr, r in res["lrs"].items():
        b = r["delta_boxes"]
        lines.append(f"{lr:>7} {100 * r['changed_fraction']:>7.2f}% {mib(r['delta_bytes']):>11} "
                     f"{mib(r['full_bytes']):>11} {r['bytes_ratio']:>6.1%} {r['delta_seconds']:>8.3f} "
                     f"{r['full_seconds']:>8.3f} {r['seconds_ratio']:>5.0%} "
                     f"{b['unchanged']:>4}/{b['sparse']}/{b['dense']:<4} {r['bytes_per_changed_element']:>9.2f} "
                     f"{r['token_mult_prob_error']:>8.5f} {str(r['all_verified']):>8}")
    for lr, r in res["lrs"].items():
        for name, ok in r["targets"].items():
            want = {"bytes": f"delta bytes <= {TARGET_BYTES:.0%} of full", "seconds":
                    f"delta seconds <= {TARGET_SECONDS:.0%} of full",
                    "never_worse_bytes": "delta bytes <= full bytes (+ headers)"}[name]
            lines.append(f"  lr {lr}: {want}: {'PASS' if ok else 'FAIL'}")
    any_lr = next(iter(res["lrs"].values()), None)
    if any_lr:
        lines.append(f"  baseline kept per rank (host memory): up to {mib(any_lr['delta_state_bytes'])}; "
                     f"headers {any_lr['header_bytes']} B per refit (8 B a box)")
    if "grpo" in res:
        lines.append("tiny GRPO recipe, refit bytes per step (moved / full, changed elements):")
        for s in res["grpo"]["steps"]:
            kind = f"{100 * s['refit_delta_fraction']:.1f}% changed" if s["refit_delta"] else "full"
            lines.append(f"  step {s['step']}: {s['refit_bytes_moved']} / {s['refit_bytes_full']} B ({kind})")
    return "\n".join(lines)


def main() -> int:
    return bench_main(parse_args(), run, table)


if __name__ == "__main__":
    sys.exit(main())
