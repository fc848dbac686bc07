"""A test run that is stopped unwinds: SIGTERM to pytest, or the end of its parent (`make test`
stopped by CI's time limit; make passes no signal on), runs every fixture's teardown, where the
suite's deployments, links and namespaces are removed (tests/support/interrupt.py)."""
from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parents[1]


@pytest.fixture
def suite(tmp_path):
    """A tiny suite whose one test holds a fixture (its teardown writes ``torn-down``) and waits."""
    (tmp_path / "conftest.py").write_text(textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(TESTS)!r})
        from support.interrupt import stop_on_signals, stop_with_parent

        def pytest_configure(config):
            stop_on_signals()
            stop_with_parent()
    """))
    (tmp_path / "test_waits.py").write_text(textwrap.dedent("""
        import pathlib, time, pytest

        HERE = pathlib.Path(__file__).parent

        @pytest.fixture
        def service():
            yield
            (HERE / "torn-down").write_text("ok")

        def test_waits(service):
            (HERE / "running").write_text("ok")
            time.sleep(120)
    """))
    return tmp_path


def _pytest(suite: Path) -> list[str]:
    return [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:randomly", str(suite)]


def _wait_for(path: Path, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        assert time.monotonic() < deadline, f"{path.name} never appeared"
        time.sleep(0.1)


def test_sigterm_runs_the_teardowns(suite):
    run = subprocess.Popen(_pytest(suite), cwd=suite, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    _wait_for(suite / "running")
    run.send_signal(signal.SIGTERM)
    output, _ = run.communicate(timeout=60)
    assert (suite / "torn-down").exists(), output
    assert run.returncode == pytest.ExitCode.INTERRUPTED, output
    assert "stopped by SIGTERM" in output


def test_the_end_of_its_parent_stops_the_run_and_runs_the_teardowns(suite):
    # The parent stands in for make: it starts pytest and is killed without passing anything on.
    parent = subprocess.Popen([sys.executable, "-c", "import subprocess, sys; subprocess.run(sys.argv[1:])",
                               *_pytest(suite)], cwd=suite, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    _wait_for(suite / "running")
    parent.kill()
    parent.wait()
    _wait_for(suite / "torn-down", timeout_s=30)
