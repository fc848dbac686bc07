"""Simulator speed: simulated requests per second of wall time for a 1,000,000-request run.

Runs the static PrfaaS policy on the case study (deploy/planner/case_study.yaml) at 90% of the
planner's Lambda_max with per-request sampled lengths. Exit status 0 only when the speed meets
the target. Usage: ``python bench/simulator_speed.py [--requests N]``.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from _common import verdict  # noqa: E402
from services.planner.inputs import load_plan_inputs  # noqa: E402
from services.planner.report import run_plan  # noqa: E402
from services.simulator.engine import simulate  # noqa: E402
from services.simulator.setup import RunSpec, topology_for, workload_of  # noqa: E402

TARGET_REQUESTS_PER_S = 20_000
LOAD_FACTOR = 0.9


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=1_000_000)
    parser.add_argument("--config", default=str(ROOT / "deploy" / "planner" / "case_study.yaml"))
    args = parser.parse_args()

    inputs = load_plan_inputs(args.config)
    plan = run_plan(inputs)
    spec = RunSpec("static", topology_for("static", inputs, plan), workload_of(inputs),
                   LOAD_FACTOR * plan.prfaas.lambda_max, args.requests, plan.prfaas.threshold_tokens,
                   seed=1, progress=True)
    started = time.perf_counter()
    result = simulate(spec)
    wall_s = time.perf_counter() - started
    summary = result.summary()
    speed = args.requests / wall_s
    print(f"simulated {args.requests:,} requests ({summary['arrival_window_s']:,.0f} s of traffic) "
          f"in {wall_s:.2f} s wall; throughput {summary['throughput']:.3f} of {summary['realized_rate']:.3f} "
          f"req/s offered, P90 TTFT {summary['ttft_s']['p90']:.2f} s")
    return verdict("simulator speed, simulated requests per wall second", speed, TARGET_REQUESTS_PER_S,
                   f"{args.requests:,} requests in {wall_s:.2f} s")


if __name__ == "__main__":
    sys.exit(main())
