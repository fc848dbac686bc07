"""A private directory for vLLM's IPC sockets, removed when the worker stops.

vLLM's engine processes talk over ZeroMQ sockets on files it names ``<uuid>`` in
``VLLM_RPC_BASE_PATH`` (the temp directory unless set), and leaves them there: measured in this
project, a clean stop of the embedded default's two workers left 14 socket files in /tmp, and about
5,800 had piled up after days of tests and chaos runs. So a worker gives its engine a directory of
its own (``prfaas-ipc-<pid>``, mode 0700), removes it when it stops, and at start removes the
directories of workers that are gone (killed before they could). A ``VLLM_RPC_BASE_PATH`` set by
the operator is left alone. The directory also holds the connector's telemetry files, one per TP
rank (``services.kv_connector.stats_file``).
"""
from __future__ import annotations

import logging
import os
import shutil
import tempfile
from pathlib import Path

from services.procs import process_alive

logger = logging.getLogger(__name__)

ENV = "VLLM_RPC_BASE_PATH"
PREFIX = "prfaas-ipc-"


def prepare(base: Path | None = None) -> Path:
    """Give this process's engine a directory of its own (and sweep those of dead workers): for its
    IPC sockets unless the operator chose ``VLLM_RPC_BASE_PATH``, and for the connector's telemetry
    files (``services.kv_connector.stats_file``)."""
    base = base or Path(tempfile.gettempdir())
    sweep(base)
    path = base / f"{PREFIX}{os.getpid()}"
    path.mkdir(mode=0o700, exist_ok=True)
    if not os.environ.get(ENV):
        os.environ[ENV] = str(path)
    return path


def sweep(base: Path) -> int:
    """Remove the socket directories of workers that no longer run; returns how many."""
    removed = 0
    for path in base.glob(f"{PREFIX}*"):
        pid = path.name[len(PREFIX):]
        if pid.isdigit() and not process_alive(int(pid)) and path.is_dir() and path.stat().st_uid == os.getuid():
            shutil.rmtree(path, ignore_errors=True)
            removed += 1
    if removed:
        logger.info("removed %d IPC socket directories of stopped workers", removed)
    return removed


def remove(path: Path | None) -> None:
    if path is not None:
        shutil.rmtree(path, ignore_errors=True)

