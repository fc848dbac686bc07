"""bench/cancellation.py's pieces that need no engine: it loads, says what it does, and its
requests never share a prefix (a shared one would be served from the prefix cache, and its prefill
would end before a client could leave during it). The e2e test of the same moments is
tests/e2e/embedded/test_abandoned_requests.py, on the shared embedded deployment."""
import subprocess
import sys
from pathlib import Path

from support.abandon import Held

ROOT = Path(__file__).resolve().parents[2]


def test_the_benchmark_explains_itself():
    result = subprocess.run([sys.executable, str(ROOT / "bench" / "cancellation.py"), "--help"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert "--requests" in result.stdout and "Abandoned requests free every hop" in result.stdout


def test_its_prompts_share_no_first_block():
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        import cancellation
    finally:
        sys.path.remove(str(ROOT / "bench"))
    firsts = {tuple(cancellation._prompt(i)[:16]) for i in range(300)}
    assert len(firsts) == 300


def test_rest_means_nothing_held():
    assert Held(0, 0.0, 0, 0).idle
    assert not Held(0, 0.0, 1, 0).idle and not Held(0, 0.01, 0, 0).idle and not Held(1, 0.0, 0, 0).idle
