"""The discrete-event loop: arrivals -> prefill (PrfaaS or local, FIFO, N servers) -> [link] -> decode.

A request that prefills on the PrfaaS cluster then queues for the cross-cluster link, which sends
KV caches one at a time (FIFO) at the bandwidth of the moment; a bandwidth step re-times the
transfer in flight. The request's TTFT ends when its KV sits on a decode instance that has a free
batch slot; the slot is held for ``output_tokens * step_time``. Local prefill hands KV to decode
over the intra-cluster fabric, taken as free.

The loop keeps per-request state in flat arrays and events as ``(time, kind, id)`` tuples on a
heap, and hands each event to the handler of its kind (``_Simulation.HANDLERS``); arrivals are
drawn one ahead instead of living on the heap, and handled by ``_on_arrival``.

The adaptive policy runs the router's threshold controller (``CongestionAwareThreshold``): every
``observe_interval_s`` it gets a ``LinkSample`` synthesized from the simulated link (egress over
the interval, the link's current capacity, the PrfaaS prefill and transfer queue depth, how long
the oldest transfer has waited as the RTT-increase proxy, and no usable workers while the link is
at 0 Gbps); every ``reoptimize_interval_s`` it re-optimises its base threshold with the planner's
model at the current bandwidth and the arrival rate measured over that interval.
"""
from __future__ import annotations

import heapq
import math
import random
import sys
import time
from array import array
from collections import deque

from services.scheduling.congestion import CongestionAwareThreshold, LinkSample
from services.scheduling.routing import choose_prefill_site
from services.scheduling.threshold import GBPS
from services.simulator.arrivals import make_arrivals
from services.simulator.bandwidth import bandwidth_at
from services.simulator.results import SimResult
from services.simulator.setup import RunSpec

PREFILL_PRFAAS, PREFILL_LOCAL, LINK, DECODE, BANDWIDTH = range(5)
INF = float("inf")
PROGRESS_EVERY = 100_000


def simulate(spec: RunSpec, controller: CongestionAwareThreshold | None = None) -> SimResult:
    """Run one policy; the adaptive policy needs a threshold ``controller`` (see the module docstring
    for what it is fed)."""
    return _Simulation(spec, controller).run()


