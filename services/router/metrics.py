"""Prometheus metrics of the router (the only module here that knows prometheus_client).

The declarations are one table, ``RouterMetrics``' class body: a row per metric with its type, name, help
and labels. Dashboards, alerts and tests read these names (deploy/observability/).
"""
from __future__ import annotations

from typing import Any, Generic, TypeVar, cast

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics

disable_created_metrics()

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56)
PROMPT_TOKEN_BUCKETS = tuple(2 ** n for n in range(6, 18))  # 64 .. 131072

M = TypeVar("M", Counter, Gauge, Histogram)


class Metric(Generic[M]):
    """One row of the table: built into each ``RouterMetrics``' registry, read as that instance's attribute."""

    def __init__(self, kind: type[M], name: str, documentation: str, labels: tuple[str, ...] = (),
                 buckets: tuple[float, ...] = ()) -> None:
        self.kind: type[M] = kind
        self.name = name
        self.documentation = documentation
        self.labels = labels
        self.buckets = buckets
        self.attribute = ""

    def __set_name__(self, owner: type, attribute: str) -> None:
        self.attribute = attribute

    def __get__(self, metrics: RouterMetrics, owner: type | None = None) -> M:
        return cast(M, metrics.built[self.attribute])

    def build(self, registry: CollectorRegistry) -> M:
        options: dict[str, Any] = {"buckets": self.buckets} if self.buckets else {}
        return self.kind(self.name, self.documentation, self.labels, registry=registry, **options)


