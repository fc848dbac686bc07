"""Per-instance dispatch: the router's choice of one worker, and each worker's own queue.

:class:`InstanceRouter` gives ``services.scheduling.placement.choose_route`` what the router's
``WorkerPool.views`` gives it: one ``WorkerView`` per instance with its load (the router's count of
requests routed to a decode worker and not finished, the engine's running and waiting requests).
So the decode worker is the least loaded one, chosen first; the PrfaaS or PD-P prefill worker the
cache-affine one, which with no prompt identities in the simulator (a neutral affinity score) is the
least loaded. The views are exact at each arrival (the router's are as old as its last stats poll);
KV usage is not modelled (0). The chosen instances go to ``dest`` arrays the instance groups read.

:class:`PrefillInstances`: a cluster's prefill instances, each a one-instance
:class:`~services.simulator.prefill.PrefillCluster` with its own FIFO queue.
"""
from __future__ import annotations

from array import array
from collections.abc import Callable
from typing import Any

from services.planner.profiles import PiecewiseLinear
from services.scheduling.placement import PromptCache, Route, WorkerView, choose_route
from services.simulator.colocated import ColocatedInstances
from services.simulator.decode import DecodeInstances
from services.simulator.prefill import PrefillCluster
from services.simulator.setup import RunSpec, Topology

Event = Callable[[float, int], None]


class PrefillInstances:
    def __init__(self, cluster: str, num_instances: int, latency: PiecewiseLinear | None, chunk_tokens: int,
                 kinds: tuple[int, int], heap: list, arrival_t: array, num_requests: int) -> None:
        """Events as :class:`PrefillCluster`'s (a chunked step's carries its instance)."""
        first = PrefillCluster(1, latency, chunk_tokens, kinds, heap, arrival_t, num_requests)
        self.members = [first] + [PrefillCluster(1, latency, chunk_tokens, kinds, heap, arrival_t, num_requests,
                                                 event_base=i, shared=first) for i in range(1, num_instances)]
        self.cluster, self.chunk_tokens, self.num_instances = cluster, chunk_tokens, num_instances
        self.dest = array("i", bytes(4 * num_requests))
        self.num_assigned = [0] * num_instances           # the engine's running + waiting requests
        self.dirty: set[int] = set(range(num_instances))
        self.finished: Event = _nothing
        for i, member in enumerate(self.members):
            member.finished = self._finisher(i)

    def _finisher(self, instance: int) -> Event:
        def finished(now: float, rid: int) -> None:
            self.num_assigned[instance] -= 1
            self.dirty.add(instance)
            self.finished(now, rid)
        return finished

    @property
    def started(self) -> Event | None:
        return self.members[0].started

    @started.setter
    def started(self, started: Event | None) -> None:
        for member in self.members:
            member.started = started

    @property
    def num_queued(self) -> int:
        return sum(len(m.queue) for m in self.members)

    @property
    def wait_s(self) -> float:
        return sum(m.wait_s for m in self.members)

    @property
    def max_queue(self) -> int:
        """The longest queue of one instance."""
        return max((m.max_queue for m in self.members), default=0)

    @property
    def slowed_s(self) -> float:
        return sum(m.slowed_s for m in self.members)

    def slowable(self) -> None:
        for member in self.members:
            member.slowable()

    def owe(self, now: float, rid: int, cpu_s: float) -> None:
        """``rid``'s prefill instance owes ``cpu_s`` to its KV sender (:meth:`PrefillCluster.owe`)."""
        self.members[self.dest[rid]].owe(now, rid, cpu_s)

    def set_speed(self, now: float, speed: float) -> None:
        """Every instance computes at ``speed`` of the profile's speed from ``now`` on."""
        for member in self.members:
            member.set_speed(now, speed)

    def submit(self, now: float, rid: int, work: float, load_s: float = 0.0) -> None:
        instance = self.dest[rid]
        self.num_assigned[instance] += 1
        self.dirty.add(instance)
        self.members[instance].submit(now, rid, work, load_s)

    def on_event(self, now: float, key: int) -> None:
        """``key``: the request (whole prefills) or the instance (chunked steps)."""
        self.members[key if self.chunk_tokens else self.dest[key]].on_event(now, key)

    def on_loaded(self, now: float, rid: int) -> None:
        self.members[self.dest[rid]].on_loaded(now, rid)

    def view(self, instance: int) -> WorkerView:
        return WorkerView(f"{self.cluster}-prefill-{instance}", True, role="prefill", cluster=self.cluster,
                          generates=False, prefills=True, num_waiting=self.num_assigned[instance])


