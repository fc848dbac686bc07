"""What a simulation run measured, summarized as a JSON-ready dict and as a console table."""
from __future__ import annotations

import math
from array import array
from dataclasses import dataclass
from typing import Any

QUEUES = ("prfaas_prefill", "local_prefill", "link", "decode")
WARMUP_FRACTION = 0.1


@dataclass
class SimResult:
    policy: str
    offered_rate: float
    num_requests: int
    threshold_tokens: float | None
    arrivals: array            # arrival time of each request
    ttfts: array               # arrival -> KV at a decode instance holding a batch slot
    num_slo_met: int
    decode_s: float
    output_tokens: int
    num_offloaded: int
    offloaded_kv_bytes: float
    busy_s: dict[str, float]   # summed service time per resource, for utilization and capacity
    servers: dict[str, float]  # server count per resource (decode: batch slots)
    wait_s: dict[str, float]   # summed waiting time per queue (Little's law gives mean length)
    max_queue: dict[str, int]
    backlog_at_last_arrival: int
    samples: list[tuple[float, int, int, int, int]]
    threshold_range: tuple[float, float] | None
    wall_s: float
    rejected: dict[str, int] | None = None     # rejections by reason, with admission control
    finishes: array | None = None              # each request's last token (per-instance dispatch)

    @property
    def num_rejected(self) -> int:
        return sum(self.rejected.values()) if self.rejected else 0

    @property
    def arrival_window_s(self) -> float:
        return self.arrivals[-1] if self.num_requests else 0.0

    @property
    def finish_times(self) -> array:
        """Each request's last token: recorded per instance, else its first token plus the decode time."""
        if self.finishes is not None:
            return self.finishes
        return array("d", (a + t + self.decode_s for a, t in zip(self.arrivals, self.ttfts)))

    @property
    def throughput(self) -> float:
        """Completions per second over the arrival window after warm-up."""
        start, end = WARMUP_FRACTION * self.arrival_window_s, self.arrival_window_s
        done = sum(1 for f in self.finish_times if start < f <= end)
        return done / (end - start) if end > start else 0.0

    @property
    def realized_rate(self) -> float:
        return self.num_requests / self.arrival_window_s if self.arrival_window_s else 0.0

    def utilization(self, resource: str) -> float:
        servers = self.servers.get(resource, 0)
        return self.busy_s[resource] / (servers * self.arrival_window_s) if servers else 0.0

    def capacity(self) -> float:
        """Max rate the measured per-request demand allows (utilization law): min over resources of
        servers / (busy seconds per arriving request)."""
        limits = [self.servers[r] * self.num_requests / self.busy_s[r]
                  for r in self.busy_s if self.busy_s[r] > 0 and self.servers.get(r)]
        return min(limits) if limits else float("inf")

    def summary(self) -> dict[str, Any]:
        ttfts = sorted(t for t in self.ttfts if not math.isnan(t)) if self.num_rejected else sorted(self.ttfts)
        num_admitted = self.num_requests - self.num_rejected
        window = self.arrival_window_s or 1.0
        out = {
            "policy": self.policy,
            "requests": self.num_requests,
            "offered_rate": self.offered_rate,
            "realized_rate": self.realized_rate,
            "throughput": self.throughput,
            "throughput_ratio": self.throughput / self.realized_rate if self.realized_rate else 0.0,
            "rejected": self.num_rejected,
            "ttft_s": {"mean": sum(ttfts) / len(ttfts) if ttfts else 0.0, "p50": _quantile(ttfts, 0.5),
                       "p90": _quantile(ttfts, 0.9), "p99": _quantile(ttfts, 0.99)},
            "slo_attainment": self.num_slo_met / self.num_requests,
            "decode_tokens_per_s": self.output_tokens / self.decode_s,
            "egress_gbps": self.offloaded_kv_bytes * 8 / window / 1e9,
            "offloaded_fraction": self.num_offloaded / num_admitted if num_admitted else 0.0,
            "utilization": {r: self.utilization(r) for r in self.busy_s if self.servers.get(r)},
            "queues": {q: {"max": self.max_queue[q], "mean": self.wait_s[q] / window} for q in QUEUES},
            "backlog_at_last_arrival": self.backlog_at_last_arrival,
            "arrival_window_s": self.arrival_window_s,
            "wall_s": self.wall_s,
            "simulated_requests_per_wall_s": self.num_requests / self.wall_s if self.wall_s else 0.0,
        }
        if self.rejected:
            out["rejected_by_reason"] = dict(self.rejected)
        if self.threshold_tokens is not None:
            out["threshold_tokens"] = self.threshold_tokens
        if self.threshold_range is not None:
            out["threshold_range_tokens"] = list(self.threshold_range)
        return out


