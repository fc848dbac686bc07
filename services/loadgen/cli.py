"""`prfaas bench serve` and `prfaas bench compare`: load testing against any OpenAI-compatible endpoint."""
from __future__ import annotations

import json
import logging
import math
import os
import sys
from pathlib import Path

logger = logging.getLogger(__name__)


def register(subparsers) -> None:
    parser = subparsers.add_parser("bench", help="load-test an OpenAI-compatible endpoint",
                                   description="Load testing against any OpenAI-compatible endpoint "
                                   "(PrfaaS router, vLLM, ...), with results comparable to `vllm bench serve`.")
    actions = parser.add_subparsers(dest="action", required=True, metavar="ACTION")
    serve = actions.add_parser("serve", help="run a benchmark against an endpoint",
                               description="Send a synthetic or replayed workload over streaming HTTP and "
                               "report TTFT, TPOT, ITL, E2E latency, throughput and goodput.")
    _add_target(serve)
    _add_workload(serve)
    _add_load(serve)
    _add_output(serve)
    serve.set_defaults(func=_serve)
    compare = actions.add_parser("compare", help="compare two result files (ratios B/A)")
    compare.add_argument("a", help="baseline result JSON")
    compare.add_argument("b", help="result JSON to compare with the baseline")
    compare.set_defaults(func=_compare)


def _add_target(parser) -> None:
    group = parser.add_argument_group("target")
    group.add_argument("--base-url", required=True, help="server root, e.g. http://127.0.0.1:8000 (a trailing /v1 "
                       "is accepted)")
    group.add_argument("--model", help="model name to send (default: the only model the server lists)")
    group.add_argument("--endpoint", choices=["completions", "chat"], default="completions",
                       help="/v1/completions or /v1/chat/completions (default: %(default)s)")
    group.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"),
                       help="bearer token (default: $OPENAI_API_KEY)")
    group.add_argument("--tokenizer", help="tokenizer directory or name used to build prompts (default: --model if "
                       "it is a local directory, else the embedded smollm2-135m-instruct)")
    group.add_argument("--timeout", type=float, default=600.0, help="per-request timeout in seconds (default: 600)")


def _add_workload(parser) -> None:
    group = parser.add_argument_group("workload")
    group.add_argument("--dataset", choices=["random", "lognormal", "shared-prefix", "multi-turn", "trace"],
                       default="random", help="prompt generator (default: %(default)s)")
    group.add_argument("--input-len", type=int, default=1024,
                       help="input tokens (random), suffix tokens (shared-prefix), question tokens (multi-turn)")
    group.add_argument("--output-len", type=int, default=128, help="max_tokens per request (default: 128)")
    group.add_argument("--range-ratio", type=float, default=0.0,
                       help="sample lengths uniformly in [L*(1-r), L*(1+r)] (default: 0, fixed)")
    group.add_argument("--length-scale", type=float, default=1.0,
                       help="scale lognormal and trace input lengths, e.g. 0.01 on a CPU machine")
    group.add_argument("--num-prefixes", type=int, default=4, help="shared-prefix: number of system prompts")
    group.add_argument("--prefix-len", type=int, default=512, help="shared-prefix: tokens per system prompt")
    group.add_argument("--num-turns", type=int, default=4, help="multi-turn: turns per conversation")
    group.add_argument("--trace", help="trace: JSONL with timestamp, input_length or prompt, output_length")
    group.add_argument("--ignore-eos", action="store_true",
                       help="send ignore_eos so every request generates --output-len tokens")
    group.add_argument("--temperature", type=float, help="sampling temperature (default: the server's)")
    group.add_argument("--seed", type=int, default=0, help="seed for prompts and arrivals (default: 0)")


def _add_load(parser) -> None:
    group = parser.add_argument_group("load")
    group.add_argument("--num-prompts", type=int, help="requests to send (default: 100 unless --duration)")
    group.add_argument("--duration", type=float, help="stop sending after this many seconds")
    group.add_argument("--warmup", type=int, default=0, help="requests sent first and not counted")
    group.add_argument("--request-rate", type=float, default=math.inf,
                       help="requests per second (default: inf, all at once)")
    group.add_argument("--burstiness", type=float, default=1.0,
                       help="gamma shape of inter-arrival gaps: 1.0 Poisson, <1 burstier (default: 1.0)")
    group.add_argument("--arrivals", choices=["poisson", "onoff"], default="poisson",
                       help="onoff: the rate only during --on-s periods, then --off-s idle")
    group.add_argument("--on-s", type=float, default=10.0, help="onoff: seconds on (default: 10)")
    group.add_argument("--off-s", type=float, default=10.0, help="onoff: seconds off (default: 10)")
    group.add_argument("--max-concurrency", type=int, help="at most this many requests in flight")
    group.add_argument("--slo", nargs="+", default=[], metavar="KEY=MS",
                       help="goodput SLOs: ttft_ms=2000 tpot_ms=50 e2el_ms=...")


