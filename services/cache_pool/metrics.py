"""Prometheus metrics of the cache pool (the only module here that knows prometheus_client).

Counters and occupancy are read from the pool's stats at scrape time, so the pool keeps one set of
numbers for both `/metrics` and the GetStats RPC.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Histogram, disable_created_metrics, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from services.cache_pool_client.types import PoolStats

disable_created_metrics()

LOOKUP_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25)


class PoolMetrics:
    def __init__(self, stats: Callable[[], PoolStats], rejections=None) -> None:
        """``rejections``: the gRPC calls the pool refused (``services.security.Rejections``)."""
        self.registry = CollectorRegistry()
        self.lookup_latency = Histogram(
            "prfaas_cache_pool_lookup_latency_seconds", "Time to answer one Lookup RPC (index only).",
            buckets=LOOKUP_BUCKETS, registry=self.registry)
        self.registry.register(_PoolCollector(stats))
        if rejections is not None:
            self.registry.register(_RejectionCollector(rejections))
        self.num_lookups = 0
        self.lookup_seconds_total = 0.0

    def observe_lookup(self, seconds: float) -> None:
        self.lookup_latency.observe(seconds)
        self.num_lookups += 1
        self.lookup_seconds_total += seconds

    def start_http_server(self, host: str, port: int) -> None:
        start_http_server(port, addr=host, registry=self.registry)


class _PoolCollector:
    def __init__(self, stats: Callable[[], PoolStats]) -> None:
        self._stats = stats

    def collect(self) -> Iterator[Metric]:
        s = self._stats()
        yield _labelled(CounterMetricFamily, "prfaas_cache_pool_hits",
                        "Lookup hits: full-attention blocks inside the usable prefix; linear-attention "
                        "lookups that found a usable state.", "group",
                        {"full": s.full_attention_hits, "linear": s.linear_attention_hits})
        yield _labelled(CounterMetricFamily, "prfaas_cache_pool_misses",
                        "Lookup misses: full-attention blocks past the usable prefix; linear-attention "
                        "lookups without a usable state.", "group",
                        {"full": s.full_attention_misses, "linear": s.linear_attention_misses})
        yield _labelled(GaugeMetricFamily, "prfaas_cache_pool_stored_bytes",
                        "Block bytes held per tier (memory includes transfer blocks; SSD includes headers).",
                        "tier", {"memory": s.memory_bytes, "ssd": s.ssd_bytes})
        yield _labelled(GaugeMetricFamily, "prfaas_cache_pool_budget_bytes", "Byte budget per tier.",
                        "tier", {"memory": s.memory_budget_bytes, "ssd": s.ssd_budget_bytes})
        yield _labelled(GaugeMetricFamily, "prfaas_cache_pool_stored_blocks", "Blocks held per tier.",
                        "tier", {"memory": s.memory_blocks, "ssd": s.ssd_blocks})
        yield GaugeMetricFamily("prfaas_cache_pool_transfer_bytes",
                                "Bytes of transfer-cache blocks waiting for their read.", value=s.transfer_bytes)
        yield _labelled(CounterMetricFamily, "prfaas_cache_pool_evictions",
                        "Blocks evicted per tier (memory: to SSD when there is one; SSD: dropped).",
                        "tier", {"memory": s.memory_evictions, "ssd": s.ssd_evictions})
        yield CounterMetricFamily("prfaas_cache_pool_ssd_read_errors",
                                  "SSD entries missing or failing their checksum (served as misses).",
                                  value=s.ssd_read_errors)
        held = s.arena_slots - s.arena_free_slots - s.leased_slots
        yield _labelled(GaugeMetricFamily, "prfaas_cache_pool_arena_slots",
                        "Slots of the shared-memory arena by state (all 0 without an arena, or before the first "
                        "Put fixes the slot size).", "state",
                        {"stored": held, "free": s.arena_free_slots, "leased": s.leased_slots})
        yield CounterMetricFamily("prfaas_cache_pool_lease_expiries",
                                  "Put leases on arena slots that expired before their commit (a client died or "
                                  "stalled mid-Put); their slots were freed.", value=s.lease_expiries)


class _RejectionCollector:
    def __init__(self, rejections) -> None:
        self._rejections = rejections

    def collect(self) -> Iterator[Metric]:
        metric = CounterMetricFamily("prfaas_grpc_rejected", "gRPC calls a service refused, by reason: missing_token, "
                                     "wrong_token (UNAUTHENTICATED), unknown_peer (PERMISSION_DENIED).",
                                     labels=["service", "reason"])
        for reason, count in self._rejections.snapshot().items():
            metric.add_metric([self._rejections.service, reason], count)
        yield metric


def _labelled(family, name: str, documentation: str, label: str, values: dict[str, float]) -> Metric:
    metric = family(name, documentation, labels=[label])
    for label_value, value in values.items():
        metric.add_metric([label_value], value)
    return metric