class _Simulation:
    def __init__(self, spec: RunSpec, controller: CongestionAwareThreshold | None) -> None:
        topo = spec.topology
        if spec.policy != "homogeneous" and not topo.num_prfaas:
            raise ValueError(f"policy {spec.policy!r} needs PrfaaS prefill instances")
        if spec.policy in ("homogeneous", "static", "adaptive") and not topo.num_local_prefill:
            raise ValueError(f"policy {spec.policy!r} needs local prefill instances")
        self.spec = spec
        if spec.policy == "adaptive" and controller is None:
            raise ValueError("the adaptive policy needs a threshold controller")
        self.controller = controller if spec.policy == "adaptive" else None
        self.threshold = {"homogeneous": INF, "naive": -INF}.get(spec.policy, spec.threshold_tokens)
        self._class_means: dict[float, tuple[float, float]] = {}

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
        heap, pop, handlers = self.heap, heapq.heappop, self.HANDLERS
        while True:
            if self.next_arrival < (heap[0][0] if heap else INF):
                self._on_arrival()
                continue
            if not heap:
                break
            now, kind, rid = pop(heap)
            handlers[kind](self, now, rid)
        return self._result(time.perf_counter() - started)

    def _start(self) -> None:
        spec, topo = self.spec, self.spec.topology
        n = spec.num_requests
        self.rng = rng = random.Random(spec.seed)
        hit = spec.workload.prefix_hit if not spec.mean_length_mode else None
        self.hit_p, self.hit_lo, self.hit_span = (hit.probability, hit.min_fraction,
                                                  hit.max_fraction - hit.min_fraction) if hit else (0.0, 0.0, 0.0)
        self.next_arrival_after = make_arrivals(spec.arrivals, spec.rate, rng, spec.burst_seconds).next_after
        self.live_threshold = self.threshold
        self.long_mean, self.short_mean = self.class_means(self.threshold) if spec.mean_length_mode else (0.0, 0.0)
        self.next_observe, self.observed_at = 0.0, 0.0
        self.reoptimized_at, self.arrivals_seen = 0.0, 0
        self.next_reoptimize = spec.reoptimize_interval_s
        self.sent_done = self.sent_seen = 0.0
        self.min_t = self.max_t = self.threshold
        self.nominal_bw = topo.link_gbps * GBPS
        self.arrival_t, self.deadline, self.kv, self.work, self.ttft = (array("d", bytes(8 * n)) for _ in range(5))
        self.heap: list[tuple[float, int, int]] = []
        self.prfaas_free, self.local_free = topo.num_prfaas, topo.num_local_prefill
        self.prfaas_q: deque[int] = deque()
        self.local_q: deque[int] = deque()
        self.link_q: deque[int] = deque()
        self.decode_q: deque[int] = deque()
        self.decode_free = topo.num_decode * topo.max_batch_size
        self.decode_s = spec.workload.output_tokens * topo.decode_step_s
        self.gbps_now = bandwidth_at(spec.bandwidth_trace, 0.0, topo.link_gbps)
        self.bw = self.gbps_now * GBPS
        for index, (at, _) in enumerate(spec.bandwidth_trace):
            if at > 0:
                heapq.heappush(self.heap, (at, BANDWIDTH, index))
        self.link_rid, self.link_left, self.link_since, self.link_version = -1, 0.0, 0.0, 0
        self.busy_prfaas = self.busy_local = self.offloaded_bytes = 0.0
        self.wait = {"prfaas_prefill": 0.0, "local_prefill": 0.0, "link": 0.0, "decode": 0.0}
        self.max_q = dict.fromkeys(self.wait, 0)
        self.num_offloaded = self.slo_met = self.backlog = 0
        self.samples: list[tuple[float, int, int, int, int]] = []
        self.sample_every = n / spec.rate / max(spec.num_samples, 1)
        self.next_sample = 0.0
        self.progress_at = PROGRESS_EVERY if spec.progress else n + 1
        self.num_arrived = 0
        self.next_arrival = self.next_arrival_after(0.0)

    # Arrivals ------------------------------------------------------------------------------------

    def _on_arrival(self) -> None:
        rid, now = self.num_arrived, self.next_arrival
        if now >= self.next_sample:
            self.samples.append((now, len(self.prfaas_q), len(self.local_q),
                                 len(self.link_q) + (self.link_rid >= 0), len(self.decode_q)))
            self.next_sample = now + self.sample_every
        if self.controller is not None and now >= self.next_observe:
            self._observe(self.controller, now)
        self.arrival_t[rid] = now
        length = self._draw_length()
        if choose_prefill_site(length, self.live_threshold, True) == "prfaas":
            self._arrive_prfaas(rid, now, length)
        else:
            self._arrive_local(rid, now, length)
        self.num_arrived = i = rid + 1
        if i < self.spec.num_requests:
            self.next_arrival = self.next_arrival_after(now)
            if i >= self.progress_at:
                print(f"simulate {self.spec.policy}: {i:,}/{self.spec.num_requests:,} requests", file=sys.stderr,
                      flush=True)
                self.progress_at += PROGRESS_EVERY
        else:
            self.next_arrival = INF
            self.backlog = len(self.prfaas_q) + len(self.local_q) + len(self.link_q) + len(self.decode_q)

    def _draw_length(self) -> float:
        """The next request's uncached prompt length: a truncated log-normal draw, less its prefix hit,
        or its class mean in mean-length mode."""
        dist, gauss = self.spec.workload.lengths, self.rng.gauss
        length = math.exp(dist.mu + dist.sigma * gauss())
        while length < dist.lo or length > dist.hi:
            length = math.exp(dist.mu + dist.sigma * gauss())
        if self.hit_p and self.rng.random() < self.hit_p:
            length *= 1.0 - self.hit_lo - self.hit_span * self.rng.random()
        if self.spec.mean_length_mode:
            length = self.long_mean if length > self.live_threshold else self.short_mean
        return length

    def _arrive_prfaas(self, rid: int, now: float, length: float) -> None:
        topo, spec = self.spec.topology, self.spec
        service = topo.prfaas_latency(length)
        kv_bytes = self.kv[rid] = topo.prfaas_kv_bytes(length)
        self.num_offloaded += 1
        self.offloaded_bytes += kv_bytes
        self.busy_prfaas += service
        self.deadline[rid] = now + (spec.ttft_slo_s if spec.ttft_slo_s is not None
                                    else spec.slo_factor * (service + kv_bytes / self.nominal_bw))
        if self.prfaas_free:
            self.prfaas_free -= 1
            heapq.heappush(self.heap, (now + service, PREFILL_PRFAAS, rid))
        else:
            self._enqueue(self.prfaas_q, "prfaas_prefill", rid, service)

    def _arrive_local(self, rid: int, now: float, length: float) -> None:
        topo, spec = self.spec.topology, self.spec
        service = topo.local_latency(length)
        self.busy_local += service
        self.deadline[rid] = now + (spec.ttft_slo_s if spec.ttft_slo_s is not None else spec.slo_factor * service)
        if self.local_free:
            self.local_free -= 1
            heapq.heappush(self.heap, (now + service, PREFILL_LOCAL, rid))
        else:
            self._enqueue(self.local_q, "local_prefill", rid, service)

    def _enqueue(self, queue: deque[int], name: str, rid: int, work: float) -> None:
        """Queue ``rid`` for a busy resource; ``work`` is its service time (prefill) or when it
        started waiting (link, decode)."""
        self.work[rid] = work
        queue.append(rid)
        if len(queue) > self.max_q[name]:
            self.max_q[name] = len(queue)

    def _observe(self, controller: CongestionAwareThreshold, now: float) -> None:
        """Feed the controller a ``LinkSample`` of the simulated link (see the module docstring)."""
        topo, link_q, kv = self.spec.topology, self.link_q, self.kv
        link_rid = self.link_rid
        sent = self.sent_done + (min(kv[link_rid], kv[link_rid] - self.link_left + (now - self.link_since) * self.bw)
                                 if link_rid >= 0 else 0.0)
        sample = LinkSample(
            now_s=now, egress_gbps=(sent - self.sent_seen) / GBPS / (now - self.observed_at)
            if now > self.observed_at else 0.0,
            rtt_increase_ms=1000.0 * (now - self.work[link_q[0]]) if link_q else 0.0,
            num_queued=len(self.prfaas_q) + len(link_q), capacity_gbps=self.gbps_now,
            num_local_queued=len(self.local_q), num_local_workers=topo.num_local_prefill,
            num_usable_workers=topo.num_prfaas if self.gbps_now > 0 else 0)
        self.sent_seen, self.observed_at = sent, now
        if now >= self.next_reoptimize:
            arrived = self.num_arrived
            controller.reoptimize(self.gbps_now, (arrived - self.arrivals_seen) / (now - self.reoptimized_at))
            self.reoptimized_at, self.arrivals_seen = now, arrived
            self.next_reoptimize = now + self.spec.reoptimize_interval_s
        threshold = self.live_threshold = controller.observe(sample)
        if threshold < INF:
            self.min_t, self.max_t = min(self.min_t, threshold), max(self.max_t, threshold)
        self.next_observe = now + self.spec.observe_interval_s
        if self.spec.mean_length_mode:
            self.long_mean, self.short_mean = self.class_means(threshold)

    # Events off the heap, one handler per kind ---------------------------------------------------

    def _on_prfaas_prefilled(self, now: float, rid: int) -> None:
        if not self._next_prefill(self.prfaas_q, "prfaas_prefill", PREFILL_PRFAAS, now):
            self.prfaas_free += 1
        if self.link_rid < 0:
            self._send(now, rid)
        else:
            self._enqueue(self.link_q, "link", rid, now)

    def _on_local_prefilled(self, now: float, rid: int) -> None:
        if not self._next_prefill(self.local_q, "local_prefill", PREFILL_LOCAL, now):
            self.local_free += 1
        self._to_decode(now, rid)

    def _next_prefill(self, queue: deque[int], name: str, kind: int, now: float) -> bool:
        """Start the oldest queued prefill on the instance that just finished one; False if none waits."""
        if not queue:
            return False
        nxt = queue.popleft()
        self.wait[name] += now - self.arrival_t[nxt]
        heapq.heappush(self.heap, (now + self.work[nxt], kind, nxt))
        return True

    def _on_link_sent(self, now: float, version: int) -> None:
        if version != self.link_version:
            return  # a transfer re-timed by a bandwidth step
        rid = self.link_rid
        self.sent_done += self.kv[rid]
        if self.link_q:
            nxt = self.link_q.popleft()
            self.wait["link"] += now - self.work[nxt]
            self._send(now, nxt)
        else:
            self.link_rid = -1
        self._to_decode(now, rid)

    def _on_decoded(self, now: float, rid: int) -> None:
        if self.decode_q:
            nxt = self.decode_q.popleft()
            self.wait["decode"] += now - self.work[nxt]
            self._first_token(now, nxt)
        else:
            self.decode_free += 1

    def _on_bandwidth(self, now: float, index: int) -> None:
        self.gbps_now = self.spec.bandwidth_trace[index][1]
        if self.link_rid >= 0:
            self.link_left -= (now - self.link_since) * self.bw
            self.link_since = now
            self.link_version += 1
            if self.gbps_now > 0:
                heapq.heappush(self.heap, (now + max(self.link_left, 0.0) / (self.gbps_now * GBPS), LINK,
                                           self.link_version))
        self.bw = self.gbps_now * GBPS

    HANDLERS = (_on_prfaas_prefilled, _on_local_prefilled, _on_link_sent, _on_decoded, _on_bandwidth)

    def _send(self, now: float, rid: int) -> None:
        """Put ``rid``'s KV on the idle link."""
        self.link_rid, self.link_left, self.link_since = rid, self.kv[rid], now
        self.link_version += 1
        if self.bw > 0:
            heapq.heappush(self.heap, (now + self.link_left / self.bw, LINK, self.link_version))

    def _to_decode(self, now: float, rid: int) -> None:
        if self.decode_free:
            self.decode_free -= 1
            self._first_token(now, rid)
        else:
            self._enqueue(self.decode_q, "decode", rid, now)

    def _first_token(self, now: float, rid: int) -> None:
        """``rid``'s KV sits on a decode instance with a batch slot: its TTFT ends, its decode starts."""
        self.ttft[rid] = now - self.arrival_t[rid]
        if now <= self.deadline[rid]:
            self.slo_met += 1
        heapq.heappush(self.heap, (now + self.decode_s, DECODE, rid))

    def _result(self, wall_s: float) -> SimResult:
        spec, topo = self.spec, self.spec.topology
        n, nominal_bw = spec.num_requests, self.nominal_bw
        return SimResult(
            policy=spec.policy, offered_rate=spec.rate, num_requests=n,
            threshold_tokens=None if math.isinf(self.threshold) else self.threshold,
            arrivals=self.arrival_t, ttfts=self.ttft, num_slo_met=self.slo_met, decode_s=self.decode_s,
            output_tokens=spec.workload.output_tokens, num_offloaded=self.num_offloaded,
            offloaded_kv_bytes=self.offloaded_bytes,
            busy_s={"prfaas_prefill": self.busy_prfaas, "local_prefill": self.busy_local,
                    "link": self.offloaded_bytes / nominal_bw if nominal_bw else 0.0, "decode": n * self.decode_s},
            servers={"prfaas_prefill": topo.num_prfaas, "local_prefill": topo.num_local_prefill,
                     "link": 1 if nominal_bw else 0, "decode": topo.num_decode * topo.max_batch_size},
            wait_s=self.wait, max_queue=self.max_q, backlog_at_last_arrival=self.backlog, samples=self.samples,
            threshold_range=(self.min_t, self.max_t) if self.controller is not None else None,
            wall_s=wall_s,
        )
