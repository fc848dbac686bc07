"""deploy/observability and the router HPA: every PromQL query parses and refers only to metrics (and
labels) that the services export, collected from their metric registries."""
import importlib
import inspect
import json
import re
from pathlib import Path

import promql_parser
import pytest
import yaml
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from services.cache_pool_client.types import PoolStats
from support.kustomize import deployments, render

ROOT = Path(__file__).resolve().parents[2]
OBSERVABILITY = ROOT / "deploy" / "observability"
# Metric classes that need arguments: how to build one (with empty stats) to read its registry.
FACTORIES = {
    "services.cache_pool.metrics.PoolMetrics": lambda cls: cls(PoolStats),
}
GRAFANA_VARIABLES = {"$__rate_interval": "5m", "$__interval": "1m", "$__range": "1h"}
SEVERITIES = {"warning", "critical"}


def metric_registries() -> list[CollectorRegistry]:
    """The registries of every ``services/*/metrics.py`` class that builds one without arguments (or
    through ``FACTORIES``)."""
    registries = []
    for path in sorted(ROOT.glob("services/*/metrics.py")):
        module = importlib.import_module(f"services.{path.parent.name}.metrics")
        for cls in vars(module).values():
            if not (inspect.isclass(cls) and cls.__module__ == module.__name__):
                continue
            factory = FACTORIES.get(f"{cls.__module__}.{cls.__qualname__}")
            if factory is not None or _takes_no_arguments(cls):
                registry = getattr(factory(cls) if factory else cls(), "registry", None)
                if isinstance(registry, CollectorRegistry):
                    registries.append(registry)
    return registries


def _takes_no_arguments(cls: type) -> bool:
    parameters = list(inspect.signature(cls).parameters.values())
    return all(p.default is not inspect.Parameter.empty or p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
               for p in parameters)


def exported_series() -> dict[str, set[str]]:
    """Series name as scraped -> its label names (prometheus_client's suffixes applied). Custom
    collectors (metrics read at scrape time) report their samples, which they yield even when zero."""
    series = {}
    for registry in metric_registries():
        for collector in registry._collector_to_names:
            if not isinstance(collector, (Counter, Gauge, Histogram)):
                for family in collector.collect():
                    for sample in family.samples:
                        series.setdefault(sample.name, set()).update(sample.labels)
                continue
            labels = set(getattr(collector, "_labelnames", ()))
            name = collector._name
            if isinstance(collector, Counter):
                series[f"{name}_total"] = labels
            elif isinstance(collector, Histogram):
                series.update({f"{name}_bucket": labels | {"le"}, f"{name}_sum": labels, f"{name}_count": labels})
            elif isinstance(collector, Gauge):
                series[name] = labels
    return series


def selectors(expr: str) -> list[promql_parser.VectorSelector]:
    for variable, value in GRAFANA_VARIABLES.items():
        expr = expr.replace(variable, value)
    found = []
    promql_parser.walk(promql_parser.parse(expr), lambda node: found.append(node)
                       if isinstance(node, promql_parser.VectorSelector) else None)
    return found


def dashboard_queries() -> list[str]:
    dashboard = json.loads((OBSERVABILITY / "grafana-dashboard.json").read_text())
    panels = [p for top in dashboard["panels"] for p in (top, *top.get("panels", []))]
    return [t["expr"] for p in panels for t in p.get("targets", [])]


def alert_rules() -> list[dict]:
    groups = yaml.safe_load((OBSERVABILITY / "alerts.yaml").read_text())["groups"]
    return [rule for group in groups for rule in group["rules"]]


def all_queries() -> list[str]:
    return dashboard_queries() + [rule["expr"] for rule in alert_rules()]


def test_metrics_are_collected_from_the_code():
    series = exported_series()
    assert "prfaas_router_time_to_first_token_seconds_bucket" in series
    assert series["prfaas_router_routed_requests_total"] == {"path"}
    assert series["prfaas_cache_pool_hits_total"] == {"group"}
    assert series["prfaas_cache_pool_stored_bytes"] == {"tier"}
    assert "prfaas_cache_pool_lookup_latency_seconds_bucket" in series


def test_metric_names_carry_the_prefix():
    assert all(name.startswith("prfaas_") for name in exported_series())


@pytest.mark.parametrize("expr", all_queries())
def test_query_refers_only_to_exported_metrics_and_labels(expr):
    series = exported_series()
    found = selectors(expr)
    assert found, f"no metric in {expr!r}"
    for selector in found:
        assert selector.name in series, f"{selector.name} is not exported (query {expr!r})"
        labels = {m.name for m in selector.matchers.matchers}
        assert labels <= series[selector.name], f"{selector.name} has no label {labels - series[selector.name]}"


def test_dashboard_covers_the_operator_questions():
    text = "\n".join(dashboard_queries())
    assert "histogram_quantile" in text
    for metric in ("prfaas_router_time_to_first_token_seconds", "prfaas_router_inter_token_latency_seconds",
                   "prfaas_router_routed_requests_total", "prfaas_kv_link_sent_bytes",
                   "prfaas_kv_link_retransmits", "prfaas_router_worker_kv_cache_usage_ratio",
                   "prfaas_router_prefill_fallbacks_total", "prfaas_cache_pool_hits_total",
                   "prfaas_cache_pool_misses_total", "prfaas_cache_pool_stored_bytes",
                   "prfaas_cache_pool_evictions_total", "prfaas_cache_pool_lookup_latency_seconds_bucket"):
        assert metric in text


def test_alert_rules_are_well_formed():
    rules = alert_rules()
    names = [rule["alert"] for rule in rules]
    assert len(names) == len(set(names))
    for rule in rules:
        assert re.fullmatch(r"Prfaas[A-Za-z]+", rule["alert"])
        assert rule["labels"]["severity"] in SEVERITIES
        assert rule["annotations"]["summary"]
        assert re.fullmatch(r"[0-9]+[smh]", rule.get("for", "0s"))
    text = "\n".join(rule["expr"] for rule in rules)
    for metric in ("prfaas_kv_link_retransmits", "prfaas_kv_link_goodput_bits_per_second",
                   "prfaas_router_time_to_first_token_seconds_bucket", "prfaas_router_worker_up"):
        assert metric in text


@pytest.mark.parametrize("deployment", deployments())
def test_hpa_scales_on_an_exported_router_metric(deployment):
    (hpa,) = render(deployment, "local-cluster").of_kind("HorizontalPodAutoscaler")
    for metric in hpa["spec"]["metrics"]:
        assert metric[metric["type"].lower()]["metric"]["name"] in exported_series()
