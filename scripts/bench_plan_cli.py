"""`mcore-reshard plan` wall time against the planner's own time, for two source trees side by side.

    python scripts/bench_plan_cli.py [--base OTHER_CHECKOUT] [--runs N]

Each case runs ``mcore_reshard.cli.main(["plan", "--json", ...])`` in a fresh process per tree
(``PYTHONPATH`` set to the tree), interleaved, ``--runs`` times; the table shows the fastest run.

- *wall*: the process from its start to the end of the command (interpreter start, imports,
  ``cli.main``; what a user waits for);
- *CPU: process*: the process's CPU seconds at the same point (less hurt by a loaded machine);
- *planner*: the planner's own time: one ``build_plan`` of the chosen plan's inputs, timed
  in the same process after the command, with the planner's layout caches cleared. Its inputs
  are the recipe's layouts, ``refit.bucket_bytes`` / ``allow_cast``, and -- for a placement --
  the link classes of its ranks; where the plan chose fan-out relays, the reduced destination
  side and the charges of the relays (``piece_relays``) instead of the full one (the first
  relays tried: where the plan's notes say some tensors kept the direct path, an approximation).

With ``--base`` each case also checks that both trees print the same JSON (but the planning
time) and make the same plan (transfers, buckets, relays, notes, bytes: a hash of the plan's
repr but its ``plan_seconds``). Not a test: this machine is noisy; compare runs side by side.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

CASES = [
    ("default job (relays)", []),
    ("NeMo RL nccl_reshard case: vllm.tp=8 vllm.replicas=2 (relays)", ["vllm.tp=8", "vllm.replicas=2"]),
    ("grpo-qwen3-30b-a3b-4n8g-lora", ["--recipe", str(ROOT / "recipes/grpo-qwen3-30b-a3b-4n8g-lora.yaml")]),
    ("grpo-deepseek-v3-megatron-reshard-mtp",
     ["--recipe", str(ROOT / "recipes/grpo-deepseek-v3-megatron-reshard-mtp.yaml")]),
]

#: Run in the child: the command, then the fingerprint and one timed build_plan of the chosen inputs.
CHILD = r"""
import contextlib, dataclasses, hashlib, io, json, sys, time
t0 = time.perf_counter()
from mcore_reshard import cli
args = sys.argv[1:]
out = io.StringIO()
with contextlib.redirect_stdout(out):
    rc = cli.main(["plan", "--json", *args])
cli_s, cli_end, cli_cpu = time.perf_counter() - t0, time.time(), time.process_time()
assert rc == 0, rc
from mcore_reshard.settings.config import load_plan, plan_recipe
from mcore_reshard.settings.policy import load_recipe_file
from mcore_reshard.plan import build_plan
from mcore_reshard.plan.placement import LINK_CLASSES
from mcore_reshard.plan.relays import piece_relays
from mcore_reshard.plan.validate import clear_reinterpreted_cache
recipe = load_recipe_file(args[1]) if args[:1] == ["--recipe"] else load_plan(args)
planned = plan_recipe(recipe)
plan, src, dst, r = planned.plan, planned.src, planned.dst, recipe.refit
kw = dict(bucket_bytes=r.bucket_bytes, allow_cast=r.allow_cast)
if recipe.topology is not None:
    where = recipe.topology.place(src.world_size, dst.world_size)
    rank = {c: i for i, c in enumerate(LINK_CLASSES)}
    kw["link_cost"] = lambda s, d: rank[where.link(s, d)]
    if plan.relay_groups:
        relays = piece_relays(dst, where)
        dst, kw["charges"] = relays.reduced, relays.charges
clear_reinterpreted_cache()
t1, c1 = time.perf_counter(), time.process_time()
build_plan(src, dst, **kw)
planner_s, planner_cpu = time.perf_counter() - t1, time.process_time() - c1
printed = json.loads(out.getvalue())
def drop(o):
    if isinstance(o, dict):
        return {k: drop(v) for k, v in o.items() if k != "plan_seconds"}
    return [drop(v) for v in o] if isinstance(o, list) else o
digest = hashlib.sha256(repr(dataclasses.replace(plan, plan_seconds=0.0)).encode()).hexdigest()[:16]
printed_digest = hashlib.sha256(json.dumps(drop(printed), sort_keys=True).encode()).hexdigest()[:16]
print(json.dumps(dict(cli_s=cli_s, cli_end=cli_end, cli_cpu=cli_cpu, planner_s=planner_s, planner_cpu=planner_cpu,
                      plan=digest, printed=printed_digest, relays=bool(plan.relay_groups),
                      transfers=len(plan.transfers))))
"""


def run_once(tree: Path, args: list[str]) -> dict:
    env = dict(os.environ, PYTHONPATH=str(tree), MCORE_RESHARD_FAST_START="1")
    t0 = time.time()  # wall clock: the child stamps the end of its command on the same clock
    done = subprocess.run([sys.executable, "-c", CHILD, *args], env=env, cwd=tree, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{tree}: plan {' '.join(args)} failed:\n{done.stderr[-2000:]}")
    out = json.loads(done.stdout.strip().splitlines()[-1])
    return dict(out, wall_s=out["cli_end"] - t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", type=Path, help="another checkout to compare against (e.g. a worktree of main)")
    ap.add_argument("--runs", type=int, default=2)
    a = ap.parse_args()
    trees = ([("base", a.base.resolve())] if a.base else []) + [("this", ROOT)]
    print("| case | tree | wall (s) | planner (s) | wall / planner | CPU: process (s) | CPU: planner (s) | CPU ratio "
          "| relays | transfers |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    same = True
    for name, args in CASES:
        runs: dict[str, list[dict]] = {k: [] for k, _ in trees}
        for _ in range(a.runs):
            for key, tree in trees:
                runs[key].append(run_once(tree, args))
        for key, _ in trees:
            b = {m: min(r[m] for r in runs[key]) for m in ("wall_s", "planner_s", "cli_cpu", "planner_cpu")}
            r0 = runs[key][0]
            print(f"| {name} | {key} | {b['wall_s']:.2f} | {b['planner_s']:.2f} | "
                  f"{b['wall_s'] / b['planner_s']:.1f}x | "
                  f"{b['cli_cpu']:.2f} | {b['planner_cpu']:.2f} | {b['cli_cpu'] / b['planner_cpu']:.1f}x | "
                  f"{r0['relays']} | {r0['transfers']} |")
        fingerprints = {(r["plan"], r["printed"]) for v in runs.values() for r in v}
        if len(fingerprints) != 1:
            same = False
            print(f"  DIFFERENT plans or output for {name}: {sorted(fingerprints)}")
    if a.base:
        print("plans and printed JSON identical between trees:", "YES" if same else "NO")


if __name__ == "__main__":
    main()
