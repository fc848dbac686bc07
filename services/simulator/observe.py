"""What the adaptive policy's threshold controller sees of the simulated link.

Every ``observe_interval_s`` the router's ``CongestionAwareThreshold`` gets a ``LinkSample``: egress
over the interval, the link's current capacity, the PrfaaS prefill and transfer queue depth, how
long the oldest transfer has waited as the RTT-increase proxy, and no usable workers while the link
is at 0 Gbps. Every ``reoptimize_interval_s`` it re-optimises its base threshold with the planner's
model at the current bandwidth and the arrival rate measured over that interval.
"""
from __future__ import annotations

from typing import Any

from services.scheduling.congestion import CongestionAwareThreshold, LinkSample
from services.scheduling.threshold import GBPS

INF = float("inf")


def observe(sim: Any, controller: CongestionAwareThreshold, now: float) -> None:
    """Feed ``controller`` one sample of ``sim`` (the engine's ``_Simulation``) and take its threshold."""
    spec, link = sim.spec, sim.link
    sent = link.sent_bytes(now)
    sample = LinkSample(
        now_s=now, egress_gbps=(sent - sim.sent_seen) / GBPS / (now - sim.observed_at)
        if now > sim.observed_at else 0.0,
        rtt_increase_ms=1000.0 * link.oldest_wait_s(now),
        num_queued=sim.prfaas.num_queued + len(link.queue), capacity_gbps=link.gbps_now,
        num_local_queued=sim.local_queued, num_local_workers=sim.topo.num_local_prefill + sim.topo.num_both,
        num_usable_workers=spec.topology.num_prfaas if link.gbps_now > 0 else 0)
    sim.sent_seen, sim.observed_at = sent, now
    if now >= sim.next_reoptimize:
        arrived = sim.num_arrived
        controller.reoptimize(link.gbps_now, (arrived - sim.arrivals_seen) / (now - sim.reoptimized_at))
        sim.reoptimized_at, sim.arrivals_seen = now, arrived
        sim.next_reoptimize = now + spec.reoptimize_interval_s
    threshold = sim.live_threshold = controller.observe(sample)
    if threshold < INF:
        sim.min_t, sim.max_t = min(sim.min_t, threshold), max(sim.max_t, threshold)
    sim.next_observe = now + spec.observe_interval_s
    if spec.mean_length_mode:
        sim.long_mean, sim.short_mean = sim.class_means(threshold)
