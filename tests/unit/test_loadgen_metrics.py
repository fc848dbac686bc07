"""Metrics math of `prfaas bench`, with hand-computed values."""
import pytest

from services.loadgen.client import RequestOutcome
from services.loadgen.config import ConfigError, Slo
from services.loadgen.metrics import distribution, errors_by_status, meets_slo, summarize, tpot
from services.loadgen.report import compare_table, summary_table
from services.loadgen.router_metrics import is_router, router_deltas


def outcome(index=0, *, ok=True, status=200, ttft=0.1, e2el=1.0, tokens=10, input_len=100, start=0.0, itl=None):
    result = RequestOutcome(index, input_len, tokens, start=start, ok=ok, status=status, ttft=ttft, e2el=e2el,
                            num_chunks=tokens if ok else 0, usage_completion_tokens=tokens if ok else None)
    result.itl = itl if itl is not None else [(e2el - ttft) / max(1, tokens - 1)] * (tokens - 1) if ok else []
    return result


def test_distribution_of_four_values():
    stats = distribution([0.001, 0.002, 0.003, 0.004])
    assert stats["mean"] == pytest.approx(2.5)
    assert stats["median"] == pytest.approx(2.5)
    assert stats["std"] == pytest.approx(1.25 ** 0.5)
    assert stats["p90"] == pytest.approx(3.7)   # rank 0.9 * 3 = 2.7 -> 3 + 0.7
    assert stats["p99"] == pytest.approx(3.97)


def test_distribution_of_nothing_is_zeros():
    assert set(distribution([]).values()) == {0.0}


@pytest.mark.parametrize("ttft, e2el, tokens, expected", [
    (0.1, 1.0, 10, 0.1),
    (0.5, 0.5, 1, None),
    (0.2, 0.4, 3, 0.1),
])
def test_tpot_excludes_the_first_token(ttft, e2el, tokens, expected):
    value = tpot(outcome(ttft=ttft, e2el=e2el, tokens=tokens))
    assert value == (pytest.approx(expected) if expected is not None else None)


@pytest.mark.parametrize("slo, ttft, e2el, tokens, good", [
    (Slo(ttft_ms=100), 0.1, 1.0, 10, True),           # exactly at the limit counts
    (Slo(ttft_ms=99), 0.1, 1.0, 10, False),
    (Slo(tpot_ms=100), 0.1, 1.0, 10, True),
    (Slo(tpot_ms=50), 0.1, 1.0, 10, False),
    (Slo(tpot_ms=1), 0.1, 0.1, 1, True),              # one token: no TPOT to violate
    (Slo(ttft_ms=200, tpot_ms=100, e2el_ms=900), 0.1, 1.0, 10, False),
])
def test_meets_slo(slo, ttft, e2el, tokens, good):
    assert meets_slo(outcome(ttft=ttft, e2el=e2el, tokens=tokens), slo) is good


def test_failed_requests_never_meet_the_slo():
    assert not meets_slo(outcome(ok=False, status=500), Slo(ttft_ms=1e9))


def test_slo_parsing():
    assert Slo.parse(["ttft_ms=2000", "tpot_ms=50"]) == Slo(ttft_ms=2000.0, tpot_ms=50.0)
    for bad in (["ttft=2000"], ["ttft_ms"], ["tpot_ms=fast"], ["e2el_ms=-1"]):
        with pytest.raises(ConfigError, match="--slo"):
            Slo.parse(bad)


def test_errors_split_rejected_from_failed():
    outcomes = [outcome(ok=False, status=s) for s in (503, 429, 503, 500, "connection")] + [outcome()]
    assert errors_by_status(outcomes) == {"rejected": {"429": 1, "503": 2}, "failed": {"500": 1, "connection": 1}}


