"""bench/transport_wan.py in short (8 MiB a transfer, one round, a 2 ms round trip), so the
benchmark cannot rot: the transport and iperf3 both cross the delay line with 1% loss, and it prints
the cap fraction and then its headline, goodput against iperf3's with as many connections."""
import shutil
import sys
from pathlib import Path

import pytest

from support.netns import available
from support.procs import run_to_end

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.skipif(available() is not None, reason=str(available())),
              pytest.mark.skipif(shutil.which("iperf3") is None, reason="needs iperf3")]


def test_it_measures_the_transport_against_iperf3_on_the_same_path():
    run = run_to_end([sys.executable, str(ROOT / "bench" / "transport_wan.py"), "--megabytes", "8", "--rounds", "1",
                          "--rtt-ms", "2", "--rate-mbit", "200"], timeout=120)
    assert run.returncode in (0, 1), run.stdout[-3000:] + run.stderr[-3000:]
    *_, cap, last = run.stdout.strip().splitlines()
    assert "fraction of the nominal cap" in cap and "iperf3 -P 8" in cap, cap
    assert last.startswith("transport WAN goodput vs iperf3 on the same path, 8 connections: "), last
    assert last.endswith("PASS" if run.returncode == 0 else "FAIL"), last
