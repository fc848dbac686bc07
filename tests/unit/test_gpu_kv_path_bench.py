"""bench/gpu_kv_path.py in its CPU form, small: the producer and consumer halves over a real
loopback KVTransport, every layer's bytes checked end to end (so the benchmark cannot rot on
machines without a GPU)."""
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
    assert [line.split()[0] for line in lines[2:4]] == ["LBNHC", "LBHNC"]
    assert all(line.endswith("match") for line in lines[2:4])
    assert lines[-1].startswith("gpu_kv_path (cpu): slowdown") and lines[-1].endswith("PASS")
    assert "bytes match in every layer of every layout" in lines[-1]
