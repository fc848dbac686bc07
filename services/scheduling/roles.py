"""Long-timescale role flips of local PD workers (paper, section 3.4.3; docs/architecture.md).

Every observation the caller hands in a :class:`StageSnapshot` of the local PD workers that hold a
single role (``prefill`` = PD-P, ``decode`` = PD-D). The binding stage is read from queues and
utilization:

- **prefill binds** when prefill requests queue up (``prefill_queue_high`` or more per PD-P worker)
  while decode has room (mean decode utilization at most ``decode_utilization_low``);
- **decode binds** when decode is busy (mean utilization, ``max(running / max_running, KV usage)``,
  at least ``decode_utilization_high``) while prefill keeps up (at most ``prefill_queue_low`` queued
  per PD-P worker).

When one stage has bound for ``sustain_s`` and no flip happened in the last ``min_dwell_s``, a worker
of the other role is put to **drain**: a flippable one, never the last ``min_workers_per_role``; one
whose configured (home) role is the binding stage first, so a worker lent to the other stage is the
first to go back and the configured layout is where flips return to; then the least busy. Draining,
the router stops giving it new work in its old role. Once its in-flight work is done the flip
completes; a drain that takes longer than ``max_drain_s`` is cancelled and the worker keeps its
role. Pure: no I/O; the caller supplies the clock in the snapshot.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

Role = Literal["prefill", "decode"]


@dataclass(frozen=True, slots=True)
class RoleFlipConfig:
    min_dwell_s: float = 300.0
    sustain_s: float = 60.0
    max_drain_s: float = 120.0
    prefill_queue_high: float = 4.0
    prefill_queue_low: float = 1.0
    decode_utilization_high: float = 0.85
    decode_utilization_low: float = 0.5
    min_workers_per_role: int = 1


@dataclass(frozen=True, slots=True)
class PdWorkerLoad:
    name: str
    role: Role
    num_in_flight: int = 0
    num_prefill_queued: int = 0
    decode_utilization: float = 0.0
    flippable: bool = True
    home_role: str | None = None  # the role the deployment configures it with; None: no preference


@dataclass(frozen=True, slots=True)
class StageSnapshot:
    now_s: float
    workers: tuple[PdWorkerLoad, ...]


@dataclass(frozen=True, slots=True)
class RoleAction:
    """``drain``: stop new work for ``worker`` in its old role; ``flip``: it now serves ``to_role``;
    ``cancel``: the drain gave up, it keeps its old role."""

    kind: Literal["drain", "flip", "cancel"]
    worker: str
    to_role: Role


def binding_stage(snapshot: StageSnapshot, config: RoleFlipConfig) -> Role | None:
    prefill = [w for w in snapshot.workers if w.role == "prefill"]
    decode = [w for w in snapshot.workers if w.role == "decode"]
    if not prefill or not decode:
        return None
    queue = sum(w.num_prefill_queued for w in prefill) / len(prefill)
    utilization = sum(w.decode_utilization for w in decode) / len(decode)
    if queue >= config.prefill_queue_high and utilization <= config.decode_utilization_low:
        return "prefill"
    if utilization >= config.decode_utilization_high and queue <= config.prefill_queue_low:
        return "decode"
    return None


class RoleBalancer:
    """Call :meth:`observe` every poll; apply the returned action (at most one). Never blocks."""

    def __init__(self, config: RoleFlipConfig) -> None:
        self.config = config
        self.binding: Role | None = None
        self.draining: RoleAction | None = None
        self._binding_since_s = math.inf
        self._drain_since_s = 0.0
        self._last_flip_s = -math.inf

    def observe(self, snapshot: StageSnapshot) -> RoleAction | None:
        if self.draining is not None:
            return self._continue_drain(snapshot)
        binding = binding_stage(snapshot, self.config)
        if binding != self.binding:
            self.binding = binding
            self._binding_since_s = snapshot.now_s
        if binding is None or snapshot.now_s - self._binding_since_s < self.config.sustain_s:
            return None
        if snapshot.now_s - self._last_flip_s < self.config.min_dwell_s:
            return None
        worker = self._donor(snapshot, binding)
        if worker is None:
            return None
        self.draining = RoleAction("drain", worker.name, binding)
        self._drain_since_s = snapshot.now_s
        return self.draining

    def abandon(self) -> None:
        """Forget the drain in progress: its worker refused it, or another router decides now."""
        self.draining = None

    def _donor(self, snapshot: StageSnapshot, binding: Role) -> PdWorkerLoad | None:
        """A worker of the role that does not bind, if that role can spare one: one lent away from the
        binding stage first (it goes home), then the least busy."""
        others = [w for w in snapshot.workers if w.role != binding]
        candidates = [w for w in others if w.flippable]
        if len(others) <= self.config.min_workers_per_role or not candidates:
            return None
        return min(candidates, key=lambda w: (w.home_role != binding, w.num_in_flight, w.num_prefill_queued,
                                              w.decode_utilization, w.name))

    def _continue_drain(self, snapshot: StageSnapshot) -> RoleAction | None:
        drain = self.draining
        assert drain is not None  # called only while a worker drains
        worker = next((w for w in snapshot.workers if w.name == drain.worker), None)
        if worker is not None and worker.num_in_flight == 0 and worker.num_prefill_queued == 0:
            return self._finish("flip", snapshot.now_s)
        if worker is None or snapshot.now_s - self._drain_since_s > self.config.max_drain_s:
            return self._finish("cancel", snapshot.now_s)
        return None

    def _finish(self, kind: Literal["flip", "cancel"], now_s: float) -> RoleAction:
        drain, self.draining = self.draining, None
        assert drain is not None  # called only while a worker drains
        self._binding_since_s = now_s
        if kind == "flip":
            self._last_flip_s = now_s
        return RoleAction(kind, drain.worker, drain.to_role)
