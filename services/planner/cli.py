"""`prfaas plan`: the PrfaaS throughput planner (threshold and prefill/decode split)."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

DEFAULT_CONFIG = Path(__file__).resolve().parents[2] / "deploy" / "planner" / "case_study.yaml"


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "plan",
        help="plan a PrfaaS deployment: length threshold and prefill/decode split",
        description="Find the routing threshold t and the local prefill/decode split N_p/N_d that maximize "
        "the sustainable request rate Lambda_max (paper, section 3.4), and compare with homogeneous PD "
        "and naive heterogeneous deployments.",
    )
    parser.add_argument("--config", default=str(DEFAULT_CONFIG),
                        help="planner input YAML (default: deploy/planner/case_study.yaml)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    parser.add_argument("--plot", metavar="DIR", help="also write Figure-5-style PNGs into DIR (needs matplotlib)")
    parser.add_argument("--exact", action="store_true",
                        help="use E[T(L) | class] and E[S_kv(L) | class] instead of T(E[L | class])")
    parser.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    from services.planner.inputs import PlanInputError, load_plan_inputs
    from services.planner.report import format_plan, plan_to_dict, run_plan

    try:
        inputs = load_plan_inputs(args.config)
    except PlanInputError as exc:
        return _fail(str(exc))
    result = run_plan(inputs, exact=args.exact)
    out = plan_to_dict(result)
    if args.plot:
        from services.planner.plots import MatplotlibMissing, write_plan_plots

        try:
            out["plots"] = write_plan_plots(result, Path(args.plot))
        except MatplotlibMissing as exc:
            return _fail(str(exc))
    print(json.dumps(out, indent=2) if args.json else format_plan(out))
    return 0


def _fail(message: str) -> int:
    print(f"prfaas plan: error: {message}", file=sys.stderr)
    return 2