def build_router(spec: RunSpec, topo: Topology, heap: list, arrival_t: array, decode_s: float, first_token: Event,
                 kinds: tuple[tuple[int, int], tuple[int, int], int, tuple[int, int]]) -> InstanceRouter:
    """Every instance of ``topo`` on its own, and the router over them. ``kinds``: the heap event kinds of
    the PrfaaS and local prefill instances, of decode-role instances, and of colocated workers."""
    n, chunk = spec.num_requests, spec.runtime.chunk_tokens
    prfaas_kinds, local_kinds, decode_kind, both_kinds = kinds
    prfaas = PrefillInstances("prfaas", topo.num_prfaas, topo.prfaas_latency, chunk, prfaas_kinds, heap, arrival_t, n)
    local = PrefillInstances("local", topo.num_local_prefill, topo.local_latency, chunk, local_kinds, heap,
                             arrival_t, n)
    if topo.num_both:
        both = ColocatedInstances(topo.num_both, topo.local_latency, chunk, topo.max_batch_size, topo.decode_step_s,
                                  spec.workload.output_tokens, both_kinds, heap, n, first_token,
                                  topo.decode_step_curve)
        return InstanceRouter(prfaas, local, both, both)
    decode = DecodeInstances(topo.num_decode, topo.max_batch_size, decode_s, decode_kind, heap,
                             array("i", bytes(4 * n)), n, first_token)
    return InstanceRouter(prfaas, local, decode, None)


class InstanceRouter:
    def __init__(self, prfaas: PrefillInstances, local: PrefillInstances, decode: Any,
                 both: ColocatedInstances | None) -> None:
        """``decode``: the generating workers (:class:`~services.simulator.decode.DecodeInstances`, or
        ``both``, the colocated workers). Each group has ``num_instances``, ``dest``, ``view(i)`` and
        ``dirty`` (the instances whose load changed since the last route); ``decode`` also
        ``routed(i)``, called for an admitted request."""
        self.prfaas, self.local, self.decode, self.both = prfaas, local, decode, both
        self.groups = (decode, prfaas, local)
        self.offsets: list[int] = []
        self.views: list[WorkerView] = []
        self.where: dict[str, tuple[Any, int]] = {}
        for group in self.groups:
            self.offsets.append(len(self.views))
            for i in range(group.num_instances):
                view = group.view(i)
                self.where[view.name] = (group, i)
                self.views.append(view)

    def route(self, rid: int, num_prompt_tokens: float, threshold: float, cache: PromptCache,
              scarce: bool) -> Route | None:
        """The router's choice over the instances' loads now; ``rid``'s instances go to the groups' ``dest``."""
        views = self.views
        for group, offset in zip(self.groups, self.offsets):
            dirty = group.dirty
            while dirty:
                i = dirty.pop()
                views[offset + i] = group.view(i)
        route = choose_route(tuple(views), num_prompt_tokens, threshold, cache=cache, scarce=scarce)
        if route is None:
            return None
        decode, instance = self.where[route.decode]
        decode.dest[rid] = instance
        if route.prefill is not None:
            group, instance = self.where[route.prefill]
            group.dest[rid] = instance
        return route

    def admitted(self, rid: int) -> None:
        """``rid`` counts in flight on its decode worker until its last token (the router's count)."""
        self.decode.routed(self.decode.dest[rid])


def _nothing(now: float, rid: int) -> None:
    return None
