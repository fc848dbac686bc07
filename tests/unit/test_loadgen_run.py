"""`run_benchmark` and `prfaas bench` against an in-process OpenAI SSE stand-in (no vLLM)."""
import asyncio
import json

import pytest

from services.cli import main
from services.loadgen.config import BenchConfig, WorkloadConfig
from services.loadgen.runner import run_benchmark
from support.fake_openai import FakeOpenAI, FakeOpenAIThread
from support.ports import refused_address

SMALL = WorkloadConfig(input_len=16, output_len=4)


def with_fake(test, fake: FakeOpenAI | None = None):
    async def go():
        server = await (fake or FakeOpenAI()).start()
        try:
            return await test(server)
        finally:
            await server.stop()
    return asyncio.run(go())


def run_against(fake: FakeOpenAI, **overrides) -> tuple[dict, FakeOpenAI]:
    async def test(server):
        config = BenchConfig(**{"base_url": server.base_url, "model": server.model, "workload": SMALL,
                                "num_prompts": 8, **overrides})
        return await run_benchmark(config)
    return with_fake(test, fake), fake


def test_all_requests_complete_with_usage_matching_the_stream():
    result, fake = run_against(FakeOpenAI(), ignore_eos=True)
    assert result["completed"] == 8 and result["failed"] == 0 and result["rejected"] == 0
    assert result["total_output_tokens"] == 32 and result["usage_mismatches"] == 0
    assert result["total_input_tokens"] == 8 * 16
    body = fake.received[0]
    assert body["max_tokens"] == 4 and "min_tokens" not in body and body["ignore_eos"] is True
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert "temperature" not in body


def test_chat_endpoint_sends_messages():
    result, fake = run_against(FakeOpenAI(), endpoint="chat")
    assert result["completed"] == 8
    assert fake.received[0]["messages"][-1]["role"] == "user"


def test_usage_mismatches_are_counted():
    result, _ = run_against(FakeOpenAI(extra_usage_tokens=1))
    assert result["usage_mismatches"] == 8
    assert result["total_output_tokens"] == 8 * 5  # the server's usage wins


def test_503_is_counted_as_rejected():
    result, _ = run_against(FakeOpenAI(status=503))
    assert result["completed"] == 0 and result["rejected"] == 8 and result["failed"] == 0
    assert result["errors_by_status"] == {"rejected": {"503": 8}, "failed": {}}
    assert "fake error 503" in result["errors"][0]


def test_500_is_counted_as_failed():
    result, _ = run_against(FakeOpenAI(status=500))
    assert result["failed"] == 8 and result["rejected"] == 0


def test_an_error_in_the_stream_is_a_failure():
    result, _ = run_against(FakeOpenAI(error_after_tokens=2))
    assert result["failed"] == 8 and result["errors_by_status"]["failed"] == {"stream": 8}
    assert result["errors"][0] == "error in stream: worker failed"


def test_unknown_model_lists_the_served_ones():
    result, _ = run_against(FakeOpenAI(), model="nope")
    assert "does not serve model 'nope'" in result["fatal_error"] and "fake-model" in result["fatal_error"]
    assert result["completed"] == 0


def test_the_only_served_model_is_the_default():
    result, fake = run_against(FakeOpenAI(), model=None)
    assert result["model_id"] == "fake-model" and fake.received[0]["model"] == "fake-model"


def test_max_concurrency_bounds_requests_in_flight():
    result, fake = run_against(FakeOpenAI(token_delay_s=0.01), max_concurrency=2, num_prompts=10)
    assert result["completed"] == 10 and fake.max_in_flight == 2


def test_request_rate_spaces_the_requests():
    result, _ = run_against(FakeOpenAI(), request_rate=40.0, num_prompts=20, seed=3)
    starts = result["start_times"]
    assert 0.2 < starts[-1] < 1.2  # 19 gaps of 25 ms on average
    assert starts == sorted(starts)


def test_duration_stops_sending():
    result, _ = run_against(FakeOpenAI(), request_rate=50.0, num_prompts=None, duration_s=0.5)
    assert 10 <= result["completed"] <= 45
    assert max(result["start_times"]) < 0.5


def test_warmup_requests_are_not_counted():
    result, fake = run_against(FakeOpenAI(), warmup=3, num_prompts=5)
    assert result["completed"] == 5 and len(fake.received) == 8


def test_trace_replay_keeps_its_timing(tmp_path):
    stamps = [100.0, 100.1, 100.35, 100.6, 100.65, 101.0]
    trace = tmp_path / "trace.jsonl"
    trace.write_text("".join(json.dumps({"timestamp": t, "input_length": 8, "output_length": 2}) + "\n"
                             for t in stamps))
    workload = WorkloadConfig(dataset="trace", trace_path=str(trace))
    result, fake = run_against(FakeOpenAI(), workload=workload, num_prompts=None, duration_s=10.0)
    assert result["completed"] == 6
    for planned, sent in zip(stamps, result["start_times"]):
        assert sent == pytest.approx(planned - stamps[0], abs=0.03)
    received = [t - fake.received_at[0] for t in fake.received_at]
    for planned, got in zip(stamps, received):
        assert got == pytest.approx(planned - stamps[0], abs=0.03)


def test_multi_turn_carries_the_previous_answers():
    workload = WorkloadConfig(dataset="multi-turn", num_turns=2, input_len=8, output_len=3)
    result, fake = run_against(FakeOpenAI(), workload=workload, num_prompts=4, endpoint="chat")
    assert result["completed"] == 4
    second_turns = [b["messages"] for b in fake.received if len(b["messages"]) == 3]
    assert len(second_turns) == 2
    assert all(m[1] == {"role": "assistant", "content": " t0 t1 t2"} for m in second_turns)
    assert result["input_lens"][2] > result["input_lens"][0]


