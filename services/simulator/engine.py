"""The discrete-event loop: arrivals -> prefill (PrfaaS or local) -> [link] -> decode.

Each arrival is routed by the router's own policy, ``services.scheduling.placement.choose_route``,
over a snapshot of the deployment as one worker per role (a decode pool that receives KV, the PrfaaS
prefill cluster, the local PD-P cluster), with the threshold of the moment and
``offload.bandwidth_scarce``; its cached prefix per cluster (a ``prefix_hit`` is held by both
clusters' pools) is what ``decide_offload`` turns into the incremental length that is prefilled.
Each cluster's prefill is :class:`~services.simulator.prefill.PrefillCluster` (whole requests or
chunked steps, pool loads). A request prefilled on the PrfaaS cluster queues for the cross-cluster
:class:`~services.simulator.link.Link` when its prefill ends, or when it starts with layer-wise
streaming (its KV is then complete at the later of the two ends). Its TTFT ends when its KV sits on
a decode instance with a free batch slot (half the link's round trip after the last byte is sent);
the slot is held for ``output_tokens * step_time``. Local prefill hands KV to decode over the
intra-cluster fabric, taken as free. See :mod:`services.simulator.runtime` for the runtime inputs.

With ``per_instance`` (or ``local_both``) the views are one per instance and each instance queues its
own requests (:mod:`services.simulator.instances`, :mod:`services.simulator.decode`,
:mod:`services.simulator.colocated`); with ``admission`` the router's admission control judges each
routed request (:mod:`services.simulator.admission`), and a rejected one enters no queue.

Per-request state lives in flat arrays; events are ``(time, kind, id)`` tuples on a heap, one
handler per kind (``self.handlers``); arrivals are drawn one ahead, off the heap. The adaptive
policy runs the router's ``CongestionAwareThreshold``, fed by :mod:`services.simulator.observe`.
"""
from __future__ import annotations

import heapq
import math
import random
import sys
import time
from array import array

from services.scheduling.congestion import CongestionAwareThreshold
from services.scheduling.offload import bandwidth_scarce
from services.scheduling.placement import PromptCache, choose_route
from services.simulator.admission import SimAdmission
from services.simulator.arrivals import ReplayedArrivals, make_arrivals
from services.simulator.bandwidth import bandwidth_at
from services.simulator.colocated import ColocatedInstances
from services.simulator.decode import DecodePool
from services.simulator.instances import InstanceRouter, build_router
from services.simulator.link import Link
from services.simulator.observe import observe
from services.simulator.prefill import PrefillCluster
from services.simulator.results import SimResult, result_of
from services.simulator.runtime import MIB, exposed_transfer_s
from services.simulator.setup import RunSpec, colocated, contended, deployment_views

(PREFILL_PRFAAS, PREFILL_LOCAL, LINK, DECODE, BANDWIDTH, LOADED_PRFAAS, LOADED_LOCAL, KV_ARRIVED, BOTH_STEP,
 LOADED_BOTH) = range(10)
PREFILLED, SENT = 1, 2
INF = float("inf")
PROGRESS_EVERY = 100_000
NO_CACHE: dict[str, int] = {}


def simulate(spec: RunSpec, controller: CongestionAwareThreshold | None = None) -> SimResult:
    """Run one policy; the adaptive policy needs a threshold ``controller`` (see the module docstring
    for what it is fed)."""
    return _Simulation(spec, controller).run()


