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

__all__ = ["main", "plan_from_config"]


def plan_from_config(cfg):
    """(spec, training layout, vLLM layout, plan) for a composed plan config."""
    from .adapters.megatron.rules import MegatronParallel, megatron_layout
    from .adapters.vllm.rules import VllmParallel, vllm_layout
    from .config import build_dataclass, resolve_model
    from .plan import get_plan

    spec = resolve_model(str(cfg.model), dtype=str(cfg.dtype) if cfg.get("dtype") else None)
    mpar = build_dataclass(MegatronParallel, cfg.training, "training")
    vpar = build_dataclass(VllmParallel, cfg.vllm, "vllm")
    src = megatron_layout(spec, mpar)
    dst = vllm_layout(spec, vpar)
    plan = get_plan(src, dst, buffer_bytes=int(cfg.refit.buffer_bytes), allow_cast=bool(cfg.refit.allow_cast))
    return spec, src, dst, plan


def _cmd_plan(args, overrides: Sequence[str]) -> int:
    from .config import compose
    from .plan import plan_report

    cfg = compose("plan", overrides)
    spec, src, dst, plan = plan_from_config(cfg)
    report = plan_report(plan)
    if args.json:
        print(json.dumps(report.to_json()))
    else:
        title = f"refit plan: {spec.name} ({spec.dtype}), training {src.name} -> vLLM {dst.name}"
        print(report.table(title))
    return 0


def _cmd_refit(args, overrides: Sequence[str]) -> int:
    from .refit import run_refit_job

    return run_refit_job(overrides, as_json=args.json)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="mcore-reshard", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("command", choices=["plan", "refit"])
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
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
