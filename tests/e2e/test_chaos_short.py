"""The chaos benchmark's short version, so that it cannot rot: bench/chaos.py for under three
minutes with three faults (the PrfaaS prefill worker and the local cache pool killed and restarted,
the WAN link dropped) must meet the benchmark's own targets: no wrong, hung or lost answer, nothing
leaked, and the requests no killed process held completed. The full run (5 minutes, every fault)
is `python bench/chaos.py`; docs/reliability.md gives its figures. Needs root (skipped otherwise)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from support import netns

ROOT = Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(1500)]


def test_a_short_chaos_run_meets_its_targets(tmp_path):
    if (reason := netns.available()) is not None:
        pytest.skip(f"chaos {reason}")
    run = subprocess.run([sys.executable, "bench/chaos.py", "--minutes", "2.5", "--seed", "1",
                          "--faults", "kill_prefill,kill_pool,link_drop", "--out", str(tmp_path)],
                         cwd=ROOT, capture_output=True, text=True, timeout=1400)
    print(run.stdout[-6000:], run.stderr[-3000:])
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert run.stdout.strip().splitlines()[-1].endswith("PASS")
    summary = json.loads((tmp_path / "chaos.json").read_text())["summary"]
    requests = summary["requests"]
    assert requests["sent"] >= 40 and requests["wrong"] == requests["hung"] == requests["lost"] == 0
    assert {f["name"] for f in json.loads((tmp_path / "chaos.json").read_text())["faults"]} == {
        "kill_prefill", "kill_pool", "link_drop"}
    assert (tmp_path / "chaos.png").stat().st_size > 10_000