class _Simulation:
    def __init__(self, spec: RunSpec, controller: CongestionAwareThreshold | None) -> None:
        self.topo = topo = contended(
            colocated(spec.topology, spec.runtime.local_both, spec.runtime.decode_step_s_by_batch),
            spec.runtime.contention_factor(spec.rate))
        if spec.policy != "homogeneous" and not topo.num_prfaas:
            raise ValueError(f"policy {spec.policy!r} needs PrfaaS prefill instances")
        if spec.policy in ("homogeneous", "static", "adaptive") and not topo.num_local_prefill + topo.num_both:
            raise ValueError(f"policy {spec.policy!r} needs local prefill instances")
        self.spec = spec
        if spec.policy == "adaptive" and controller is None:
            raise ValueError("the adaptive policy needs a threshold controller")
        self.controller = controller if spec.policy == "adaptive" else None
        self.threshold = {"homogeneous": INF, "naive": -INF}.get(spec.policy, spec.threshold_tokens)
        self._class_means: dict[float, tuple[float, float]] = {}
        self.views = deployment_views(topo)

    def class_means(self, threshold: float) -> tuple[float, float]:
        """(E[L | L > t], E[L | L <= t]) for mean-length mode; one class (E[L]) for +-inf."""
        means = self._class_means.get(threshold)
        if means is None:
            dist = self.spec.workload.lengths
            means = (dist.mean, dist.mean) if math.isinf(threshold) else \
                (dist.mean_above(threshold), dist.mean_below(threshold))
            self._class_means[threshold] = means
        return means

    def run(self) -> SimResult:
        started = time.perf_counter()
        self._start()
        heap, pop, handlers = self.heap, heapq.heappop, self.handlers
        while True:
            if self.next_arrival < (heap[0][0] if heap else INF):
                self._on_arrival()
                continue
            if not heap:
                break
            now, kind, rid = pop(heap)
            handlers[kind](now, rid)
        return result_of(self, time.perf_counter() - started)

    def _start(self) -> None:
        spec, topo, runtime = self.spec, self.topo, self.spec.runtime
        n = spec.num_requests
        self.rng = rng = random.Random(spec.seed)
        hit = spec.workload.prefix_hit if not spec.mean_length_mode else None
        self.hit_p, self.hit_lo, self.hit_span = (hit.probability, hit.min_fraction,
                                                  hit.max_fraction - hit.min_fraction) if hit else (0.0, 0.0, 0.0)
        if self.hit_p and runtime.pool_load_gbps and topo.kv_bytes is None:
            raise ValueError("pool loads need KV sizes: no prefill profile of this deployment has kv_size_mib")
        self.next_arrival_after = ReplayedArrivals(tuple(t for t, _ in spec.replay)).next_after if spec.replay \
            else make_arrivals(spec.arrivals, spec.rate, rng, spec.burst_seconds).next_after
        self.live_threshold = self.threshold
        self.long_mean, self.short_mean = self.class_means(self.threshold) if spec.mean_length_mode else (0.0, 0.0)
        self.next_observe, self.observed_at = 0.0, 0.0
        self.reoptimized_at, self.arrivals_seen = 0.0, 0
        self.next_reoptimize = spec.reoptimize_interval_s
        self.sent_seen = 0.0
        self.min_t = self.max_t = self.threshold
        self.nominal_bw = runtime.link_bytes_per_s(topo.link_gbps)     # what one transfer gets
        self.arrival_t, self.deadline, self.kv, self.ttft = (array("d", bytes(8 * n)) for _ in range(4))
        self.state = bytearray(n)
        self.heap: list[tuple[float, int, int]] = []
        self.decode_s = spec.workload.output_tokens * topo.decode_step_s
        self._start_instances()
        if runtime.colocated_interference:
            self._interfere(runtime.colocated_interference)
        self.send_cpu_s_per_byte = runtime.send_cpu_ms_per_mib / 1000 / MIB
        if self.send_cpu_s_per_byte:
            self.prfaas.slowable()
        self.local.finished = self.decode.submit
        gbps = bandwidth_at(spec.bandwidth_trace, 0.0, topo.link_gbps)
        self.link = Link(runtime, topo.link_gbps, gbps, LINK, self.heap, self.kv, n)
        self.layerwise, self.one_way = runtime.layerwise, runtime.one_way_s
        self.link.sent = self._on_link_sent if self.layerwise or self.one_way else self.decode.submit
        self.prfaas.finished = self._on_prfaas_prefilled
        if self.layerwise:
            self.prfaas.started = self._send
        self.admission = SimAdmission(runtime, (topo.num_decode + topo.num_both) * topo.max_batch_size, n) \
            if runtime.admission else None
        self.finish = array("d", bytes(8 * n)) if self.router is not None else None
        if self.admission is not None or self.finish is not None:
            self.decode.finished = self._finished
        for index, (at, _) in enumerate(spec.bandwidth_trace):
            if at > 0:
                heapq.heappush(self.heap, (at, BANDWIDTH, index))
        both = self.both
        self.handlers = (self.prfaas.on_event, self.local.on_event, self.link.on_sent,
                         self.decode.on_decoded if both is None else None, self._on_bandwidth,
                         self.prfaas.on_loaded, self.local.on_loaded, self.decode.submit,
                         both.on_step if both else None, both.on_loaded if both else None)
        self.busy_prfaas = self.busy_local = self.offloaded_bytes = 0.0
        self.num_offloaded = self.slo_met = self.backlog = 0
        self.samples: list[tuple[float, int, int, int, int]] = []
        self.sample_every = n / spec.rate / max(spec.num_samples, 1)
        self.next_sample = 0.0
        self.progress_at = PROGRESS_EVERY if spec.progress else n + 1
        self.num_arrived = 0
        self.next_arrival = self.next_arrival_after(0.0)

    def _start_instances(self) -> None:
        """The prefill clusters, decode slots and router views: one per role and a shared queue per
        cluster, or one per instance (``per_instance``, ``local_both``)."""
        spec, topo, heap, n = self.spec, self.topo, self.heap, self.spec.num_requests
        chunk, prfaas_kinds, local_kinds = spec.runtime.chunk_tokens, (PREFILL_PRFAAS, LOADED_PRFAAS), \
            (PREFILL_LOCAL, LOADED_LOCAL)
        self.both: ColocatedInstances | None = None
        self.router: InstanceRouter | None = None
        if not spec.runtime.dispatches_per_instance:
            self.prfaas = PrefillCluster(topo.num_prfaas, topo.prfaas_latency, chunk, prfaas_kinds, heap,
                                         self.arrival_t, n)
            self.local = PrefillCluster(topo.num_local_prefill, topo.local_latency, chunk, local_kinds, heap,
                                        self.arrival_t, n)
            self.decode = DecodePool(topo.num_decode * topo.max_batch_size, self.decode_s, DECODE, heap, n,
                                     self._first_token)
            return
        self.router = build_router(spec, topo, heap, self.arrival_t, self.decode_s, self._first_token,
                                   (prfaas_kinds, local_kinds, DECODE, (BOTH_STEP, LOADED_BOTH)))
        self.prfaas, self.local, self.decode, self.both = (self.router.prfaas, self.router.local, self.router.decode,
                                                           self.router.both)

    def _interfere(self, interference: float) -> None:
        """The PrfaaS instances compute at ``1 / (1 + interference * s)`` of their speed while a share s of
        the colocated workers decode (``RuntimeModel.colocated_interference``)."""
        if self.both is None:
            raise ValueError("simulation.colocated_interference: needs colocated workers (local_both)")
        prfaas = self.prfaas
        prfaas.slowable()

        def decoding_changed(now: float, share: float) -> None:
            prfaas.set_speed(now, 1.0 / (1.0 + interference * share))

        self.both.decoding_changed = decoding_changed

    def queue_lengths(self) -> tuple[int, int, int, int]:
        return self.prfaas.num_queued, self.local_queued, self.link.num_waiting, self.decode.num_queued

    @property
    def local_queued(self) -> int:
        return self.local.num_queued if self.both is None else self.both.num_prefill_queued

    # Arrivals ------------------------------------------------------------------------------------

    def _on_arrival(self) -> None:
        rid, now = self.num_arrived, self.next_arrival
        if now >= self.next_sample:
            self.samples.append((now, *self.queue_lengths()))
            self.next_sample = now + self.sample_every
        if self.controller is not None and now >= self.next_observe:
            observe(self, self.controller, now)
        self.arrival_t[rid] = now
        length, cached = (self.spec.replay[rid][1], 0.0) if self.spec.replay else self._draw_length()
        base = self.controller.base_tokens if self.controller is not None else self.threshold
        cache = PromptCache(length, {"local": cached, "prfaas": cached} if cached else NO_CACHE)
        scarce = bandwidth_scarce(self.live_threshold, base)
        route = choose_route(self.views, length, self.live_threshold, cache=cache, scarce=scarce) \
            if self.router is None else self.router.route(rid, length, self.live_threshold, cache, scarce)
        if route is None:
            raise ValueError("no worker can serve a request")
        uncached = length - route.num_cached_tokens if route.num_cached_tokens else length
        if self.admission is not None and not self.admission.admitted(now, rid, route.path, length):
            self._reject(rid)
            return self._next(rid, now)
        if self.router is not None:
            self.router.admitted(rid)
        if route.path == "prfaas":
            self._arrive_prfaas(rid, now, uncached, route.num_cached_tokens)
        elif route.path == "local" and self.both is not None:
            self._arrive_both(rid, now, uncached, route.num_cached_tokens)
        else:
            self._arrive_local(rid, now, uncached, route.num_cached_tokens)
        self._next(rid, now)

    def _next(self, rid: int, now: float) -> None:
        """Draw the arrival after ``rid``'s."""
        self.num_arrived = i = rid + 1
        if i < self.spec.num_requests:
            self.next_arrival = self.next_arrival_after(now)
            if i >= self.progress_at:
                print(f"simulate {self.spec.policy}: {i:,}/{self.spec.num_requests:,} requests", file=sys.stderr,
                      flush=True)
                self.progress_at += PROGRESS_EVERY
        else:
            self.next_arrival = INF
            self.backlog = sum(self.queue_lengths()) - self.link.num_sending

    def _draw_length(self) -> tuple[float, float]:
        """The next request's prompt length (a truncated log-normal draw, or its class mean in
        mean-length mode) and its cached prefix."""
        dist, gauss = self.spec.workload.lengths, self.rng.gauss
        length = math.exp(dist.mu + dist.sigma * gauss())
        while length < dist.lo or length > dist.hi:
            length = math.exp(dist.mu + dist.sigma * gauss())
        if self.hit_p and self.rng.random() < self.hit_p:
            return length, length - length * (1.0 - self.hit_lo - self.hit_span * self.rng.random())
        if self.spec.mean_length_mode:
            length = self.long_mean if length > self.live_threshold else self.short_mean
        return length, 0.0

    def _load_s(self, cached: float) -> float:
        runtime, kv_bytes = self.spec.runtime, self.spec.topology.kv_bytes
        return runtime.load_s(kv_bytes(cached)) if cached and runtime.pool_load_gbps and kv_bytes else 0.0

    def _reject(self, rid: int) -> None:
        self.ttft[rid] = math.nan

    def _arrive_both(self, rid: int, now: float, length: float, cached: float) -> None:
        """The local path on a colocated worker: the decode worker the router chose prefills it."""
        service = self.topo.local_latency(length)
        load_s = self._load_s(cached)
        self.busy_local += service
        self.deadline[rid] = now + (self.spec.ttft_slo_s if self.spec.ttft_slo_s is not None
                                    else self.spec.slo_factor * (service + load_s))
        self.both.prefill(now, rid, length, load_s)

    def _arrive_prfaas(self, rid: int, now: float, length: float, cached: float) -> None:
        topo, spec = self.topo, self.spec
        service = topo.prfaas_latency(length)
        kv_bytes = self.kv[rid] = topo.prfaas_kv_bytes(length)
        load_s = self._load_s(cached)
        self.num_offloaded += 1
        self.offloaded_bytes += kv_bytes
        self.busy_prfaas += service
        if spec.ttft_slo_s is not None:
            self.deadline[rid] = now + spec.ttft_slo_s
        else:
            alone = service + exposed_transfer_s(kv_bytes / self.nominal_bw, service if self.layerwise else 0.0)
            if load_s:
                alone += load_s
            if self.one_way:
                alone += self.one_way
            self.deadline[rid] = now + spec.slo_factor * alone
        self.prfaas.submit(now, rid, length if spec.runtime.chunk_tokens else service, load_s)

    def _arrive_local(self, rid: int, now: float, length: float, cached: float) -> None:
        topo, spec = self.topo, self.spec
        service = topo.local_latency(length)
        load_s = self._load_s(cached)
        self.busy_local += service
        self.deadline[rid] = now + (spec.ttft_slo_s if spec.ttft_slo_s is not None
                                    else spec.slo_factor * (service + load_s if load_s else service))
        self.local.submit(now, rid, length if spec.runtime.chunk_tokens else service, load_s)

    # Events off the heap -------------------------------------------------------------------------

    def _send(self, now: float, rid: int) -> None:
        """``rid``'s KV starts for the link; its prefill instance's cores pay its sender's CPU."""
        if self.send_cpu_s_per_byte:
            self.prfaas.owe(now, rid, self.kv[rid] * self.send_cpu_s_per_byte)
        self.link.submit(now, rid)

    def _on_prfaas_prefilled(self, now: float, rid: int) -> None:
        if not self.layerwise:
            self._send(now, rid)
            return
        self.state[rid] |= PREFILLED
        if self.state[rid] & SENT:
            self._deliver(now, rid)

    def _on_link_sent(self, now: float, rid: int) -> None:
        if self.layerwise and not self.state[rid] & PREFILLED:
            self.state[rid] |= SENT
            return
        self._deliver(now, rid)

    def _deliver(self, now: float, rid: int) -> None:
        """``rid``'s last byte of KV left the PrfaaS cluster; it lands half a round trip later."""
        if self.one_way:
            heapq.heappush(self.heap, (now + self.one_way, KV_ARRIVED, rid))
        else:
            self.decode.submit(now, rid)

    def _on_bandwidth(self, now: float, index: int) -> None:
        self.link.on_bandwidth(now, self.spec.bandwidth_trace[index][1])

    def _first_token(self, now: float, rid: int) -> None:
        """``rid``'s KV sits on a decode instance with a batch slot: its TTFT ends, its decode starts."""
        self.ttft[rid] = now - self.arrival_t[rid]
        if now <= self.deadline[rid]:
            self.slo_met += 1
        if self.admission is not None:
            self.admission.first_token(now, rid)

    def _finished(self, now: float, rid: int) -> None:
        """``rid``'s last token is out."""
        if self.finish is not None:
            self.finish[rid] = now
        if self.admission is not None:
            self.admission.finished()