def test_router_metrics_are_scraped_as_deltas():
    def metrics(fake):
        return ("# TYPE prfaas_router_routed_requests_total counter\n"
                f'prfaas_router_routed_requests_total{{path="local"}} {fake.num_served}\n'
                f'prfaas_router_routed_requests_total{{path="prfaas"}} {fake.num_served // 2}\n')
    result, _ = run_against(FakeOpenAI(metrics_text=metrics), num_prompts=4)
    assert result["router_metrics"]["routed_requests"] == {"local": 4.0, "prfaas": 2.0}
    assert result["router_metrics"]["offloaded_fraction"] == pytest.approx(1 / 3)


def test_no_router_metrics_for_other_servers():
    result, _ = run_against(FakeOpenAI(metrics_text="vllm:num_requests_running 0\n"), num_prompts=2)
    assert "router_metrics" not in result


def test_stop_returns_partial_results():
    async def test(server):
        stop = asyncio.Event()
        config = BenchConfig(base_url=server.base_url, model=server.model, workload=SMALL, num_prompts=50,
                             request_rate=20.0)
        asyncio.get_running_loop().call_later(0.5, stop.set)
        result = await run_benchmark(config, stop=stop)
        assert not [t for t in asyncio.all_tasks() if "services/loadgen" in t.get_coro().cr_code.co_filename]
        return result
    result = with_fake(test, FakeOpenAI(token_delay_s=0.05))
    assert result["interrupted"] and 0 < len(result["input_lens"]) < 50
    assert "cancelled" in result["errors_by_status"]["failed"]


def cli(*args) -> int:
    return main(["bench", *args, "--no-progress"] if args[0] == "serve" else ["bench", *args])


def test_cli_unreachable_endpoint_writes_a_partial_result(tmp_path, capsys):
    path = tmp_path / "r.json"
    with refused_address() as address:
        url = f"http://{address}"
        assert cli("serve", "--base-url", url, "--num-prompts", "2", "--result-file", str(path)) == 0
        assert "cannot connect to 127.0.0.1" in capsys.readouterr().err
        result = json.loads(path.read_text())
        assert result["completed"] == 0 and "cannot connect" in result["fatal_error"]
        assert cli("serve", "--base-url", url, "--result-file", str(path), "--fail-on-error") == 1


def test_cli_rejections_exit_nonzero_only_with_fail_on_error(tmp_path, capsys):
    path = tmp_path / "r.json"
    with FakeOpenAIThread(FakeOpenAI(status=503)) as fake:
        args = ("serve", "--base-url", fake.base_url + "/v1", "--num-prompts", "3", "--input-len", "8",
                "--output-len", "2", "--result-file", str(path))
        assert cli(*args) == 0
        assert json.loads(path.read_text())["rejected"] == 3
        assert cli(*args, "--fail-on-error") == 1
    assert "first error: HTTP 503" in capsys.readouterr().err


def test_cli_summary_result_file_and_plots(tmp_path, capsys):
    path = tmp_path / "r.json"
    with FakeOpenAIThread(FakeOpenAI(token_delay_s=0.001)) as fake:
        assert cli("serve", "--base-url", fake.base_url, "--num-prompts", "6", "--input-len", "8",
                   "--output-len", "3", "--slo", "ttft_ms=2000", "tpot_ms=50", "--request-rate", "100",
                   "--result-file", str(path), "--plot", str(tmp_path / "plots")) == 0
    out = capsys.readouterr().out
    assert "Serving Benchmark Result" in out and "Request goodput (req/s):" in out
    result = json.loads(path.read_text())
    for key in ("duration", "completed", "total_input_tokens", "total_output_tokens", "request_throughput",
                "request_goodput", "output_throughput", "total_token_throughput", "mean_ttft_ms", "median_ttft_ms",
                "std_ttft_ms", "p90_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "median_tpot_ms", "p99_tpot_ms",
                "mean_itl_ms", "median_itl_ms", "p99_itl_ms", "mean_e2el_ms", "median_e2el_ms", "p99_e2el_ms",
                "input_lens", "output_lens", "ttfts", "itls", "errors", "max_concurrency", "request_rate",
                "burstiness"):
        assert key in result, key
    assert result["request_rate"] == 100.0 and result["completed"] == 6
    pytest.importorskip("matplotlib")
    assert (tmp_path / "plots" / "latency_cdf.png").stat().st_size > 0
    assert (tmp_path / "plots" / "timeline.png").stat().st_size > 0


@pytest.mark.parametrize("args, message", [
    (("--slo", "ttft=5"), "--slo"),
    (("--duration", "5"), "--duration without --num-prompts needs"),
    (("--endpoint", "chat", "--dataset", "trace"), "--trace"),
    (("--request-rate", "0"), "--request-rate"),
])
def test_cli_argument_errors_exit_2(args, message, capsys):
    assert cli("serve", "--base-url", "http://127.0.0.1:1", *args) == 2
    assert message in capsys.readouterr().err


def test_cli_compare(tmp_path, capsys):
    (tmp_path / "a.json").write_text(json.dumps({"request_throughput": 2.0, "mean_ttft_ms": 10.0}))
    (tmp_path / "b.json").write_text(json.dumps({"request_throughput": 5.0, "mean_ttft_ms": 12.0}))
    assert cli("compare", str(tmp_path / "a.json"), str(tmp_path / "b.json")) == 0
    out = capsys.readouterr().out
    assert "2.500" in out and "1.200" in out
    assert cli("compare", str(tmp_path / "a.json"), str(tmp_path / "missing.json")) == 2
