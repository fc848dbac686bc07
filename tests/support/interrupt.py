"""Stopping on SIGTERM as on Ctrl-C: a test run or a benchmark that is told to stop (CI's time
limit, a timeout, an operator's `kill`) unwinds its ``finally`` blocks and fixture teardowns, so the
services, delay lines, namespaces and shared-memory files it made are removed before it exits.
Python's default for SIGTERM ends the process at once and leaves all of them behind."""
from __future__ import annotations

import ctypes
import os
import signal
import sys

PR_SET_PDEATHSIG = 1


class Stopped(KeyboardInterrupt):
    """Raised in the main thread when the process receives SIGTERM or SIGHUP."""


def stop_on_signals() -> None:
    """SIGTERM and SIGHUP raise ``Stopped`` (a KeyboardInterrupt, which pytest and ``finally``
    blocks treat as Ctrl-C). A second signal while unwinding is ignored: the clean-up finishes."""
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _raise_stopped)


def _raise_stopped(signum: int, frame) -> None:
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)
    raise Stopped(f"stopped by {signal.Signals(signum).name}")


def stop_with_parent() -> None:
    """SIGTERM this process when its parent ends (Linux): `make test` is the parent of pytest, and
    make does not pass a SIGTERM on to the command it runs, so a stopped make would leave the suite
    running with all it started."""
    if not sys.platform.startswith("linux"):
        return
    parent = os.getppid()
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0) != 0:
        return
    if os.getppid() != parent:  # the parent ended before the request took effect
        os.kill(os.getpid(), signal.SIGTERM)
