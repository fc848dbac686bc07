"""bench/transport_scaling.py in short (64 MiB a transfer, 1 and 2 connections, 1 and 2 I/O threads,
one round), so the benchmark cannot rot: the transport and iperf3 take turns on loopback, the
table and the plot are written, and the headline compares the best thread count with iperf3."""
import json
import shutil
import sys
from pathlib import Path

import pytest

from support.procs import run_to_end

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.skipif(shutil.which("iperf3") is None, reason="needs iperf3")


def test_it_measures_the_transport_by_threads_and_connections_against_iperf3(tmp_path):
    run = run_to_end([sys.executable, str(ROOT / "bench" / "transport_scaling.py"), "--connections", "1,2",
                      "--threads", "1,2", "--megabytes", "64", "--rounds", "1", "--out", str(tmp_path)], timeout=120)
    assert run.returncode in (0, 1), run.stdout[-3000:] + run.stderr[-3000:]
    *_, plot_line, last = run.stdout.strip().splitlines()
    assert plot_line == f"plot: {tmp_path / 'scaling.png'}" and (tmp_path / "scaling.png").stat().st_size > 0
    points = json.loads((tmp_path / "points.json").read_text())
    assert {(p["threads"], p["connections"]) for p in points["transport"]} == {(1, 1), (1, 2), (2, 1), (2, 2)}
    assert all(p["gbps"] > 0 for p in points["transport"] + points["iperf3"])
    assert last.startswith("transport scaling, 2 connections, best I/O threads vs iperf3 -P 2: "), last
    assert last.endswith("PASS" if run.returncode == 0 else "FAIL"), last
