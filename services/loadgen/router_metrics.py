"""Deltas of a PrfaaS router's Prometheus counters over a benchmark run."""
from __future__ import annotations

from collections import defaultdict

ROUTER_PREFIX = "prfaas_router_"
OFFLOAD_PATH = "prfaas"


def is_router(metrics_text: str | None) -> bool:
    return bool(metrics_text) and ROUTER_PREFIX in metrics_text


def parse_counters(metrics_text: str) -> dict[str, dict[tuple, float]]:
    """Counter samples by name (without `_total`) and sorted label items; other metric types are skipped."""
    from prometheus_client.parser import text_string_to_metric_families

    counters: dict[str, dict[tuple, float]] = defaultdict(dict)
    for family in text_string_to_metric_families(metrics_text):
        if family.type != "counter" or not family.name.startswith(ROUTER_PREFIX):
            continue
        for sample in family.samples:
            if sample.name.endswith("_total"):
                counters[family.name][tuple(sorted(sample.labels.items()))] = sample.value
    return dict(counters)


def router_deltas(before_text: str, after_text: str) -> dict:
    """Routed requests by path and the offloaded fraction, prefill fallbacks, requests by status, tokens."""
    before, after = parse_counters(before_text), parse_counters(after_text)

    def delta(name: str, label: str | None = None) -> dict[str, float] | float:
        samples = after.get(ROUTER_PREFIX + name, {})
        old = before.get(ROUTER_PREFIX + name, {})
        if label is None:
            return sum(v - old.get(k, 0.0) for k, v in samples.items())
        by_label: dict[str, float] = defaultdict(float)
        for labels, value in samples.items():
            by_label[" ".join(v for k, v in labels if k in label.split(","))] += value - old.get(labels, 0.0)
        return {k: v for k, v in sorted(by_label.items()) if v}

    routed = delta("routed_requests", "path")
    total_routed = sum(routed.values())
    return {
        "routed_requests": routed,
        "offloaded_fraction": routed.get(OFFLOAD_PATH, 0.0) / total_routed if total_routed else None,
        "prefill_fallbacks": delta("prefill_fallbacks"),
        "worker_retries": delta("worker_retries"),
        "requests_by_status": delta("requests", "endpoint,status"),
        "prompt_tokens": delta("prompt_tokens"),
        "generation_tokens": delta("generation_tokens"),
    }
