"""``mcore-reshard``: plan, refit and verify from Hydra configs.

    mcore-reshard plan [--json] [hydra overrides...]
    mcore-reshard refit [--json] [hydra overrides...]

Bad input prints one line ``error: ...`` and exits with code 2.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Sequence

from .layout import LayoutError

__all__ = ["main", "recipe_from_config", "plan_from_recipe"]


def recipe_from_config(cfg):
    """The ``RecipeLayout`` of a composed ``configs/plan.yaml``."""
    from .adapters.megatron.rules import MegatronParallel
    from .adapters.vllm.rules import VllmParallel
    from .config import build_dataclass, resolve_model
    from .policy import RecipeLayout, RefitConfig

    dtype = str(cfg.dtype) if cfg.get("dtype") else None
    spec = resolve_model(str(cfg.model), dtype=dtype)
    vllm_spec = resolve_model(str(cfg.vllm_model), dtype=dtype) if cfg.get("vllm_model") else None
    return RecipeLayout(
        spec,
        build_dataclass(MegatronParallel, cfg.training, "training"),
        build_dataclass(VllmParallel, cfg.vllm, "vllm"),
        build_dataclass(RefitConfig, cfg.refit, "refit"),
        vllm_spec,
    )


def plan_from_recipe(recipe):
    """(training layout, vLLM layout, plan) from metadata alone."""
    from .adapters.megatron.rules import megatron_layout
    from .adapters.vllm.rules import vllm_layout
    from .plan import get_plan

    src = megatron_layout(recipe.spec, recipe.training)
    dst = vllm_layout(recipe.vllm_spec or recipe.spec, recipe.vllm)
    plan = get_plan(src, dst, bucket_bytes=recipe.refit.bucket_bytes, allow_cast=recipe.refit.allow_cast)
    return src, dst, plan


def _cmd_plan(args, overrides: Sequence[str]) -> int:
    from .plan import plan_report

    if args.recipe:
        from omegaconf import OmegaConf

        from .policy import from_policy_config

        if overrides:
            raise ValueError(f"--recipe takes no overrides (got {list(overrides)}); edit the recipe")
        try:
            raw = OmegaConf.to_container(OmegaConf.load(args.recipe), resolve=True)
        except FileNotFoundError as exc:
            raise FileNotFoundError(f"recipe file not found: {args.recipe}") from exc
        recipe = from_policy_config(raw)
    else:
        from .config import compose

        recipe = recipe_from_config(compose("plan", overrides))
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
    from .refit import run_refit_job

    return run_refit_job(overrides, as_json=args.json)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="mcore-reshard", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("command", choices=["plan", "refit"])
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    parser.add_argument("--dtensor", action="store_true",
                        help="plan: also list every tensor's DTensor form (mesh + placements) on both sides")
    parser.add_argument("--recipe", help="plan: a GRPO recipe (NeMo RL shape) with megatron_cfg.mcore_reshard on")
    args, overrides = parser.parse_known_args(argv)
    bad = [o for o in overrides if o.startswith("-")]
    if bad:
        parser.error(f"unknown option(s) {bad}")
    handler = {"plan": _cmd_plan, "refit": _cmd_refit}[args.command]
    try:
        return handler(args, overrides)
    except (LayoutError, ValueError, FileNotFoundError, KeyError) as exc:
        print(f"error: {_one_line(exc)}", file=sys.stderr)
        return 2
    except Exception as exc:  # hydra's own config errors
        if type(exc).__module__.startswith(("hydra", "omegaconf")):
            print(f"error: {_one_line(exc)}", file=sys.stderr)
            return 2
        raise


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__


if __name__ == "__main__":
    sys.exit(main())
