"""``mcore-reshard``: plan, refit and verify from Hydra configs.

    mcore-reshard plan [--json] [--dtensor] [hydra overrides...]
    mcore-reshard plan [--json] [--dtensor] --recipe FILE
    mcore-reshard refit [--json] [hydra overrides...]
    mcore-reshard grpo RECIPE [a.b.c=value...] [--dry-run] [--json] [--address ADDR]

Bad input -- an unknown key, a value of the wrong type, a size out of range, a layout the rules
or the planner reject, a recipe that is not a YAML mapping -- prints one line ``error: ...``
naming the setting and exits with code 2, before any process starts or any file is written.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Sequence

from .errors import ConfigError
from .layout import LayoutError
from .wire.protocol import one_line as _one_line
from .settings.config import load_plan, load_refit_job, plan_recipe
from .settings.policy import load_recipe_file

__all__ = ["main"]


def _cmd_plan(args, overrides: Sequence[str]) -> int:
    if args.recipe is not None:
        if overrides:
            raise ConfigError(f"--recipe takes no overrides (got {list(overrides)}); edit the recipe")
        recipe = load_recipe_file(args.recipe)
    else:
        recipe = load_plan(overrides)
    planned = plan_recipe(recipe)
    print(json.dumps(planned.to_json(args.dtensor)) if args.json else planned.table(args.dtensor))
    return 0


def _cmd_refit(args, overrides: Sequence[str]) -> int:
    for flag in ("recipe", "dtensor"):
        if getattr(args, flag):
            raise ConfigError(f"--{flag} is an option of 'plan', not of 'refit'")
    from .jobs.refit import run_refit_job  # torch and the job's runners: not for 'plan'

    job = load_refit_job(overrides)  # every check, before any process starts
    if job.chose:
        print(job.chose, file=sys.stderr)
    _say_cpu_notice_once()
    return run_refit_job(job, as_json=args.json)


def _say_cpu_notice_once() -> None:
    """megatron-core's CPU warnings, once for the job instead of from every process."""
    from .adapters.megatron.runtime import CPU_NOTICE, quiet_cpu_notices

    if quiet_cpu_notices():
        print(CPU_NOTICE, file=sys.stderr)


def _cmd_grpo(args, overrides: Sequence[str]) -> int:
    """``grpo RECIPE [overrides]``: ``--dry-run`` prints placement, plan and modelled refit
    time; otherwise the GRPO loop runs (Ray, only for recipes this machine can run)."""
    for flag in ("recipe", "dtensor"):
        if getattr(args, flag):
            raise ConfigError(f"--{flag} is an option of 'plan', not of 'grpo'")
    if not overrides:
        raise _UsageError("grpo needs a recipe file: mcore-reshard grpo RECIPE [a.b.c=value ...] [--dry-run]")
    from .jobs.grpo.dry_run import dry_run
    from .jobs.grpo.recipe import load_grpo_recipe

    path, *rest = overrides
    recipe = load_grpo_recipe(path, rest)
    if args.dry_run:
        if args.address is not None:
            raise ConfigError("--address joins a Ray cluster to run the loop; --dry-run starts nothing")
        report = dry_run(recipe)
        print(json.dumps(report.to_json()) if args.json else report.table())
        return 0
    if recipe.local_problem is not None:  # before anything heavy is imported
        raise ConfigError(recipe.local_problem)
    from .jobs.grpo.loop import run_grpo  # torch, Ray and the trainers: only for a run

    _say_cpu_notice_once()
    return run_grpo(recipe, address=args.address, as_json=args.json)


class _UsageError(Exception):
    pass


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line and exit 2 (argparse would print the usage too)
        raise _UsageError(message)


def main(argv: Sequence[str] | None = None) -> int:
    parser = _Parser(prog="mcore-reshard", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("command", choices=["plan", "refit", "grpo"])
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    parser.add_argument("--dtensor", action="store_true",
                        help="plan: also list every tensor's DTensor form (mesh + placements) on both sides")
    parser.add_argument("--recipe", help="plan: a GRPO recipe (NeMo RL shape) with megatron_cfg.mcore_reshard on")
    parser.add_argument("--dry-run", action="store_true",
                        help="grpo: print placement, refit plan and modelled refit time; start nothing")
    parser.add_argument("--address", default=None,
                        help="grpo: join this Ray cluster ('auto' or host:port) instead of ray.address")
    try:
        args, overrides = parser.parse_known_args(argv)
        bad = [o for o in overrides if o.startswith("-")]
        if bad:
            raise _UsageError(f"unknown option(s) {bad}")
        for flag, given in (("--dry-run", args.dry_run), ("--address", args.address is not None)):
            if given and args.command != "grpo":
                raise _UsageError(f"{flag} is an option of 'grpo', not of '{args.command}'")
    except _UsageError as exc:
        print(f"error: {_one_line(exc)}", file=sys.stderr)
        return 2
    handler = {"plan": _cmd_plan, "refit": _cmd_refit, "grpo": _cmd_grpo}[args.command]
    try:
        return handler(args, overrides)
    except (_UsageError, ConfigError, LayoutError, ValueError, FileNotFoundError, KeyError) as exc:
        print(f"error: {_one_line(exc)}", file=sys.stderr)
        return 2
    except Exception as exc:  # hydra's own config errors
        if type(exc).__module__.startswith(("hydra", "omegaconf")):
            print(f"error: {_one_line(exc)}", file=sys.stderr)
            return 2
        raise


if __name__ == "__main__":
    sys.exit(main())