class RouterMetrics:
    """The router's metrics; each instance registers the whole table in a registry of its own."""

    requests = Metric(Counter, "prfaas_router_requests_total",
                      "Finished API requests by HTTP status.", ("endpoint", "status"))
    ttft = Metric(Histogram, "prfaas_router_time_to_first_token_seconds",
                  "Time to first token.", buckets=LATENCY_BUCKETS)
    itl = Metric(Histogram, "prfaas_router_inter_token_latency_seconds",
                 "Time between streamed tokens.", buckets=ITL_BUCKETS)
    e2e = Metric(Histogram, "prfaas_router_e2e_request_latency_seconds",
                 "Whole-request latency.", buckets=LATENCY_BUCKETS)
    prompt_tokens = Metric(Counter, "prfaas_router_prompt_tokens_total", "Prompt tokens of served requests.")
    generation_tokens = Metric(Counter, "prfaas_router_generation_tokens_total", "Output tokens generated.")
    worker_up = Metric(Gauge, "prfaas_router_worker_up", "1 when the worker answers health checks.", ("worker",))
    worker_running = Metric(Gauge, "prfaas_router_worker_running_requests",
                            "Requests running on the worker.", ("worker",))
    worker_kv_usage = Metric(Gauge, "prfaas_router_worker_kv_cache_usage_ratio",
                             "Worker KV cache in use, 0..1.", ("worker",))
    routed = Metric(Counter, "prfaas_router_routed_requests_total",
                    "Requests by prefill path: local, pd (local PD-P worker) or prfaas.", ("path",))
    handoffs_waiting = Metric(Gauge, "prfaas_router_handoffs_waiting",
                              "Requests routed to a prefill worker that wait at the router for one of its hand-off "
                              "slots (router.max_handoffs_per_prefill_worker).", ("worker",))
    prefill_fallbacks = Metric(Counter, "prfaas_router_prefill_fallbacks_total",
                               "Remote prefills that failed and were redone locally.")
    worker_retries = Metric(Counter, "prfaas_router_worker_retries_total",
                            "Requests moved to another worker before their first token.")
    migrations = Metric(Counter, "prfaas_router_migrations_total",
                        "Requests whose decode worker failed mid-stream, by the failure (reason: the gRPC status, "
                        "or unanswered_polls) and what followed (outcome: resumed on another worker, finished "
                        "when every token was already out, failed when no worker could go on, limit past "
                        "router.max_migrations).", ("reason", "outcome"))
    admitted = Metric(Counter, "prfaas_router_admitted_requests_total",
                      "Requests admitted, by QoS class.", ("qos_class",))
    rejected = Metric(Counter, "prfaas_router_rejected_requests_total",
                      "Requests rejected by admission control, by reason (no_worker: 503; capacity, ttft_slo, "
                      "decode_load: 429) and QoS class.", ("reason", "qos_class"))
    in_flight = Metric(Gauge, "prfaas_router_in_flight_requests", "Admitted requests not finished yet.", ("qos_class",))
    prefill_rate = Metric(Gauge, "prfaas_router_prefill_rate_tokens_per_second",
                          "Prefill rate per path used to predict TTFT (measured, or configured).", ("path",))
    threshold = Metric(Gauge, "prfaas_scheduler_threshold_tokens",
                       "Offload threshold: prompts with more uncached tokens prefill on the PrfaaS cluster (+Inf "
                       "while offloading is stopped).")
    controller_state = Metric(Gauge, "prfaas_scheduler_controller_state",
                              "1 for the threshold controller's current state (base, raised, stopped).", ("state",))
    link_utilization = Metric(Gauge, "prfaas_scheduler_link_utilization_ratio",
                              "PrfaaS egress rate over scheduler.link_capacity_gbps.")
    link_congested = Metric(Gauge, "prfaas_scheduler_link_congested",
                            "1 when the PrfaaS link shows congestion (retransmits, RTT rise, queue).")
    threshold_base = Metric(Gauge, "prfaas_scheduler_threshold_base_tokens",
                            "Floor the adaptive threshold returns to (moved by each re-optimisation).")
    threshold_ceiling = Metric(Gauge, "prfaas_scheduler_threshold_ceiling_tokens",
                               "Highest threshold the adaptive controller may raise to (moved by each "
                               "re-optimisation).")
    reoptimizations = Metric(Counter, "prfaas_scheduler_reoptimizations_total",
                             "Long-timescale re-optimisations of the threshold's base and ceiling.")
    kv_bytes_per_token = Metric(Gauge, "prfaas_scheduler_kv_bytes_per_token",
                                "KV bytes per offloaded prompt token, measured from the PrfaaS prefill workers' sent "
                                "bytes (at the last re-optimisation): with a wire codec, the coded bytes.")
    link_kv_tokens_per_second = Metric(Gauge, "prfaas_scheduler_link_kv_tokens_per_second",
                                       "Prompt tokens of KV per second the PrfaaS link carries at "
                                       "scheduler.link_capacity_gbps, at the measured KV bytes per token (a wire "
                                       "codec raises it; at the last re-optimisation).")
    threshold_changes = Metric(Counter, "prfaas_scheduler_threshold_changes_total",
                               "Threshold controller state or level changes.")
    decisions = Metric(Counter, "prfaas_scheduler_decisions_total",
                       "Routing decisions by prefill path: local, pd or prfaas (retries decide again).", ("path",))
    decision_prompt_tokens = Metric(Histogram, "prfaas_scheduler_decision_prompt_tokens",
                                    "Uncached prompt tokens of each routing decision, by prefill path: which prompt "
                                    "lengths were offloaded and which stayed local.",
                                    ("path",), buckets=PROMPT_TOKEN_BUCKETS)
    offloaded_fraction = Metric(Gauge, "prfaas_scheduler_offloaded_fraction",
                                "Share of the last 100 routing decisions that offloaded to PrfaaS.")
    bandwidth_scarce = Metric(Gauge, "prfaas_scheduler_bandwidth_scarce",
                              "1 while the threshold is above its base or offloading is stopped: each cluster's "
                              "prefix cache is judged alone.")
    cached_prefix_tokens = Metric(Counter, "prfaas_scheduler_cached_prefix_tokens_total",
                                  "Usable cached prompt tokens the cache pools reported, by cluster.", ("cluster",))
    reused_prefix_tokens = Metric(Counter, "prfaas_scheduler_reused_prefix_tokens_total",
                                  "Cached prompt tokens the chosen prefill path counted on.")
    cross_cluster_transfers = Metric(Counter, "prfaas_scheduler_cross_cluster_transfers_total",
                                     "Cross-cluster prefix-cache transfers decided (abundant bandwidth, better prefix "
                                     "in the other cluster).", ("source", "target"))
    cross_cluster_transfer_tokens = Metric(Counter, "prfaas_scheduler_cross_cluster_transfer_tokens_total",
                                           "Prompt tokens of the decided cross-cluster cache transfers.")
    cache_transfer_blocks = Metric(Counter, "prfaas_cache_transfer_blocks_total",
                                   "Blocks copied between the clusters' pools by cross-cluster cache transfers (only "
                                   "what the target lacked).", ("source", "target"))
    cache_transfer_bytes = Metric(Counter, "prfaas_cache_transfer_bytes_total",
                                  "Bytes copied between the clusters' pools.", ("source", "target"))
    cache_transfer_failures = Metric(Counter, "prfaas_cache_transfer_failures_total",
                                     "Cross-cluster cache transfers that failed (a pool unreachable or a block "
                                     "evicted meanwhile).", ("source", "target"))
    role_flips = Metric(Counter, "prfaas_scheduler_role_flips_total",
                        "Completed role flips of local PD workers, by new role.", ("role",))
    role_flip_cancels = Metric(Counter, "prfaas_scheduler_role_flip_cancels_total",
                               "Role flips given up because the worker did not drain in time.")
    worker_role = Metric(Gauge, "prfaas_scheduler_worker_role",
                         "1 for a local PD worker's current role (prefill, decode, both).", ("worker", "role"))
    worker_draining = Metric(Gauge, "prfaas_scheduler_worker_draining",
                             "1 while a worker drains before a role flip.", ("worker",))
    role_decider = Metric(Gauge, "prfaas_scheduler_role_decider",
                          "1 while this router is the one that makes role decisions (router.role_decisions).")
    prefix_index_blocks = Metric(Gauge, "prfaas_router_prefix_index_blocks",
                                 "Prefix-cache blocks a worker's engine holds, as its stream told this router.",
                                 ("worker",))
    prefix_index_bytes = Metric(Gauge, "prfaas_router_prefix_index_bytes",
                                "Memory this router's copy of the workers' prefix caches takes (estimate).")
    binding_stage = Metric(Gauge, "prfaas_scheduler_binding_stage",
                           "1 for the stage the role balancer sees binding (prefill, decode, none).", ("stage",))
    worker_backoff = Metric(Gauge, "prfaas_router_worker_backoff_seconds",
                            "Current back-off of a worker after failed calls (0: none).", ("worker",))
    layout_unmappable_pairs = Metric(Gauge, "prfaas_router_layout_unmappable_pairs",
                                     "Prefill/decode worker pairs whose announced KV layouts cannot map: no KV goes "
                                     "between them (the reason is logged and listed in /health).")
    layout_pair_unmappable = Metric(Gauge, "prfaas_router_layout_pair_unmappable",
                                    "1 while a prefill worker's KV layout cannot map to a decode worker's.",
                                    ("prefill", "decode"))
    kv_link_goodput = Metric(Gauge, "prfaas_kv_link_goodput_bits_per_second",
                             "Goodput of the last KV transfer from a worker to a peer.", ("worker", "peer"))
    kv_link_rtt = Metric(Gauge, "prfaas_kv_link_rtt_seconds",
                         "Smoothed TCP RTT of a KV link (worst connection).", ("worker", "peer"))
    kv_link_retransmits = Metric(Gauge, "prfaas_kv_link_retransmits",
                                 "TCP retransmits on a KV link's live connections.", ("worker", "peer"))
    kv_link_cwnd = Metric(Gauge, "prfaas_kv_link_cwnd_segments",
                          "Sum of the congestion windows of a KV link.", ("worker", "peer"))
    kv_link_delivery_rate = Metric(Gauge, "prfaas_kv_link_delivery_rate_bits_per_second",
                                   "Kernel-estimated delivery rate of a KV link (sum over connections).",
                                   ("worker", "peer"))
    kv_link_bytes = Metric(Gauge, "prfaas_kv_link_sent_bytes",
                           "Bytes a worker has sent to a KV peer.", ("worker", "peer"))
    kv_link_send_cpu = Metric(Gauge, "prfaas_kv_link_send_cpu_seconds",
                              "CPU seconds a worker's KV sender to a peer has used (I/O thread, kernel work included).",
                              ("worker", "peer"))
    kv_link_failures = Metric(Gauge, "prfaas_kv_link_failed_transfers",
                              "KV transfers to a peer that failed.", ("worker", "peer"))
    kv_received_bytes = Metric(Gauge, "prfaas_kv_received_bytes", "Bytes of KV a worker has received.", ("worker",))
    kv_rejected = Metric(Gauge, "prfaas_kv_rejected_total", "KV frames and connections a worker refused.", ("worker",))
    grpc_rejected = Metric(Gauge, "prfaas_grpc_rejected_total",
                           "gRPC calls a service refused, by reason: missing_token, wrong_token (UNAUTHENTICATED), "
                           "unknown_peer (PERMISSION_DENIED).", ("service", "reason"))

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.built = {row.attribute: row.build(self.registry) for row in self.table()}

    @classmethod
    def table(cls) -> list[Metric[Any]]:
        return [row for row in vars(cls).values() if isinstance(row, Metric)]

    def observe_kv_links(self, worker: str, stats) -> None:
        """Mirror a worker's KV transport telemetry (``WorkerStats``) into gauges."""
        for link in stats.kv_links:
            labels = (worker, link.peer)
            self.kv_link_goodput.labels(*labels).set(link.goodput_bps)
            self.kv_link_rtt.labels(*labels).set(link.rtt_ms / 1000)
            self.kv_link_retransmits.labels(*labels).set(link.retransmits)
            self.kv_link_cwnd.labels(*labels).set(link.cwnd_segments)
            self.kv_link_delivery_rate.labels(*labels).set(link.delivery_rate_bps)
            self.kv_link_bytes.labels(*labels).set(link.bytes_sent)
            self.kv_link_send_cpu.labels(*labels).set(link.send_cpu_s)
            self.kv_link_failures.labels(*labels).set(link.transfers_failed)
        self.kv_received_bytes.labels(worker).set(stats.kv_bytes_received)
        self.kv_rejected.labels(worker).set(stats.kv_frames_rejected + stats.kv_connections_refused)
        for reason, count in stats.grpc_rejected.items():
            self.grpc_rejected.labels(worker, reason).set(count)

    def read_launcher_stats(self, path: str) -> None:
        """``prfaas_launcher_restarts_total{service}``: `prfaas up`'s restart counts, read from the file it
        keeps (services/launcher/watch.py) at each scrape, so they outlive a restart of the router itself."""
        self.registry.register(_LauncherRestarts(path))


class _LauncherRestarts:
    MAX_BYTES = 64 << 10

    def __init__(self, path: str) -> None:
        self.path = path

    def collect(self):
        from prometheus_client.core import CounterMetricFamily

        family = CounterMetricFamily("prfaas_launcher_restarts", "Restarts of each service by `prfaas up` after "
                                     "it exited unexpectedly.", labels=("service",))
        for service, count in self._counts().items():
            family.add_metric((str(service),), float(count))
        yield family

    def _counts(self) -> dict:
        import json

        try:
            with open(self.path, "rb") as file:
                counts = json.loads(file.read(self.MAX_BYTES)).get("restarts", {})
        except (OSError, ValueError, AttributeError):
            return {}
        return {k: v for k, v in counts.items() if isinstance(v, int)} if isinstance(counts, dict) else {}
