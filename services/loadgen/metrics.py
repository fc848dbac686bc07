"""Aggregation of request outcomes into the summary (field names follow `vllm bench serve`)."""
from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

import numpy as np

from services.loadgen.client import RequestOutcome
from services.loadgen.config import Slo

LATENCIES = ("ttft", "tpot", "itl", "e2el")
STATISTICS = ("mean", "median", "std", "p90", "p99")


def distribution(values_s: Sequence[float]) -> dict[str, float]:
    """mean, median, std (population), p90 and p99 in milliseconds of latencies given in seconds; zeros when empty."""
    if len(values_s) == 0:
        return dict.fromkeys(STATISTICS, 0.0)
    ms = np.asarray(values_s, dtype=float) * 1000.0
    return {"mean": float(ms.mean()), "median": float(np.median(ms)), "std": float(ms.std()),
            "p90": float(np.percentile(ms, 90)), "p99": float(np.percentile(ms, 99))}


def tpot(outcome: RequestOutcome) -> float | None:
    """Time per output token after the first: (E2E - TTFT) / (output tokens - 1); None for one-token outputs."""
    if outcome.output_len <= 1:
        return None
    return (outcome.e2el - outcome.ttft) / (outcome.output_len - 1)


def meets_slo(outcome: RequestOutcome, slo: Slo) -> bool:
    if not outcome.ok:
        return False
    per_token = tpot(outcome) or 0.0
    checks = ((slo.ttft_ms, outcome.ttft), (slo.tpot_ms, per_token), (slo.e2el_ms, outcome.e2el))
    return all(limit is None or value * 1000.0 <= limit for limit, value in checks)


def error_kind(outcome: RequestOutcome) -> str:
    return "ok" if outcome.ok else "rejected" if outcome.rejected else "failed"


def errors_by_status(outcomes: Sequence[RequestOutcome]) -> dict[str, dict[str, int]]:
    """{"rejected": {"503": n, ...}, "failed": {"500": n, "connection": n, ...}}."""
    counts: dict[str, Counter] = {"rejected": Counter(), "failed": Counter()}
    for outcome in outcomes:
        if not outcome.ok:
            counts[error_kind(outcome)][str(outcome.status)] += 1
    return {kind: dict(sorted(counter.items())) for kind, counter in counts.items()}


def summarize(outcomes: Sequence[RequestOutcome], duration_s: float, slo: Slo, started: float) -> dict:
    """The result dict for measured requests; `started` is the perf_counter time the benchmark began."""
    done = [o for o in outcomes if o.ok]
    total_input = sum(o.input_len for o in done)
    total_output = sum(o.output_len for o in done)
    per_second = 1.0 / duration_s if duration_s > 0 else 0.0
    latencies = {
        "ttft": [o.ttft for o in done],
        "tpot": [t for t in map(tpot, done) if t is not None],
        "itl": [gap for o in done for gap in o.itl],
        "e2el": [o.e2el for o in done],
    }
    errors = errors_by_status(outcomes)
    result = {
        "duration": duration_s,
        "completed": len(done),
        "failed": sum(errors["failed"].values()),
        "rejected": sum(errors["rejected"].values()),
        "total_input_tokens": total_input,
        "total_output_tokens": total_output,
        "request_throughput": len(done) * per_second,
        "request_goodput": sum(meets_slo(o, slo) for o in done) * per_second if slo.is_set else None,
        "output_throughput": total_output * per_second,
        "total_token_throughput": (total_input + total_output) * per_second,
        "usage_mismatches": sum(o.usage_mismatch for o in done),
        "usage_missing": sum(o.usage_completion_tokens is None for o in done),
        "errors_by_status": errors,
    }
    for name, values in latencies.items():
        for statistic, value in distribution(values).items():
            result[f"{statistic}_{name}_ms"] = value
    result.update(per_request(outcomes, started))
    return result


def per_request(outcomes: Sequence[RequestOutcome], started: float) -> dict[str, list]:
    """Per-request arrays in request order (failed requests included, with zero latencies)."""
    return {
        "input_lens": [o.input_len for o in outcomes],
        "output_lens": [o.output_len if o.ok else 0 for o in outcomes],
        "ttfts": [o.ttft if o.ok else 0.0 for o in outcomes],
        "itls": [list(o.itl) if o.ok else [] for o in outcomes],
        "e2els": [o.e2el for o in outcomes],
        "start_times": [o.start - started for o in outcomes],
        "statuses": [o.status for o in outcomes],
        "errors": [o.error for o in outcomes],
        "usage_prompt_tokens": [o.usage_prompt_tokens for o in outcomes],
        "streamed_chunks": [o.num_chunks for o in outcomes],
    }
