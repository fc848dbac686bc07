"""Prometheus metrics of the router (the only module here that knows prometheus_client)."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics

disable_created_metrics()

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56)


class RouterMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("prfaas_router_requests_total", "Finished API requests by HTTP status.",
                                ["endpoint", "status"], registry=r)
        self.ttft = Histogram("prfaas_router_time_to_first_token_seconds", "Time to first token.",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("prfaas_router_inter_token_latency_seconds", "Time between streamed tokens.",
                             buckets=ITL_BUCKETS, registry=r)
        self.e2e = Histogram("prfaas_router_e2e_request_latency_seconds", "Whole-request latency.",
                             buckets=LATENCY_BUCKETS, registry=r)
        self.prompt_tokens = Counter("prfaas_router_prompt_tokens_total", "Prompt tokens of served requests.",
                                     registry=r)
        self.generation_tokens = Counter("prfaas_router_generation_tokens_total", "Output tokens generated.",
                                         registry=r)
        self.worker_up = Gauge("prfaas_router_worker_up", "1 when the worker answers health checks.",
                               ["worker"], registry=r)
        self.worker_running = Gauge("prfaas_router_worker_running_requests", "Requests running on the worker.",
                                    ["worker"], registry=r)
        self.worker_kv_usage = Gauge("prfaas_router_worker_kv_cache_usage_ratio", "Worker KV cache in use, 0..1.",
                                     ["worker"], registry=r)
        self.worker_retries = Counter("prfaas_router_worker_retries_total",
                                      "Requests moved to another worker before their first token.", registry=r)
