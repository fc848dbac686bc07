"""support.procs.run_to_end: a benchmark run by a test that is stopped (or runs too long) gets SIGTERM
and time to remove what it made, where subprocess.run would SIGKILL it and leave it all behind."""
import subprocess
import sys

import pytest

from support.procs import run_to_end

CLEANS_UP = """
import signal, sys, time
def stop(*_):
    time.sleep(0.5)  # removing namespaces and services takes a while
    open(sys.argv[1], "w").write("cleaned up")
    sys.exit(3)
signal.signal(signal.SIGTERM, stop)
print("started", flush=True)
time.sleep(60)
"""


def test_a_command_past_its_timeout_gets_sigterm_and_cleans_up(tmp_path):
    marker = tmp_path / "marker"
    with pytest.raises(subprocess.TimeoutExpired):
        run_to_end([sys.executable, "-c", CLEANS_UP, str(marker)], timeout=2)
    assert marker.read_text() == "cleaned up"


def test_a_command_that_ends_is_returned_as_subprocess_run_would():
    run = run_to_end([sys.executable, "-c", "import sys; print('out'); print('err', file=sys.stderr); sys.exit(4)"],
                     timeout=30)
    assert (run.returncode, run.stdout, run.stderr) == (4, "out\n", "err\n")
