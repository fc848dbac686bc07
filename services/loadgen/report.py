"""The console summary, the JSON result file, and `bench compare`."""
from __future__ import annotations

import json
import math
from datetime import datetime
from pathlib import Path

from services.loadgen.metrics import LATENCIES

WIDTH = 60
LATENCY_TITLES = {"ttft": "Time to First Token", "tpot": "Time per Output Token (excl. 1st token)",
                  "itl": "Inter-token Latency", "e2el": "End-to-end Latency"}
STATISTIC_TITLES = {"mean": "Mean", "median": "Median", "std": "Std", "p90": "P90", "p99": "P99"}
HEADLINE = (
    ("request_throughput", "Request throughput (req/s)", True),
    ("request_goodput", "Request goodput (req/s)", True),
    ("output_throughput", "Output token throughput (tok/s)", True),
    ("total_token_throughput", "Total token throughput (tok/s)", True),
    ("mean_ttft_ms", "Mean TTFT (ms)", False),
    ("median_ttft_ms", "Median TTFT (ms)", False),
    ("p99_ttft_ms", "P99 TTFT (ms)", False),
    ("mean_tpot_ms", "Mean TPOT (ms)", False),
    ("median_tpot_ms", "Median TPOT (ms)", False),
    ("p99_tpot_ms", "P99 TPOT (ms)", False),
    ("mean_itl_ms", "Mean ITL (ms)", False),
    ("p99_itl_ms", "P99 ITL (ms)", False),
    ("mean_e2el_ms", "Mean E2EL (ms)", False),
    ("p99_e2el_ms", "P99 E2EL (ms)", False),
    ("completed", "Successful requests", True),
    ("failed", "Failed requests", False),
    ("rejected", "Rejected requests", False),
)


def summary_table(result: dict) -> str:
    lines = [" Serving Benchmark Result ".center(WIDTH, "=")]
    row = lines.append
    row(_row("Successful requests:", result["completed"]))
    row(_row("Rejected requests (429/503):", result["rejected"]))
    row(_row("Failed requests:", result["failed"]))
    row(_row("Maximum request concurrency:", result.get("max_concurrency")))
    row(_row("Request rate configured (RPS):", result.get("request_rate")))
    row(_row("Benchmark duration (s):", result["duration"]))
    row(_row("Total input tokens:", result["total_input_tokens"]))
    row(_row("Total generated tokens:", result["total_output_tokens"]))
    row(_row("Request throughput (req/s):", result["request_throughput"]))
    if result.get("request_goodput") is not None:
        row(_row("Request goodput (req/s):", result["request_goodput"]))
    row(_row("Output token throughput (tok/s):", result["output_throughput"]))
    row(_row("Total token throughput (tok/s):", result["total_token_throughput"]))
    row(_row("Usage/stream token mismatches:", result["usage_mismatches"]))
    for name in LATENCIES:
        lines.append(f" {LATENCY_TITLES[name]} ".center(WIDTH, "-"))
        for statistic in ("mean", "median", "std", "p90", "p99"):
            label = f"{STATISTIC_TITLES[statistic]} {name.upper()} (ms):"
            row(_row(label, result[f"{statistic}_{name}_ms"]))
    router = result.get("router_metrics")
    if router:
        lines.append(" PrfaaS router ".center(WIDTH, "-"))
        for path, count in router["routed_requests"].items():
            row(_row(f"Routed via {path}:", int(count)))
        if router["offloaded_fraction"] is not None:
            row(_row("Offloaded fraction:", router["offloaded_fraction"]))
        row(_row("Prefill fallbacks:", int(router["prefill_fallbacks"])))
    errors = result.get("errors_by_status", {})
    if any(errors.values()):
        lines.append(" Errors by status ".center(WIDTH, "-"))
        for kind, counts in errors.items():
            for status, count in counts.items():
                row(_row(f"{kind} {status}:", count))
    lines.append("=" * WIDTH)
    return "\n".join(lines)


def _row(label: str, value) -> str:
    if isinstance(value, float):
        value = f"{value:.2f}"
    return f"{label:<40}{'-' if value is None else value:<{WIDTH - 40}}".rstrip()


def default_result_path(directory: str = "bench-results") -> Path:
    return Path(directory) / f"{datetime.now().strftime('%Y%m%d-%H%M%S')}.json"


def write_result(result: dict, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(_finite(result), indent=2) + "\n")
    return path


def _finite(value):
    """JSON without NaN/Infinity: non-finite floats become strings."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite(v) for v in value]
    return value


def compare_table(a: dict, b: dict, a_name: str = "A", b_name: str = "B") -> str:
    """Headline metrics of two results side by side, with B/A ratios (higher-is-better marked ↑)."""
    lines = [f"{'metric':<36}{a_name[-14:]:>14}{b_name[-14:]:>14}{'B/A':>10}"]
    for key, label, higher_is_better in HEADLINE:
        va, vb = a.get(key), b.get(key)
        if va is None and vb is None:
            continue
        ratio = f"{vb / va:.3f}" if isinstance(va, (int, float)) and isinstance(vb, (int, float)) and va else "-"
        arrow = " ↑" if higher_is_better else " ↓"
        lines.append(f"{label + arrow:<36}{_cell(va):>14}{_cell(vb):>14}{ratio:>10}")
    return "\n".join(lines)


def _cell(value) -> str:
    if value is None:
        return "-"
    return f"{value:.2f}" if isinstance(value, float) else str(value)