def test_summary_of_hand_made_outcomes():
    outcomes = [
        outcome(0, ttft=0.1, e2el=1.0, tokens=10, input_len=100, start=10.0),   # tpot 100 ms
        outcome(1, ttft=0.3, e2el=0.5, tokens=5, input_len=50, start=10.5),     # tpot 50 ms
        outcome(2, ok=False, status=503, input_len=70, start=11.0),
    ]
    result = summarize(outcomes, duration_s=2.0, slo=Slo(ttft_ms=200), started=10.0)
    assert result["completed"] == 2 and result["rejected"] == 1 and result["failed"] == 0
    assert result["total_input_tokens"] == 150
    assert result["total_output_tokens"] == 15
    assert result["request_throughput"] == pytest.approx(1.0)
    assert result["request_goodput"] == pytest.approx(0.5)
    assert result["output_throughput"] == pytest.approx(7.5)
    assert result["total_token_throughput"] == pytest.approx(82.5)
    assert result["mean_ttft_ms"] == pytest.approx(200.0)
    assert result["mean_tpot_ms"] == pytest.approx(75.0)
    assert result["median_e2el_ms"] == pytest.approx(750.0)
    assert result["mean_itl_ms"] == pytest.approx((9 * 100 + 4 * 50) / 13)
    assert result["input_lens"] == [100, 50, 70]
    assert result["output_lens"] == [10, 5, 0]
    assert result["start_times"] == [0.0, 0.5, 1.0]
    assert result["usage_mismatches"] == 0


def test_usage_mismatch_is_counted():
    mismatched = outcome(tokens=10)
    mismatched.num_chunks = 9
    result = summarize([mismatched, outcome()], 1.0, Slo(), 0.0)
    assert result["usage_mismatches"] == 1
    assert result["request_goodput"] is None


ROUTER_BEFORE = """# TYPE prfaas_router_routed_requests_total counter
prfaas_router_routed_requests_total{path="local"} 4.0
prfaas_router_routed_requests_total{path="prfaas"} 1.0
# TYPE prfaas_router_prefill_fallbacks_total counter
prfaas_router_prefill_fallbacks_total 0.0
# TYPE prfaas_router_requests_total counter
prfaas_router_requests_total{endpoint="/v1/completions",status="200"} 5.0
"""
ROUTER_AFTER = """# TYPE prfaas_router_routed_requests_total counter
prfaas_router_routed_requests_total{path="local"} 10.0
prfaas_router_routed_requests_total{path="prfaas"} 3.0
# TYPE prfaas_router_prefill_fallbacks_total counter
prfaas_router_prefill_fallbacks_total 1.0
# TYPE prfaas_router_requests_total counter
prfaas_router_requests_total{endpoint="/v1/completions",status="200"} 12.0
prfaas_router_requests_total{endpoint="/v1/completions",status="503"} 1.0
"""


def test_router_deltas():
    assert is_router(ROUTER_BEFORE) and not is_router("vllm:num_requests_running 0") and not is_router(None)
    deltas = router_deltas(ROUTER_BEFORE, ROUTER_AFTER)
    assert deltas["routed_requests"] == {"local": 6.0, "prfaas": 2.0}
    assert deltas["offloaded_fraction"] == pytest.approx(0.25)
    assert deltas["prefill_fallbacks"] == 1.0
    assert deltas["requests_by_status"] == {"/v1/completions 200": 7.0, "/v1/completions 503": 1.0}


def test_compare_prints_ratios_b_over_a():
    a = {"request_throughput": 2.0, "mean_ttft_ms": 100.0, "completed": 10, "request_goodput": None}
    b = {"request_throughput": 3.0, "mean_ttft_ms": 50.0, "completed": 10, "request_goodput": None}
    table = compare_table(a, b, "base", "new")
    lines = {line.split("  ")[0]: line for line in table.splitlines()}
    assert lines["Request throughput (req/s) ↑"].split()[-1] == "1.500"
    assert lines["Mean TTFT (ms) ↓"].split()[-1] == "0.500"
    assert lines["Successful requests ↑"].split()[-1] == "1.000"
    assert "goodput" not in table


def test_summary_table_has_the_vllm_rows():
    result = summarize([outcome()], 1.0, Slo(ttft_ms=1000), 0.0)
    table = summary_table({**result, "max_concurrency": None, "request_rate": "inf"})
    for row in ("Successful requests:", "Request goodput (req/s):", "Mean TTFT (ms):", "P99 ITL (ms):"):
        assert row in table
