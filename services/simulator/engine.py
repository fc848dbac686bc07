"""The discrete-event loop: arrivals -> prefill (PrfaaS or local, FIFO, N servers) -> [link] -> decode.

A request that prefills on the PrfaaS cluster then queues for the cross-cluster link, which sends
KV caches one at a time (FIFO) at the bandwidth of the moment; a bandwidth step re-times the
transfer in flight. The request's TTFT ends when its KV sits on a decode instance that has a free
batch slot; the slot is held for ``output_tokens * step_time``. Local prefill hands KV to decode
over the intra-cluster fabric, taken as free.

The loop keeps per-request state in flat arrays and events as ``(time, kind, id)`` tuples on a
heap; arrivals are drawn one ahead instead of living on the heap.

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

    def run(self) -> SimResult:  # noqa: C901 - one hot loop, kept flat for speed
        spec, topo = self.spec, self.spec.topology
        started = time.perf_counter()
        n = spec.num_requests
        rng = random.Random(spec.seed)
        gauss, rand, exp = rng.gauss, rng.random, math.exp
        dist = spec.workload.lengths
        mu, sigma, lo, hi = dist.mu, dist.sigma, dist.lo, dist.hi
        hit = spec.workload.prefix_hit if not spec.mean_length_mode else None
        hit_p, hit_lo, hit_span = (hit.probability, hit.min_fraction, hit.max_fraction - hit.min_fraction) \
            if hit else (0.0, 0.0, 0.0)
        next_arrival_after = make_arrivals(spec.arrivals, spec.rate, rng, spec.burst_seconds).next_after
        mean_mode = spec.mean_length_mode
        threshold = self.threshold
        long_mean, short_mean = self.class_means(threshold) if mean_mode else (0.0, 0.0)
        controller = self.controller
        observe_every, next_observe, observed_at = spec.observe_interval_s, 0.0, 0.0
        reoptimize_every, reoptimized_at, arrivals_seen = spec.reoptimize_interval_s, 0.0, 0
        next_reoptimize = reoptimize_every
        sent_done = sent_seen = 0.0
        min_t = max_t = threshold
        prfaas_latency, prfaas_kv, local_latency = topo.prfaas_latency, topo.prfaas_kv_bytes, topo.local_latency
        nominal_bw = topo.link_gbps * GBPS
        slo_abs, slo_factor = spec.ttft_slo_s, spec.slo_factor

        arrival_t, deadline, kv, work, ttft = (array("d", bytes(8 * n)) for _ in range(5))
        heap: list[tuple[float, int, int]] = []
        push, pop = heapq.heappush, heapq.heappop
        prfaas_free, local_free = topo.num_prfaas, topo.num_local_prefill
        prfaas_q, local_q, link_q, decode_q = deque(), deque(), deque(), deque()
        decode_free = topo.num_decode * topo.max_batch_size
        decode_s = spec.workload.output_tokens * topo.decode_step_s
        trace = spec.bandwidth_trace
        gbps_now = bandwidth_at(trace, 0.0, topo.link_gbps)
        bw = gbps_now * GBPS
        for index, (at, _) in enumerate(trace):
            if at > 0:
                push(heap, (at, BANDWIDTH, index))
        link_rid, link_left, link_since, link_version = -1, 0.0, 0.0, 0
        busy_prfaas = busy_local = offloaded_bytes = 0.0
        wait = {"prfaas_prefill": 0.0, "local_prefill": 0.0, "link": 0.0, "decode": 0.0}
        max_q = dict.fromkeys(wait, 0)
        num_offloaded = slo_met = backlog = 0
        samples: list[tuple[float, int, int, int, int]] = []
        sample_every = n / spec.rate / max(spec.num_samples, 1)
        next_sample = 0.0
        progress_at = PROGRESS_EVERY if spec.progress else n + 1

        i = 0
        now = next_arrival = next_arrival_after(0.0)
        while True:
            if next_arrival < (heap[0][0] if heap else INF):
                rid, now = i, next_arrival
                if now >= next_sample:
                    samples.append((now, len(prfaas_q), len(local_q), len(link_q) + (link_rid >= 0), len(decode_q)))
                    next_sample = now + sample_every
                if controller is not None and now >= next_observe:
                    sent = sent_done + (min(kv[link_rid], kv[link_rid] - link_left + (now - link_since) * bw)
                                        if link_rid >= 0 else 0.0)
                    sample = LinkSample(
                        now_s=now, egress_gbps=(sent - sent_seen) / GBPS / (now - observed_at) if now > observed_at
                        else 0.0, rtt_increase_ms=1000.0 * (now - work[link_q[0]]) if link_q else 0.0,
                        num_queued=len(prfaas_q) + len(link_q), capacity_gbps=gbps_now,
                        num_local_queued=len(local_q), num_local_workers=topo.num_local_prefill,
                        num_usable_workers=topo.num_prfaas if gbps_now > 0 else 0)
                    sent_seen, observed_at = sent, now
                    if now >= next_reoptimize:
                        controller.reoptimize(gbps_now, (i - arrivals_seen) / (now - reoptimized_at))
                        reoptimized_at, arrivals_seen = now, i
                        next_reoptimize = now + reoptimize_every
                    threshold = controller.observe(sample)
                    if threshold < INF:
                        min_t, max_t = min(min_t, threshold), max(max_t, threshold)
                    next_observe = now + observe_every
                    if mean_mode:
                        long_mean, short_mean = self.class_means(threshold)
                arrival_t[rid] = now
                length = exp(mu + sigma * gauss())
                while length < lo or length > hi:
                    length = exp(mu + sigma * gauss())
                if hit_p and rand() < hit_p:
                    length *= 1.0 - hit_lo - hit_span * rand()
                if mean_mode:
                    length = long_mean if length > threshold else short_mean
                if choose_prefill_site(length, threshold, True) == "prfaas":
                    service = prfaas_latency(length)
                    kv_bytes = kv[rid] = prfaas_kv(length)
                    num_offloaded += 1
                    offloaded_bytes += kv_bytes
                    busy_prfaas += service
                    deadline[rid] = now + (slo_abs if slo_abs is not None
                                           else slo_factor * (service + kv_bytes / nominal_bw))
                    if prfaas_free:
                        prfaas_free -= 1
                        push(heap, (now + service, PREFILL_PRFAAS, rid))
                    else:
                        work[rid] = service
                        prfaas_q.append(rid)
                        if len(prfaas_q) > max_q["prfaas_prefill"]:
                            max_q["prfaas_prefill"] = len(prfaas_q)
                else:
                    service = local_latency(length)
                    busy_local += service
                    deadline[rid] = now + (slo_abs if slo_abs is not None else slo_factor * service)
                    if local_free:
                        local_free -= 1
                        push(heap, (now + service, PREFILL_LOCAL, rid))
                    else:
                        work[rid] = service
                        local_q.append(rid)
                        if len(local_q) > max_q["local_prefill"]:
                            max_q["local_prefill"] = len(local_q)
                i += 1
                if i < n:
                    next_arrival = next_arrival_after(now)
                    if i >= progress_at:
                        print(f"simulate {spec.policy}: {i:,}/{n:,} requests", file=sys.stderr, flush=True)
                        progress_at += PROGRESS_EVERY
                else:
                    next_arrival = INF
                    backlog = len(prfaas_q) + len(local_q) + len(link_q) + len(decode_q)
                continue
            if not heap:
                break
            now, kind, rid = pop(heap)
            if kind == PREFILL_PRFAAS:
                if prfaas_q:
                    nxt = prfaas_q.popleft()
                    wait["prfaas_prefill"] += now - arrival_t[nxt]
                    push(heap, (now + work[nxt], PREFILL_PRFAAS, nxt))
                else:
                    prfaas_free += 1
                if link_rid < 0:
                    link_rid, link_left, link_since = rid, kv[rid], now
                    link_version += 1
                    if bw > 0:
                        push(heap, (now + link_left / bw, LINK, link_version))
                else:
                    work[rid] = now
                    link_q.append(rid)
                    if len(link_q) > max_q["link"]:
                        max_q["link"] = len(link_q)
                continue
            if kind == PREFILL_LOCAL:
                if local_q:
                    nxt = local_q.popleft()
                    wait["local_prefill"] += now - arrival_t[nxt]
                    push(heap, (now + work[nxt], PREFILL_LOCAL, nxt))
                else:
                    local_free += 1
            elif kind == LINK:
                if rid != link_version:
                    continue
                rid = link_rid
                sent_done += kv[rid]
                if link_q:
                    link_rid = link_q.popleft()
                    wait["link"] += now - work[link_rid]
                    link_left, link_since = kv[link_rid], now
                    link_version += 1
                    if bw > 0:
                        push(heap, (now + link_left / bw, LINK, link_version))
                else:
                    link_rid = -1
            elif kind == DECODE:
                if decode_q:
                    nxt = decode_q.popleft()
                    wait["decode"] += now - work[nxt]
                    ttft[nxt] = now - arrival_t[nxt]
                    if now <= deadline[nxt]:
                        slo_met += 1
                    push(heap, (now + decode_s, DECODE, nxt))
                else:
                    decode_free += 1
                continue
            else:
                gbps_now = trace[rid][1]
                if link_rid >= 0:
                    link_left -= (now - link_since) * bw
                    link_since = now
                    link_version += 1
                    if gbps_now > 0:
                        push(heap, (now + max(link_left, 0.0) / (gbps_now * GBPS), LINK, link_version))
                bw = gbps_now * GBPS
                continue
            if decode_free:
                decode_free -= 1
                ttft[rid] = now - arrival_t[rid]
                if now <= deadline[rid]:
                    slo_met += 1
                push(heap, (now + decode_s, DECODE, rid))
            else:
                work[rid] = now
                decode_q.append(rid)
                if len(decode_q) > max_q["decode"]:
                    max_q["decode"] = len(decode_q)

        return SimResult(
            policy=spec.policy, offered_rate=spec.rate, num_requests=n,
            threshold_tokens=None if math.isinf(self.threshold) else self.threshold,
            arrivals=arrival_t, ttfts=ttft, num_slo_met=slo_met, decode_s=decode_s,
            output_tokens=spec.workload.output_tokens, num_offloaded=num_offloaded,
            offloaded_kv_bytes=offloaded_bytes,
            busy_s={"prfaas_prefill": busy_prfaas, "local_prefill": busy_local,
                    "link": offloaded_bytes / nominal_bw if nominal_bw else 0.0, "decode": n * decode_s},
            servers={"prfaas_prefill": topo.num_prfaas, "local_prefill": topo.num_local_prefill,
                     "link": 1 if nominal_bw else 0, "decode": topo.num_decode * topo.max_batch_size},
            wait_s=wait, max_queue=max_q, backlog_at_last_arrival=backlog, samples=samples,
            threshold_range=(min_t, max_t) if controller is not None else None,
            wall_s=time.perf_counter() - started,
        )