def result_of(sim: Any, wall_s: float) -> SimResult:
    """What ``sim`` (the engine's ``_Simulation``, after its run) measured."""
    spec, topo = sim.spec, sim.topo
    n, nominal_bw, channels = spec.num_requests, sim.nominal_bw, sim.link.num_channels
    both = sim.both
    local_wait, local_max_q = (sim.local.wait_s, sim.local.max_queue) if both is None else \
        (both.prefill_wait_s, both.max_prefill_queue)
    return SimResult(
        policy=spec.policy, offered_rate=spec.rate, num_requests=n,
        threshold_tokens=None if math.isinf(sim.threshold) else sim.threshold,
        arrivals=sim.arrival_t, ttfts=sim.ttft, num_slo_met=sim.slo_met, decode_s=sim.decode_s,
        output_tokens=spec.workload.output_tokens, num_offloaded=sim.num_offloaded,
        offloaded_kv_bytes=sim.offloaded_bytes,
        busy_s={"prfaas_prefill": sim.busy_prfaas + sim.prfaas.slowed_s, "local_prefill": sim.busy_local,
                "link": sim.offloaded_bytes / nominal_bw if nominal_bw else 0.0, "decode": n * sim.decode_s},
        servers={"prfaas_prefill": topo.num_prfaas, "local_prefill": topo.num_local_prefill + topo.num_both,
                 "link": channels if nominal_bw else 0,
                 "decode": (topo.num_decode + topo.num_both) * topo.max_batch_size},
        wait_s={"prfaas_prefill": sim.prfaas.wait_s, "local_prefill": local_wait, "link": sim.link.wait_s,
                "decode": sim.decode.wait_s},
        max_queue={"prfaas_prefill": sim.prfaas.max_queue, "local_prefill": local_max_q,
                   "link": sim.link.max_queue, "decode": sim.decode.max_queue},
        backlog_at_last_arrival=sim.backlog, samples=sim.samples,
        threshold_range=(sim.min_t, sim.max_t) if sim.controller is not None else None,
        wall_s=wall_s, rejected=dict(sim.admission.rejected) if sim.admission is not None else None,
        finishes=sim.finish,
    )


def _quantile(ordered: list[float], q: float) -> float:
    if not ordered:
        return 0.0
    pos = q * (len(ordered) - 1)
    i = int(pos)
    j = min(i + 1, len(ordered) - 1)
    return ordered[i] + (ordered[j] - ordered[i]) * (pos - i)


def format_table(summaries: list[dict[str, Any]]) -> str:
    header = (f"{'policy':12s} {'offered':>8s} {'thruput':>8s} {'TTFT mean':>9s} {'P50':>7s} {'P90':>7s} "
              f"{'P99':>8s} {'SLO':>6s} {'egress':>7s} {'offload':>7s} {'rejected':>8s} {'max queue p/l/link/d':>22s}")
    lines = [header, "-" * len(header)]
    for s in summaries:
        t, q = s["ttft_s"], s["queues"]
        queues = "/".join(str(q[name]["max"]) for name in QUEUES)
        lines.append(f"{s['policy']:12s} {s['realized_rate']:8.3f} {s['throughput']:8.3f} {t['mean']:9.2f} "
                     f"{t['p50']:7.2f} {t['p90']:7.2f} {t['p99']:8.2f} {s['slo_attainment']:6.1%} "
                     f"{s['egress_gbps']:7.2f} {s['offloaded_fraction']:7.3f} {s.get('rejected', 0):8d} {queues:>22s}")
    lines.append("rates in req/s, TTFT in s (admitted requests), egress in Gbps; rejected: by admission control "
                 "(SLO counts them as missed); max queue: PrfaaS prefill / local prefill / link / decode slots "
                 "(per instance: the longest instance queue)")
    return "\n".join(lines)
