"""Facts about operating-system processes that several services' clean-ups share."""
from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Process:
    pid: int
    state: str      # R, S, D, Z (zombie), ...
    ppid: int
    pgid: int
    sid: int

    @property
    def alive(self) -> bool:
        return self.state != "Z"


def processes() -> list[Process]:
    """Every process now, from /proc (one that ends while it is read is left out)."""
    table = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as stat:
                    fields = stat.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            table.append(Process(int(entry), fields[0], int(fields[1]), int(fields[2]), int(fields[4])))
    return table


def group_alive(pgid: int) -> bool:
    """Any live process left in the process group ``pgid``. A zombie is not: it has ended and holds
    nothing but its entry until its parent reaps it, and once a service's main process has exited its
    zombies wait for the machine's init (here up to 1.7 s)."""
    if not os.path.isdir("/proc"):
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return False
        return True
    return any(p.alive for p in processes() if p.pgid == pgid)


def process_alive(pid: int) -> bool:
    """A process ``pid`` exists (ours or not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


# A service started by a supervisor (`prfaas up`, a test's or a benchmark's deployment) ends with it:
# the supervisor names itself in this variable, and the service asks the kernel for SIGTERM when the
# process that started it dies, even by SIGKILL (the OOM killer, a timeout), so that it drains and
# stops as on an operator's SIGTERM instead of holding its ports and memory for nobody.
SUPERVISOR_PID = "PRFAAS_SUPERVISOR_PID"
# In the router started by `prfaas up`: the file where `up` counts its restarts of each service
# (services/launcher/watch.py), which the router exports on /metrics.
LAUNCHER_STATS = "PRFAAS_LAUNCHER_STATS"
_PR_SET_PDEATHSIG = 1


def supervised_env() -> dict[str, str]:
    """What a supervisor adds to a service's environment so that the service ends with it."""
    return {SUPERVISOR_PID: str(os.getpid())}


def end_with_supervisor() -> None:
    """In a service: SIGTERM this process when its supervisor dies (Linux; elsewhere nothing). The
    variable is removed, so that what the service starts does not inherit it. A supervisor already
    gone is a SIGTERM now. Started through a wrapper that forks (the parent is not the supervisor),
    the service ends with the wrapper, which ends with the supervisor."""
    supervisor = os.environ.pop(SUPERVISOR_PID, "")
    if not supervisor.isdigit() or not os.uname().sysname == "Linux":
        return
    import ctypes
    import signal

    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0) != 0:
        return
    if not process_alive(int(supervisor)):  # it died before the request above: nobody will signal
        os.kill(os.getpid(), signal.SIGTERM)