def _add_output(parser) -> None:
    group = parser.add_argument_group("output")
    group.add_argument("--result-file", help="JSON result path (default: bench-results/<timestamp>.json)")
    group.add_argument("--plot", metavar="DIR", help="write latency_cdf.png and timeline.png into DIR")
    group.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    group.add_argument("--no-router-metrics", action="store_true", help="do not scrape the router's /metrics")
    group.add_argument("--fail-on-error", action="store_true",
                       help="exit 1 when the endpoint fails or any request fails or is rejected")
    group.add_argument("--log-level", choices=["debug", "info", "warning", "error"], default="warning")


def build_config(args):
    """The BenchConfig for parsed `bench serve` arguments (ConfigError on invalid values)."""
    from services.loadgen.config import BenchConfig, Slo, WorkloadConfig
    from services.loadgen.workloads import load_trace

    workload = WorkloadConfig(
        dataset=args.dataset, input_len=args.input_len, output_len=args.output_len, range_ratio=args.range_ratio,
        length_scale=args.length_scale, num_prefixes=args.num_prefixes, prefix_len=args.prefix_len,
        num_turns=args.num_turns, trace_path=args.trace)
    if workload.dataset == "trace":
        load_trace(Path(workload.trace_path))
    num_prompts = args.num_prompts if args.num_prompts is not None or args.duration else 100
    return BenchConfig(
        base_url=args.base_url, model=args.model, endpoint=args.endpoint, api_key=args.api_key,
        tokenizer=args.tokenizer, workload=workload, num_prompts=num_prompts, duration_s=args.duration,
        warmup=args.warmup, request_rate=args.request_rate, burstiness=args.burstiness, arrivals=args.arrivals,
        on_s=args.on_s, off_s=args.off_s, max_concurrency=args.max_concurrency, ignore_eos=args.ignore_eos,
        temperature=args.temperature, seed=args.seed, slo=Slo.parse(args.slo), timeout_s=args.timeout,
        scrape_router=not args.no_router_metrics)


def _serve(args) -> int:
    from services.loadgen.config import ConfigError
    from services.loadgen.report import default_result_path, summary_table, write_result

    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    try:
        config = build_config(args)
    except ConfigError as exc:
        print(f"prfaas bench serve: error: {exc}", file=sys.stderr)
        return 2
    result = _run(config, progress_enabled=not args.no_progress)
    if result["fatal_error"]:
        print(f"prfaas bench serve: {result['fatal_error']}", file=sys.stderr)
    else:
        print(summary_table(result))
        _explain_errors(result)
    path = write_result(result, Path(args.result_file) if args.result_file else default_result_path())
    print(f"results written to {path}", file=sys.stderr)
    if args.plot and result["completed"]:
        from services.loadgen.plots import write_plots

        for plot in write_plots(result, Path(args.plot)):
            print(f"plot written to {plot}", file=sys.stderr)
    failed = result["fatal_error"] or result["failed"] or result["rejected"]
    return 1 if args.fail_on_error and failed else 0


def _run(config, progress_enabled: bool) -> dict:
    import asyncio
    import signal

    from services.loadgen.progress import Progress
    from services.loadgen.runner import run_benchmark

    async def main() -> dict:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGINT, stop.set)
        try:
            progress = Progress(config.num_prompts, config.duration_s, enabled=progress_enabled)
            return await run_benchmark(config, progress, stop)
        finally:
            loop.remove_signal_handler(signal.SIGINT)

    try:
        import uvloop
    except ImportError:
        return asyncio.run(main())
    return uvloop.run(main())


def _explain_errors(result: dict) -> None:
    if result.get("interrupted"):
        print("interrupted: partial results", file=sys.stderr)
    first_error = next((e for e in result["errors"] if e), None)
    if first_error:
        print(f"{result['failed']} failed and {result['rejected']} rejected requests; first error: {first_error}",
              file=sys.stderr)
    if result["usage_mismatches"]:
        print(f"{result['usage_mismatches']} requests streamed a different number of chunks than usage reported "
              "(several tokens per chunk?)", file=sys.stderr)


def _compare(args) -> int:
    from services.loadgen.report import compare_table

    results = []
    for path in (args.a, args.b):
        try:
            results.append(json.loads(Path(path).read_text()))
        except (OSError, json.JSONDecodeError) as exc:
            print(f"prfaas bench compare: error: {path}: {exc}", file=sys.stderr)
            return 2
    print(compare_table(*results, a_name=Path(args.a).stem, b_name=Path(args.b).stem))
    return 0
