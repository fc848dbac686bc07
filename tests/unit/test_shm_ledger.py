"""A worker's ledger of the shared-memory segments its processes map: a killed worker's segments
are removed by its next start, and nothing that a live process maps or that the ledger does not
list is touched."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from services.engine import shm_ledger

HOLDER = """
import sys, time
from multiprocessing import resource_tracker, shared_memory
segment = shared_memory.SharedMemory(create=True, size=1 << 20)
resource_tracker.unregister(segment._name, "shared_memory")  # as vLLM's killed engines leave them
print(segment.name, flush=True)
time.sleep(600)
"""


@pytest.fixture
def holder():
    """A child process that maps a fresh /dev/shm segment, as an engine process does."""
    process = subprocess.Popen([sys.executable, "-c", HOLDER], stdout=subprocess.PIPE, text=True)
    path = Path("/dev/shm") / process.stdout.readline().strip()
    yield process, path
    process.kill()
    process.wait()
    path.unlink(missing_ok=True)


def _owned_by_a_dead_process(ledger: Path) -> None:
    """Record what this process and its children map, as a worker does, under a pid that is gone."""
    shm_ledger.record(ledger, pid=os.getpid())
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    entry = json.loads(ledger.read_text())
    ledger.write_text(json.dumps({**entry, "pid": dead.pid}))


def test_a_killed_workers_segments_are_removed_by_the_next_start(holder, tmp_path):
    process, path = holder
    ledger = tmp_path / "w.shm.json"
    assert shm_ledger.record(ledger, pid=os.getpid()) >= 1      # the child is one of ours
    assert str(path) in json.loads(ledger.read_text())["segments"]
    assert shm_ledger.sweep(ledger) == []                       # its owner is alive: nothing to do
    assert path.exists() and ledger.exists()

    _owned_by_a_dead_process(ledger)
    assert shm_ledger.sweep(ledger) == []                       # dead owner, but a live process maps it
    assert path.exists()

    _owned_by_a_dead_process(ledger)
    os.kill(process.pid, signal.SIGKILL)
    process.wait()
    time.sleep(0.1)
    assert path.exists()                                        # SIGKILL leaves the file behind
    assert shm_ledger.sweep(ledger) == [str(path)]
    assert not path.exists() and not ledger.exists()


def test_the_sweep_touches_only_plain_files_directly_in_dev_shm(tmp_path):
    """Files outside /dev/shm (named directly, through ``..`` or through a link) and files the
    ledger does not list are never removed. Every target here is a file this test made."""
    outside = tmp_path / "outside"
    outside.write_bytes(b"x")
    stranger = Path("/dev/shm") / f"prfaas-test-stranger-{os.getpid()}"
    link = Path("/dev/shm") / f"prfaas-test-link-{os.getpid()}"
    stranger.write_bytes(b"x")
    link.symlink_to(outside)
    try:
        dead = subprocess.Popen([sys.executable, "-c", "pass"])
        dead.wait()
        ledger = tmp_path / "w.shm.json"
        climbing = "/dev/shm/../" + str(outside).lstrip("/")
        ledger.write_text(json.dumps({"pid": dead.pid, "segments": [str(outside), climbing, str(link)]}))
        assert shm_ledger.sweep(ledger) == []
        assert outside.exists() and stranger.exists() and link.is_symlink()
    finally:
        stranger.unlink()
        link.unlink()


def test_an_unreadable_ledger_is_dropped(tmp_path):
    ledger = tmp_path / "w.shm.json"
    ledger.write_text("{not json")
    assert shm_ledger.sweep(ledger) == []
    assert not ledger.exists()
