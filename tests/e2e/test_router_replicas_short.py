"""bench/router_replicas.py in short (`--quick`), so that it cannot rot: one block of its workload
through 1 router and one through 3 (`prfaas up --routers 3`, three SmolLM2 engines), which must hold
every target but TTFT's (percentiles of ~20 requests a side are noise; the full run gates them): usage's
cached tokens with 3 routers at least 0.95x those with 1, no prefill worker above its hand-off limit
(sampled at the worker), at least one role flip while 3 routers served, and every router's view of the
roles the workers' in every sample more than one stats interval after a flip."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

from support.procs import run_to_end

ROOT = Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(400)]


def test_a_short_router_replicas_run_meets_its_targets():
    run = run_to_end([sys.executable, "bench/router_replicas.py", "--quick"], cwd=ROOT, timeout=360)
    print(run.stdout[-4000:], run.stderr[-3000:])
    last = run.stdout.strip().splitlines()[-1]
    assert run.returncode == 0 and last.endswith("PASS"), run.stdout[-3000:] + run.stderr[-3000:]
    assert "flips with 3 routers 0 " not in last
