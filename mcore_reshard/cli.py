"""``mcore-reshard``: plan, refit and verify from Hydra configs.

    mcore-reshard plan [--json] [--dtensor] [hydra overrides...]
    mcore-reshard plan [--json] [--dtensor] --recipe FILE
    mcore-reshard refit [--json] [hydra overrides...]

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
from .protocol import one_line as _one_line

__all__ = ["main", "recipe_from_config", "plan_from_recipe"]


def recipe_from_config(cfg):
    """The ``RecipeLayout`` of a composed ``configs/plan.yaml`` (every setting checked)."""
    from .config import recipe_from_config as build

    return build(cfg)


def plan_from_recipe(recipe):
    """(training layout, vLLM layout, plan) from metadata alone."""
    from .config import plan_layouts

    return plan_layouts(recipe.spec, recipe.training, recipe.vllm, recipe.refit, recipe.vllm_spec)


def _cmd_plan(args, overrides: Sequence[str]) -> int:
    from .config import load_plan, load_recipe_file
    from .plan import plan_report

    if args.recipe is not None:
        if overrides:
            raise ConfigError(f"--recipe takes no overrides (got {list(overrides)}); edit the recipe")
        recipe = load_recipe_file(args.recipe)
    else:
        recipe = load_plan(overrides)
    src, dst, plan = plan_from_recipe(recipe)
    spec = recipe.spec
    report = plan_report(plan)
    from .layout import dtensor_report, dtensor_summary

    forms = {"training": dtensor_report(src), "vllm": dtensor_report(dst)}
    if args.json:
        out = report.to_json()
        out["dtensor"] = {side: dtensor_summary(r) for side, r in forms.items()}
        if args.dtensor:
            out["dtensor_forms"] = forms
        print(json.dumps(out))
    else:
        title = f"refit plan: {spec.name} ({spec.dtype}), training {src.name} -> vLLM {dst.name}"
        print(report.table(title))
        for side, r in forms.items():
            print(f"{side} {dtensor_summary(r)}")
            if args.dtensor:
                for name, form in r.items():
                    print(f"  {name}: {form}")
    return 0


def _cmd_refit(args, overrides: Sequence[str]) -> int:
    from .config import load_refit_job

    for flag in ("recipe", "dtensor"):
        if getattr(args, flag):
            raise ConfigError(f"--{flag} is an option of 'plan', not of 'refit'")
    job = load_refit_job(overrides)  # every check, before any process starts
    from .refit import run_refit_job

    return run_refit_job(job, as_json=args.json)


class _UsageError(Exception):
    pass


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line and exit 2 (argparse would print the usage too)
        raise _UsageError(message)


def main(argv: Sequence[str] | None = None) -> int:
    parser = _Parser(prog="mcore-reshard", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("command", choices=["plan", "refit"])
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    parser.add_argument("--dtensor", action="store_true",
                        help="plan: also list every tensor's DTensor form (mesh + placements) on both sides")
    parser.add_argument("--recipe", help="plan: a GRPO recipe (NeMo RL shape) with megatron_cfg.mcore_reshard on")
    try:
        args, overrides = parser.parse_known_args(argv)
        bad = [o for o in overrides if o.startswith("-")]
        if bad:
            raise _UsageError(f"unknown option(s) {bad}")
    except _UsageError as exc:
        print(f"error: {_one_line(exc)}", file=sys.stderr)
        return 2
    handler = {"plan": _cmd_plan, "refit": _cmd_refit}[args.command]
    try:
        return handler(args, overrides)
    except (ConfigError, LayoutError, ValueError, FileNotFoundError, KeyError) as exc:
        print(f"error: {_one_line(exc)}", file=sys.stderr)
        return 2
    except Exception as exc:  # hydra's own config errors
        if type(exc).__module__.startswith(("hydra", "omegaconf")):
            print(f"error: {_one_line(exc)}", file=sys.stderr)
            return 2
        raise


if __name__ == "__main__":
    sys.exit(main())
