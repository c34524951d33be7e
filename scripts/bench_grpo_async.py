"""Synchronous vs asynchronous GRPO on the tiny recipes, side by side in one session.

    python scripts/bench_grpo_async.py [--json] [--steps 8] [key=value ...]

Runs ``recipes/grpo-tiny-moe-cpu.yaml`` (generate, train, refit, one after the other), then
``recipes/grpo-tiny-moe-cpu-async.yaml`` (the next step's prompts generate on vLLM's AsyncLLM
while a step trains and refits; in-flight, overlapped refits), each for ``--steps`` steps on
its own embedded Ray cluster; overrides apply to both. Printed: steps/s of each over the steps
after the first (start-up and first compiles excluded) and their ratio, the mean seconds of
each phase per step (where the time goes), the generation time the async loop still waited
for, and both loops' ``token_mult_prob_error`` (each token against the version that generated
it) next to the async samples' staleness (against the current policy).

On this 2-core machine the trainers (2 ranks) and the engine (1 worker) already want 3 cores,
so generating while training takes the cores training needs: async GRPO hides the generation
wait but slows the other phases, and its per-version check costs one more forward per step.
Not a test: numbers are printed as they come.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RECIPES = {"sync": ROOT / "recipes" / "grpo-tiny-moe-cpu.yaml", "async": ROOT / "recipes" / "grpo-tiny-moe-cpu-async.yaml"}
PHASES = ("generation", "logprob_inference", "policy_training", "refit", "total")


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    ap.add_argument("--steps", type=int, default=8, help="GRPO steps per mode (>= 2; the first is not timed)")
    ap.add_argument("overrides", nargs="*", help="recipe overrides applied to both recipes")
    return ap.parse_args()


def run_mode(path: Path, steps: int, overrides: list[str], log: Any) -> dict[str, Any]:
    from mcore_reshard.jobs.grpo.loop import GrpoRun
    from mcore_reshard.jobs.grpo.recipe import load_grpo_recipe

    recipe = load_grpo_recipe(path, [f"grpo.max_num_steps={steps}", *overrides])
    with tempfile.TemporaryDirectory(prefix="mr_bench_grpo_") as tmp, GrpoRun(recipe, workdir=tmp) as run:
        for s in range(steps):
            m = run.step(s)
            log(f"{path.stem}: step {s} {m.timing['total']:.2f} s, reward {m.reward:.3f}")
    hist = run.history
    timed = hist[1:]
    seconds = sum(h.timing["total"] for h in timed)
    return {
        "steps": [asdict(h) for h in hist],
        "steps_per_s": len(timed) / seconds,
        "phase_mean_s": {k: statistics.fmean(h.timing.get(k, 0.0) for h in timed) for k in PHASES},
        "max_token_mult_prob_error": max(h.token_mult_prob_error for h in hist),
        "max_off_policy_token_mult_prob_error": max(h.off_policy_token_mult_prob_error for h in hist),
        "max_trajectory_age": max(h.trajectory_age for h in hist),
        "reward_first_last": (hist[0].reward, hist[-1].reward),
        "every_refit_verified": all(h.refit_verified for h in hist),
    }


def table(res: dict[str, Any]) -> str:
    s, a = res["sync"], res["async"]
    lines = [f"synchronous vs asynchronous GRPO, tiny MoE, {res['steps']} steps each (first not timed)",
             f"  steps/s                {s['steps_per_s']:.3f} sync, {a['steps_per_s']:.3f} async "
             f"({res['async_over_sync']:.2f}x)",
             "  mean seconds per step  " + "  ".join(f"{k}" for k in PHASES)]
    for mode, r in (("sync", s), ("async", a)):
        lines.append(f"    {mode:<6}               " + "  ".join(f"{r['phase_mean_s'][k]:.3f}" for k in PHASES))
    lines += [
        f"  token_mult_prob_error  {s['max_token_mult_prob_error']:.6f} sync, {a['max_token_mult_prob_error']:.6f} "
        f"async (each token vs the version that generated it; max over steps)",
        f"  async staleness        oldest token {a['max_trajectory_age']} version(s) behind; vs the current policy "
        f"token_mult_prob_error up to {a['max_off_policy_token_mult_prob_error']:.3g}",
        f"  reward                 sync {s['reward_first_last'][0]:.3f} -> {s['reward_first_last'][1]:.3f}, async "
        f"{a['reward_first_last'][0]:.3f} -> {a['reward_first_last'][1]:.3f}",
        f"  every refit verified   sync {s['every_refit_verified']}, async {a['every_refit_verified']}",
    ]
    return "\n".join(lines)


def main() -> int:
    args = parse_args()
    if args.steps < 2:
        print(f"error: --steps={args.steps} must be >= 2 (the first step is not timed)", file=sys.stderr)
        return 2
    log = lambda *a: print(*a, file=sys.stderr, flush=True)  # noqa: E731
    res: dict[str, Any] = {"steps": args.steps}
    for mode, path in RECIPES.items():
        res[mode] = run_mode(path, args.steps, list(args.overrides), log)
    res["async_over_sync"] = res["async"]["steps_per_s"] / res["sync"]["steps_per_s"]
    print(json.dumps(res) if args.json else table(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
