"""`prfaas plan`: the PrfaaS throughput planner (threshold and prefill/decode split)."""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path
from typing import Any

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
    add_measured_arguments(parser)
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    parser.add_argument("--plot", metavar="DIR", help="also write Figure-5-style PNGs into DIR (needs matplotlib)")
    parser.add_argument("--exact", action="store_true",
                        help="use E[T(L) | class] and E[S_kv(L) | class] instead of T(E[L | class])")
    parser.set_defaults(func=_run)


def add_measured_arguments(parser: argparse.ArgumentParser) -> None:
    """``--profile``, ``--workload`` and ``--codec``, shared with ``prfaas simulate``."""
    from services.planner.codec import WIRE_RATIOS

    parser.add_argument("--profile", action="append", default=[], metavar="[NAME=]FILE",
                        help="a profile YAML written by `prfaas profile`: its measured prefill curve and decode "
                        "batch replace every prefill and decode profile of the inputs, or with NAME= only that one "
                        "(repeatable, e.g. h200_prefill=a.yaml h20_prefill=b.yaml h20_decode=b.yaml)")
    parser.add_argument("--workload", metavar="FILE",
                        help="a measured workload replacing the inputs' typed one: a `prfaas bench` result JSON, or "
                        "a request trace (JSON lines or .csv with arrival_s [seconds] or timestamp [ms], "
                        "input_length, optional output_length). Fitted: the prompt-length distribution (truncated "
                        "log-normal), the mean output length, the arrival rate and the inter-arrival CV")
    parser.add_argument("--codec", choices=sorted(WIRE_RATIOS), help="the wire codec of the PrfaaS link "
                        "(`transport.codec`, docs/wire-codecs.md): its KV crosses in fewer bytes, e.g. fp8 in half "
                        "those of a 16-bit cache, so the link carries more tokens per second; default: none, and "
                        "the report does not mention it")


def load_measured_inputs(args: argparse.Namespace) -> tuple[Any, dict[str, Any]]:
    """The planner's inputs with ``--profile`` and ``--workload`` applied, and a report of what they replaced.
    Raises ``PlanInputError``."""
    from services.planner.codec import wire_ratio, with_codec
    from services.planner.inputs import load_plan_inputs
    from services.planner.measured_profile import apply_profiles, load_profile, split_profile_arg
    from services.planner.measured_workload import load_workload

    inputs = load_plan_inputs(args.config)
    measured: dict[str, Any] = {}
    if args.profile:
        targets = [(name, load_profile(path)) for name, path in map(split_profile_arg, args.profile)]
        inputs, measured["measured_profiles"] = apply_profiles(inputs, targets)
    if args.workload:
        workload = load_workload(args.workload)
        inputs = workload.apply(inputs)
        measured["measured_workload"] = workload.as_dict()
    if getattr(args, "codec", None):
        inputs = with_codec(inputs, args.codec)
        measured["codec"] = {"name": args.codec, "wire_ratio": wire_ratio(args.codec)}
    if measured:  # the published results are for the typed inputs, not for measured ones
        inputs = dataclasses.replace(inputs, paper_results=None)
    longest = max((entry["prefill"]["lengths"][-1] for entry in measured.get("measured_profiles", ())), default=None)
    if longest is not None and inputs.workload.input_length.max_tokens > longest:
        measured["extrapolation"] = (f"prompts reach {inputs.workload.input_length.max_tokens:,.0f} tokens; the "
                                     f"measured prefill profile stops at {longest:,.0f} (extrapolated linearly)")
    return inputs, measured


def measured_text(measured: dict[str, Any]) -> list[str]:
    from services.planner.measured_profile import profiles_text
    from services.planner.measured_workload import workload_text

    lines = profiles_text(measured.get("measured_profiles", ()))
    if "measured_workload" in measured:
        lines.append(workload_text(measured["measured_workload"]))
    if "extrapolation" in measured:
        lines.append(f"note: {measured['extrapolation']}")
    if "codec" in measured:
        codec = measured["codec"]
        lines.append(f"wire codec: {codec['name']} (the PrfaaS link carries {codec['wire_ratio']:g} of the KV bytes)")
    return lines


def _run(args: argparse.Namespace) -> int:
    from services.planner.inputs import PlanInputError
    from services.planner.report import plan_to_dict, run_plan

    try:
        inputs, measured = load_measured_inputs(args)
    except PlanInputError as exc:
        return _fail(str(exc))
    result = run_plan(inputs, exact=args.exact)
    out = {**measured, **plan_to_dict(result)}
    if "measured_workload" in measured:
        rate = measured["measured_workload"]["rate"]
        measured["measured_workload"]["load_factor"] = rate / result.prfaas.lambda_max
    if args.plot:
        from services.planner.plots import MatplotlibMissing, write_plan_plots

        try:
            out["plots"] = write_plan_plots(result, Path(args.plot))
        except MatplotlibMissing as exc:
            return _fail(str(exc))
    print(json.dumps(out, indent=2) if args.json else _text(out, measured))
    return 0


def _text(out: dict[str, Any], measured: dict[str, Any]) -> str:
    from services.planner.report import format_plan

    lines = measured_text(measured)
    if "measured_workload" in measured:
        lines.append(f"measured load: {measured['measured_workload']['load_factor']:.1%} of PrfaaS-PD Lambda_max")
    return "\n".join([*lines, *([""] if lines else []), format_plan(out)])


def _fail(message: str) -> int:
    print(f"prfaas plan: error: {message}", file=sys.stderr)
    return 2
