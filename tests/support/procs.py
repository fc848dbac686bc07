"""The machine's process table, read from /proc: what tests and benchmarks check for leftovers."""
from __future__ import annotations

import subprocess

from services.procs import group_alive, processes  # noqa: F401  (group_alive: for the tests)


def group_pids(pgid: int) -> list[int]:
    return [p.pid for p in processes() if p.pgid == pgid]


def descendants(root: int) -> list[int]:
    """Every process below ``root`` now: its children, theirs, and the members of their sessions
    (a service started in a session of its own keeps its engines there after it exits)."""
    table = processes()
    found, frontier = set(), {root}
    while frontier:
        found |= frontier
        frontier = {p.pid for p in table if p.ppid in frontier or p.sid in frontier} - found
    return sorted(found - {root})


def alive(pid: int) -> bool:
    try:
        return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


STOP_GRACE_S = 60.0


def run_to_end(argv: list[str], timeout: float, **kwargs) -> subprocess.CompletedProcess:
    """``subprocess.run(argv, capture_output=True, text=True, timeout=timeout)``, except for how a
    command is stopped: when the test is stopped meanwhile (Ctrl-C, CI's SIGTERM) or the command
    runs past ``timeout``, it gets SIGTERM and up to ``STOP_GRACE_S`` to remove what it made (its
    deployment, delay lines, network namespaces, shared memory) before SIGKILL. subprocess.run
    SIGKILLs it at once, which leaves all of that behind."""
    process = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kwargs)
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    except BaseException:
        process.terminate()
        try:
            process.communicate(timeout=STOP_GRACE_S)
        except BaseException:
            process.kill()
            process.communicate()
        raise
    return subprocess.CompletedProcess(argv, process.returncode, stdout, stderr)
