"""bench/layerwise_overlap.py in short (a 1,024-token prompt), so the benchmark cannot rot: three
engines prefill with the connector, a warm-up transfer sizes the capped link by the goodput it
delivers, and it prints the raw share and then its headline, the share beyond the unavoidable."""
import sys
from pathlib import Path

import pytest

from support.netns import available
from support.procs import run_to_end

pytestmark = [pytest.mark.e2e, pytest.mark.skipif(available() is not None, reason=str(available()))]
ROOT = Path(__file__).resolve().parents[2]


def test_it_sizes_the_link_by_its_goodput_and_reports_beyond_the_unavoidable():
    run = run_to_end([sys.executable, str(ROOT / "bench" / "layerwise_overlap.py"), "--prompt-tokens", "1024"],
                         timeout=600)
    assert run.returncode in (0, 1), run.stdout[-3000:] + run.stderr[-3000:]
    assert "warm-up transfer: a " in run.stderr, run.stderr[-3000:]
    *_, raw, last = run.stdout.strip().splitlines()
    assert raw.startswith("layer-wise exposed transfer time / send-after transfer time, raw: "), raw
    assert last.startswith("layer-wise exposed transfer time beyond the unavoidable / send-after transfer time: "), last
    assert last.endswith("PASS" if run.returncode == 0 else "FAIL"), last
