"""bench/hetero_layouts.py in short (512 tokens a transfer, one round), so the benchmark cannot rot:
every pairing streams over real loopback TCP, lands token for token, and its wire bytes are the KV
plus framing (512 is a multiple of every block size: no padding)."""
import sys
from pathlib import Path
from support.procs import run_to_end

ROOT = Path(__file__).resolve().parents[2]


def test_every_pairing_moves_the_kv_once():
    run = run_to_end([sys.executable, str(ROOT / "bench" / "hetero_layouts.py"), "--tokens", "512", "--chunk",
                          "256", "--rounds", "1"], timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    last = run.stdout.strip().splitlines()[-1]
    assert last.startswith("hetero layouts: worst wire bytes per KV byte: 1.0") and last.endswith("PASS"), last
