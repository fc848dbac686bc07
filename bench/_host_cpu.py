"""CPU per request that the engines' cores spend outside the engines, for bench/sim_vs_real.py.

Two readings over each load:

- the cores' busy time (``/proc/stat``: user, system, interrupts, soft interrupts) less the CPU of
  vLLM's engine processes: the router, the workers' front ends, the load generator, the kernel's
  network work for them, and whatever else runs on the host;
- the CPU of this process and its descendants but the engines (children already reaped included):
  what the project's own processes spent, which other work on the host cannot inflate or hide.

Most of a load's non-engine CPU does not depend on its requests: the services' idle polling (about
15% of a core here, varying by a second or so from load to load), the load generator's start. What a
request adds is of the same size as that noise at a light load, so a difference of two loads cannot
pin it down. ``fit`` takes every load there is (the two calibration loads, then each measured load,
up to hundreds of requests) and fits CPU = c + a x seconds + b x requests by least squares; b, with
its standard error, is the figure per request. The cores' fit is the one the simulator should see;
the own processes' fit is its floor (other work on the host that comes and goes can push the cores'
below it), and the smallest whole non-engine CPU per request of any load its ceiling. ``Choice``
says which one it used and why.
"""
from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from services.engine.shm_ledger import descendants

ENGINE_PREFIX = "VLLM::"


@dataclass(frozen=True, slots=True)
class Reading:
    """CPU seconds so far: the cores' non-engine busy time and the own processes' non-engine time."""
    cores_s: float
    own_s: float

    def __sub__(self, other: "Reading") -> "Reading":
        return Reading(self.cores_s - other.cores_s, self.own_s - other.own_s)


@dataclass(frozen=True, slots=True)
class Load:
    """What one load used (a difference of two readings), how long it took, and how many requests it sent."""
    used: Reading
    seconds: float
    requests: int


@dataclass(frozen=True, slots=True)
class Choice:
    cpu_s: float       # CPU seconds per request handed to the simulator
    cores_s: float     # the cores' fit
    floor_s: float     # the own processes' fit, at least 0
    ceiling_s: float   # the smallest whole non-engine CPU per request of any load
    reason: str
    stderr_s: float = 0.0  # the cores' fit's standard error (0 where the loads determine it exactly)
    # per load, in the order run: (the cores' non-engine CPU s, the own processes' CPU s, requests, seconds)
    loads: tuple[tuple[float, float, int, float], ...] = ()

    def describe(self) -> str:
        spread = f" +- {self.stderr_s * 1e3:.1f}" if self.stderr_s else ""
        return (f"{self.cpu_s * 1e3:.1f} ms of CPU per request ({self.reason}; over {len(self.loads)} loads the "
                f"cores' fit {self.cores_s * 1e3:.1f}{spread} ms, own processes {self.floor_s * 1e3:.1f} ms, "
                f"ceiling {self.ceiling_s * 1e3:.1f} ms)")


def read() -> Reading:
    cores = os.sched_getaffinity(0)
    busy = 0
    for line in Path("/proc/stat").read_text().splitlines():
        name, *values = line.split()
        if name.startswith("cpu") and name[3:].isdigit() and int(name[3:]) in cores:
            user, nice, system, _idle, _iowait, irq, softirq, steal = map(int, values[:8])
            busy += user + nice + system + irq + softirq + steal
    engines = own = 0
    for pid in descendants(os.getpid()) | {os.getpid()}:
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            continue
        name, fields = stat[stat.index("(") + 1:stat.rindex(")")], stat[stat.rindex(")") + 2:].split()
        ticks = sum(int(f) for f in fields[11:15])  # utime, stime, and of reaped children cutime, cstime
        if name.startswith(ENGINE_PREFIX):
            engines += ticks
        else:
            own += ticks
    tick = os.sysconf("SC_CLK_TCK")
    return Reading((busy - engines) / tick, own / tick)


def per_request(cpu: Sequence[float], loads: Sequence[Load]) -> tuple[float, float] | None:
    """The least-squares CPU per request over ``loads`` and its standard error; None where their requests
    do not vary. With four loads or more CPU = c + a x seconds + b x requests, with fewer (two light loads
    of equal length) CPU = c + b x requests, which for two loads is their difference."""
    import numpy as np

    if len({load.requests for load in loads}) < 2:
        return None
    columns = [[1.0] * len(loads), [float(load.requests) for load in loads]]
    if len(loads) >= 4 and len({round(load.seconds) for load in loads}) > 1:
        columns.insert(1, [load.seconds for load in loads])
    x, y = np.array(columns).T, np.array(cpu, dtype=float)
    coef, _, rank, _ = np.linalg.lstsq(x, y, rcond=None)
    if rank < x.shape[1]:
        return None
    dof = len(loads) - x.shape[1]
    if dof <= 0:
        return float(coef[-1]), 0.0
    variance = float(np.sum((y - x @ coef) ** 2)) / dof
    return float(coef[-1]), float(np.sqrt(variance * np.linalg.inv(x.T @ x)[-1, -1]))


def fit(loads: Sequence[Load]) -> Choice:
    """CPU per request from every load's readings (``_host_cpu``'s docstring: the model and its bounds)."""
    record = tuple((load.used.cores_s, load.used.own_s, load.requests, load.seconds) for load in loads)
    ceiling = min((max(load.used.cores_s, load.used.own_s) / load.requests for load in loads if load.requests),
                  default=0.0)
    cores = per_request([load.used.cores_s for load in loads], loads)
    own = per_request([load.used.own_s for load in loads], loads)
    if cores is None or own is None:
        return _at_largest_load(loads, ceiling, record, f"the loads sent {sorted({lo.requests for lo in loads})} "
                                "requests, too few to tell apart")
    if cores[0] <= 0 and own[0] <= 0:
        return _at_largest_load(loads, ceiling, record, f"both fits came out at or below 0 (cores' "
                                f"{cores[0] * 1e3:.1f} ms, own processes' {own[0] * 1e3:.1f} ms): the loads' "
                                "requests differ by too few to tell a request's CPU from the services' idle work",
                                cores[0])
    (cores_s, stderr), floor = cores, max(0.0, own[0])
    if cores_s < floor:
        return Choice(floor, cores_s, floor, ceiling, "the cores' fit fell below what the own processes spent "
                      "(other work on the host came and went): the own processes' fit", stderr, record)
    if cores_s > ceiling:
        return Choice(max(floor, ceiling), cores_s, floor, ceiling, "the cores' fit exceeds all the CPU a load "
                      "spent per request (other work on the host): the ceiling", stderr, record)
    return Choice(cores_s, cores_s, floor, ceiling, "the cores' fit", stderr, record)


def _at_largest_load(loads: Sequence[Load], ceiling: float, record: tuple, why: str, cores_s: float = 0.0) -> Choice:
    """Where the loads cannot pin a request's CPU down: the own processes' whole non-engine CPU per request
    at the load that sent the most (the latest of a tie), idle work included, so an upper bound rather than 0."""
    many = max(reversed(loads), key=lambda load: load.requests, default=None)
    figure = max(0.0, many.used.own_s / many.requests) if many and many.requests else 0.0
    return Choice(figure, cores_s, figure, ceiling, f"{why}: the own processes' CPU per request at the largest "
                  "load", loads=record)
