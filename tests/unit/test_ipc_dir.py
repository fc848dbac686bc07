"""The private directory a worker gives vLLM's IPC sockets (services/engine/ipc_dir.py)."""
from __future__ import annotations

import os
import socket
import stat
import subprocess
import sys

import pytest

from services.engine import ipc_dir


@pytest.fixture
def no_operator_choice(monkeypatch):
    monkeypatch.setenv(ipc_dir.ENV, "")  # recorded, so that what prepare() sets is undone after the test
    monkeypatch.delenv(ipc_dir.ENV)


def test_a_worker_gets_a_private_directory_that_stop_removes_with_its_sockets(tmp_path, no_operator_choice):
    path = ipc_dir.prepare(tmp_path)
    assert path == tmp_path / f"prfaas-ipc-{os.getpid()}" and os.environ[ipc_dir.ENV] == str(path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o700
    with socket.socket(socket.AF_UNIX) as server:
        server.bind(str(path / "engine.sock"))  # what vLLM's ZeroMQ sockets leave behind
    ipc_dir.remove(path)
    assert not path.exists()


def test_the_directories_of_killed_workers_are_swept_and_live_ones_kept(tmp_path, no_operator_choice):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (tmp_path / f"prfaas-ipc-{dead.pid}").mkdir()
    (tmp_path / f"prfaas-ipc-{dead.pid}" / "left.sock").touch()
    live = tmp_path / f"prfaas-ipc-{os.getppid()}"
    live.mkdir()
    other = tmp_path / "prfaas-ipc-notapid"
    other.mkdir()
    assert ipc_dir.sweep(tmp_path) == 1
    assert not (tmp_path / f"prfaas-ipc-{dead.pid}").exists() and live.exists() and other.exists()


def test_an_operator_choice_of_socket_path_is_left_alone(tmp_path, monkeypatch):
    monkeypatch.setenv(ipc_dir.ENV, "/srv/ipc")
    path = ipc_dir.prepare(tmp_path)  # still the worker's own, for the connector's telemetry files
    assert os.environ[ipc_dir.ENV] == "/srv/ipc"
    assert path == tmp_path / f"prfaas-ipc-{os.getpid()}" and stat.S_IMODE(path.stat().st_mode) == 0o700
