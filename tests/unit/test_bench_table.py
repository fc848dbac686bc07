"""bench/_headlines.py: the benchmarks' last lines read back, the previous run found, the table written
(no benchmark runs here)."""
import json
from pathlib import Path

import pytest
from support.bench import bench_module

headlines = bench_module("_headlines")
as_json, last_line, parse, previous_figures, table = (
    headlines.as_json, headlines.last_line, headlines.parse, headlines.previous_figures,
    headlines.table)


@pytest.mark.parametrize("line, figure, target, baseline, verdict", [
    ("cache lookup p50 latency, 128K-token prompt [ms]: 1.688 (block size 128, xxh3 hashing: p50 1.688 ms "
     "(hashing 0.856 + query 0.832), p99 2.025 ms, 400 lookups, half the prompt stored); baseline vllm-sha256 "
     "hashing p50 4.304 ms; target <= 2.0: PASS", 1.688, "<= 2.0", "vllm-sha256 hashing p50 4.304 ms", "PASS"),
    ("transport WAN goodput with 8 connections, fraction of the cap: 0.773 (1 connection 0.41, 1.89x; 20 ms RTT, "
     "1% loss, TCP cubic); target >= 0.85 and >= 1.2x one connection: FAIL", 0.773,
     ">= 0.85 and >= 1.2x one connection", "", "FAIL"),
    ("simulator speed, simulated requests per wall second: 31415.927 (1,000,000 requests in 31.83 s); "
     "target >= 20000: PASS", 31415.927, ">= 20000", "", "PASS"),
    ("chaos: completed 0.981 of 212 requests not held by a killed prefill worker, pool or router; "
     "target >= 0.95 and 0 wrong/hung/lost/leaked: PASS", 0.981, ">= 0.95 and 0 wrong/hung/lost/leaked", "", "PASS"),
    ("sim_vs_real: worst error 2.45x its target (throughput and offload within 10%): FAIL", 2.45,
     "(throughput and offload within 10%)", "", "FAIL"),
    ("Traceback: something broke", None, "", "", ""),
])
def test_headlines_parse(line, figure, target, baseline, verdict):
    result = parse("b", 0, 1.0, line)
    assert (result.figure, result.target, result.baseline, result.verdict) == (figure, target, baseline, verdict)


def test_the_exit_status_and_the_printed_verdict_both_decide():
    assert parse("b", 0, 1.0, "x: 1.0 (d); target >= 0.5: PASS").passed
    assert not parse("b", 1, 1.0, "x: 1.0 (d); target >= 0.5: PASS").passed  # crashed after its headline
    assert not parse("b", 0, 1.0, "x: 0.1 (d); target >= 0.5: FAIL").passed
    assert not parse("b", -9, 1.0, "").passed


def test_last_line_skips_trailing_blank_lines():
    assert last_line("a\nheadline: 1\n\n  \n") == "headline: 1"
    assert last_line("") == ""


def write_run(results: Path, run: str, figures: dict) -> None:
    rows = [parse(name, 0, 1.0, f"{name}: {value} (d); target >= 1: PASS") for name, value in figures.items()]
    (results / f"{run}.json").write_text(as_json(run, "abc1234", rows, {}))


def test_each_benchmark_s_previous_figure_is_from_the_latest_earlier_run_that_ran_it(tmp_path):
    assert previous_figures(tmp_path, "20261127-120000") == {}
    write_run(tmp_path, "20261126-090000", {"a": 1.0, "c": 4.0})
    write_run(tmp_path, "20261127-080000", {"a": 2.0, "b": 3.0})   # a run of some benchmarks by name
    write_run(tmp_path, "20261128-080000", {"a": 9.0})      # later than the run being written
    (tmp_path / "sim_vs_real.json").write_text("{}")          # not a run of the table
    (tmp_path / "20261127-090000.json").write_text("{not json")  # a run cut short while writing
    assert previous_figures(tmp_path, "20261127-120000") == {
        "a": (2.0, "20261127-080000"), "b": (3.0, "20261127-080000"), "c": (4.0, "20261126-090000")}


def test_the_table_has_a_row_for_every_benchmark_failing_ones_too(tmp_path):
    write_run(tmp_path, "20261126-080000", {"transport_wan": 0.8})
    write_run(tmp_path, "20261127-080000", {"cache_lookup": 1.9})
    earlier = previous_figures(tmp_path, "20261127-120000")
    results = [parse("cache_lookup", 0, 8.2, "lookup [ms]: 1.688 (d); baseline sha 4.3 ms; target <= 2.0: PASS"),
               parse("transport_wan", 1, 95.0, "wan: 0.773 (d); target >= 0.85 | x: FAIL"),
               parse("router_overhead", -15, 900.0, "")]
    text = table("20261127-120000", "abc1234", results, earlier)
    rows = [line for line in text.splitlines() if line.startswith("| ") and "---" not in line][1:]
    assert rows[0] == "| cache_lookup | 1.688 | 1.9 | <= 2.0 | sha 4.3 ms | PASS | 0 | 8 |"
    assert rows[1] == "| transport_wan | 0.773 | 0.8 | >= 0.85 \\| x | - | FAIL | 1 | 95 |"
    assert rows[2] == "| router_overhead | - | - | - | - | FAIL | -15 | 900 |"
    assert "previous figures from 20261127-080000, 20261126-080000" in text and "1 of 3 passed" in text
    assert json.loads(as_json("r", "c", results, earlier))["previous"] == {
        "cache_lookup": "20261127-080000", "transport_wan": "20261126-080000"}
    assert "no previous run" in table("20261127-120000", "abc1234", results, {})
