import importlib
import subprocess
import sys

import pytest

from services.cli import COMMAND_MODULES


@pytest.mark.parametrize("module", COMMAND_MODULES)
def test_every_command_module_registers(module):
    assert callable(importlib.import_module(module).register)


def test_help_lists_every_command():
    out = subprocess.run([sys.executable, "-m", "services.cli", "--help"], capture_output=True, text=True,
                         check=True).stdout
    for command in ("up", "router", "prefill-worker", "decode-worker", "plan", "simulate", "bench", "model", "profile"):
        assert command in out


def test_worker_command_rejects_unknown_worker(tmp_path):
    result = subprocess.run([sys.executable, "-m", "services.cli", "decode-worker", "--config",
                             "deploy/local.yaml", "--name", "nope"], capture_output=True, text=True)
    assert result.returncode == 2
    assert "no worker named 'nope'" in result.stderr


def test_up_rejects_bad_config(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("router: {port: http}\n")
    result = subprocess.run([sys.executable, "-m", "services.cli", "up", "--config", str(bad)],
                            capture_output=True, text=True)
    assert result.returncode == 2
    assert "router.port: expected int" in result.stderr
