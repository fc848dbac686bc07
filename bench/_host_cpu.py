"""CPU per request that the engines' cores spend outside the engines, for bench/sim_vs_real.py.

Two readings over each calibration load:

- the cores' busy time (``/proc/stat``: user, system, interrupts, soft interrupts) less the CPU of
  vLLM's engine processes: the router, the workers' front ends, the load generator, the kernel's
  network work for them, and whatever else runs on the host;
- the CPU of this process and its descendants but the engines (children already reaped included):
  what the project's own processes spent, which other work on the host cannot inflate or hide.

Two light loads of equal length; the difference between them per request leaves out what does not
grow with requests (start-up, idle polling, the host's background). The cores' figure is the one
the simulator should see, but it is a difference of two noisy totals: other work that comes and
goes between the loads can push it to zero or below, or past everything spent per request. So the
own processes' figure is its floor and the higher load's whole non-engine CPU per request its
ceiling; ``choose`` says which one it used and why.
"""
from __future__ import annotations

import os
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
class Choice:
    cpu_s: float     # CPU seconds per request handed to the simulator
    cores_s: float   # the cores' difference estimate
    floor_s: float   # the own processes' difference estimate
    ceiling_s: float  # all non-engine CPU per request at the higher load
    reason: str
    # per load, lighter first: (the cores' non-engine CPU s, the own processes' CPU s, requests)
    loads: tuple[tuple[float, float, int], ...] = ()

    def describe(self) -> str:
        return (f"{self.cpu_s * 1e3:.1f} ms of CPU per request ({self.reason}; cores' estimate "
                f"{self.cores_s * 1e3:.1f} ms, own processes {self.floor_s * 1e3:.1f} ms, ceiling "
                f"{self.ceiling_s * 1e3:.1f} ms)")


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


def choose(used: tuple[Reading, Reading], sent: tuple[int, int]) -> Choice:
    """CPU per request from two loads' readings (``used``, the lighter first) and requests ``sent``."""
    (low, high), (few, many) = used, sent
    loads = ((low.cores_s, low.own_s, few), (high.cores_s, high.own_s, many))
    ceiling = max(high.cores_s, high.own_s) / many if many else 0.0
    if many <= few:
        own = max(0.0, high.own_s / many) if many else 0.0
        return Choice(own, 0.0, own, ceiling, f"the two loads sent {few} and {many} requests, too few to tell "
                      "apart: the own processes' CPU per request at the higher load", loads=loads)
    cores, floor = (high.cores_s - low.cores_s) / (many - few), max(0.0, (high.own_s - low.own_s) / (many - few))
    if cores < floor:
        return Choice(floor, cores, floor, ceiling, "the cores' estimate fell below what the own processes spent "
                      "(other work on the host changed between the loads): the own processes' figure", loads=loads)
    if cores > ceiling:
        return Choice(max(floor, ceiling), cores, floor, ceiling, "the cores' estimate exceeds all the CPU spent "
                      "per request at the higher load (other work on the host): the ceiling", loads=loads)
    return Choice(cores, cores, floor, ceiling, "the cores' estimate", loads=loads)
