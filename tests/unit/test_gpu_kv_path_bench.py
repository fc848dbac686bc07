"""bench/gpu_kv_path.py in its CPU form, small: the connector's worker core driven in Model Runner V2's
order over a real loopback KVTransport, every case's bytes checked against its reference (so the
benchmark cannot rot on machines without a GPU)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_cpu_form_moves_every_byte_and_prints_its_verdict_last():
    command = [sys.executable, str(ROOT / "bench" / "gpu_kv_path.py"), "--device", "cpu", "--tokens", "64",
               "--layers", "4", "--rounds", "1"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout.strip().splitlines()
    cases = [line.rsplit(None, 1) for line in lines[2:-1]]
    assert [line[0].split("  ")[0].strip() for line in cases] == ["tp1-1 LBNHC", "tp1-1 LBHNC", "tp1-2", "tp2-1",
                                                                 "tp1-1 fp8", "tp1-1 int8", "pool"]
    assert all(line[1] == "match" for line in cases)
    assert lines[-1].startswith("gpu_kv_path (cpu): worst slowdown") and lines[-1].endswith("PASS")
    assert "bytes match in every case" in lines[-1]
