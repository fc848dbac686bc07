"""`prfaas simulate`: discrete-event simulation of PrfaaS-PD and its baselines under load."""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from pathlib import Path

POLICY_CHOICES = ("all", "homogeneous", "naive", "static", "adaptive")


def register(subparsers) -> None:
    from services.planner.cli import DEFAULT_CONFIG

    parser = subparsers.add_parser(
        "simulate",
        help="simulate a PrfaaS deployment under load (TTFT, throughput, queues)",
        description="Discrete-event simulation of the planner's deployment: arrivals, PrfaaS and local "
        "prefill queues, the cross-cluster link (optionally following a bandwidth trace) and decode "
        "batch slots, for the homogeneous, naive, static-threshold and adaptive-threshold policies. Each "
        "request is routed by the router's own placement policy (choose_route). The adaptive policy runs the "
        "router's threshold controller (CongestionAwareThreshold) fed from the simulated link, with the "
        "planner's model re-optimising its base threshold.",
    )
    from services.planner.cli import add_measured_arguments

    parser.add_argument("--config", default=str(DEFAULT_CONFIG),
                        help="planner input YAML (default: deploy/planner/case_study.yaml)")
    add_measured_arguments(parser)
    parser.add_argument("--policy", choices=POLICY_CHOICES, default="all", help="which policy (default: all)")
    load = parser.add_mutually_exclusive_group()
    load.add_argument("--rate", type=float,
                      help="offered load in requests/s (default with --workload: its measured rate)")
    load.add_argument("--load-factor", type=float,
                      help="offered load as a fraction of the planner's PrfaaS-PD Lambda_max (default 0.9)")
    parser.add_argument("--requests", type=int, default=50_000, help="requests to simulate (default: %(default)s)")
    parser.add_argument("--replay", action="store_true",
                        help="with --workload: replay its requests exactly (each arrival time and prompt length) "
                        "instead of drawing from the fitted distribution; --requests, --rate, --load-factor and "
                        "--arrivals do not apply (to compare a prediction with the run that recorded the workload)")
    parser.add_argument("--arrivals", choices=("poisson", "onoff", "mmpp"),
                        help="arrival process, all at the same mean rate (default: poisson; with --workload the "
                        "process fitted to its inter-arrival CV). Bursty: 'onoff' alternates on periods at 2x the "
                        "rate with silent off periods; 'mmpp' alternates 1.6x and 0.4x the rate; state lengths "
                        "are exponential with mean --burst-seconds")
    parser.add_argument("--burst-seconds", type=float,
                        help="mean length of each on/off or MMPP state (default: 30; with --workload the fitted one)")
    parser.add_argument("--bandwidth-trace", metavar="TRACE",
                        help='link bandwidth steps "TIME:GBPS,..." or a file of them; TIME may be "33%%" of the run')
    parser.add_argument("--mean-length-mode", action="store_true",
                        help="every request of a class uses its class mean length, as the planner assumes")
    parser.add_argument("--threshold", type=float, metavar="TOKENS",
                        help="the static policy's offload threshold, as "
                        "scheduler.offload_threshold_tokens of a deployment (default: the planner's t)")
    parser.add_argument("--seed", type=int, default=0, help="random seed (default: %(default)s)")
    slo = parser.add_mutually_exclusive_group()
    slo.add_argument("--ttft-slo", type=float, metavar="SECONDS", help="absolute TTFT SLO")
    slo.add_argument("--slo-factor", type=float, default=2.0,
                     help="TTFT SLO as a multiple of each request's no-queue TTFT (default: %(default)s)")
    parser.add_argument("--headroom", type=float, default=0.75,
                        help="adaptive: fraction of the link's bandwidth the re-optimised base threshold may "
                        "fill (default: %(default)s)")
    parser.add_argument("--observe-interval", type=float, default=1.0,
                        help="adaptive: seconds between the link samples fed to the router's threshold "
                        "controller (default: %(default)s)")
    parser.add_argument("--reoptimize-interval", type=float, default=300.0,
                        help="adaptive: seconds between re-optimisations of the base threshold with the "
                        "planner's model at the current bandwidth and measured arrival rate (default: %(default)s)")
    _add_runtime_arguments(parser)
    parser.add_argument("--compare-mean-length", action="store_true",
                        help="also report how much the mean-length simplification overstates capacity")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    parser.add_argument("--plot", metavar="DIR", help="write queues.png (queue lengths over time) into DIR")
    parser.set_defaults(func=_run)


def _add_runtime_arguments(parser) -> None:
    from services.simulator.runtime import RuntimeModel

    default = RuntimeModel()
    group = parser.add_argument_group(
        "runtime model", "What the runtime does and the paper's closed form ignores. Each flag overrides the "
        "same key of the config's simulation: section; the defaults leave the closed form's assumptions.")
    group.add_argument("--chunk-tokens", type=int, metavar="TOKENS",
                       help="the engine's token budget per step (max_num_batched_tokens): prefills run in steps "
                       "formed as vLLM's scheduler does (running requests first, then queued ones while budget "
                       "is left), each piece priced from the latency curve; 0: whole requests "
                       f"(default: {default.chunk_tokens})")
    group.add_argument("--link-rtt-ms", type=float, metavar="MS",
                       help="cross-cluster round trip: KV lands half of it after its last byte is sent, and "
                       f"each connection carries at most its window per round trip (default: {default.link_rtt_ms:g})")
    group.add_argument("--connections", type=int, metavar="N",
                       help="TCP connections per transfer, as the KV transport's connections_per_peer "
                       f"(default: {default.connections})")
    group.add_argument("--connection-window-bytes", type=int, metavar="BYTES",
                       help="bytes one connection keeps in flight; with a round trip, a transfer goes at most "
                       "connections x window / RTT; 0: unbounded (default: "
                       f"{default.connection_window_bytes}, Linux's 4 MiB tcp_wmem maximum less the transport's "
                       "1 MiB notsent_lowat_bytes)")
    group.add_argument("--layerwise", action=argparse.BooleanOptionalAction, default=None,
                       help="stream each layer's KV while later layers compute, so only the transfer time beyond "
                       "the prefill is exposed (default: off, KV sent after the prefill)")
    group.add_argument("--pool-load-gbps", type=float, metavar="GBPS",
                       help="how fast a prefill instance loads a cache-pool hit (workload.prefix_hit), "
                       "asynchronously while it computes other requests; 0: loads take no time "
                       f"(default: {default.pool_load_gbps:g})")
    group.add_argument("--per-instance", action=argparse.BooleanOptionalAction, default=None,
                       help="route to one instance as the router does (choose_route over a view of every worker "
                       "with its load: least-loaded decode worker first, then the cache-affine prefill worker, which "
                       "with no prompt identities is the least loaded) and queue at each instance (default: off, one "
                       "view per role and a FIFO queue per cluster)")
    group.add_argument("--local-both", type=int, metavar="N",
                       help="replace the local PD cluster's prefill/decode split with N colocated 'both' workers, "
                       "each one engine that prefills local-path requests and decodes every path (a step costs its "
                       "prefill pieces plus one decode step); implies --per-instance (default: 0, the split)")
    group.add_argument("--colocated-interference", type=float, metavar="X",
                       help="with --local-both on the PrfaaS engines' host (CPU engines sharing one memory system): "
                       "while a share s of the colocated workers decode, the PrfaaS prefill computes at 1 / (1 + X s) "
                       f"of the profile's speed; 0: hosts of their own (default: {default.colocated_interference:g})")
    group.add_argument("--send-cpu-ms-per-mib", type=float, metavar="MS",
                       help="what a PrfaaS prefill instance loses per MiB of KV it sends, taken from the compute "
                       "of the prefill that starts as the send does (its own with --layerwise, else the next "
                       "queued): CPU engines whose sender shares their cores (the router's "
                       "prfaas_kv_link_send_cpu_seconds over prfaas_kv_link_sent_bytes); 0: the sender has cores "
                       f"of its own, or the profile already holds it (default: {default.send_cpu_ms_per_mib:g})")
    group.add_argument("--admission", action=argparse.BooleanOptionalAction, default=None,
                       help="the router's admission control judges each routed request (capacity and, with "
                       "--admission-ttft-slo, the predicted TTFT); rejected requests are counted and enter no "
                       "queue (default: off, every request admitted)")
    group.add_argument("--max-in-flight", type=int, metavar="N",
                       help="admission capacity, as the router's max_in_flight_requests; 0: max_batch_size per "
                       f"generating instance (default: {default.max_in_flight})")
    group.add_argument("--admission-ttft-slo", type=float, metavar="SECONDS", dest="admission_ttft_slo_s",
                       help="reject a request whose predicted TTFT (its path's queued prompt tokens and its own, "
                       f"over the path's measured prefill rate) exceeds this; 0: no TTFT check "
                       f"(default: {default.admission_ttft_slo_s:g})")


RUNTIME_FLAGS = ("chunk_tokens", "link_rtt_ms", "connections", "connection_window_bytes", "layerwise",
                 "pool_load_gbps", "per_instance", "local_both", "colocated_interference", "send_cpu_ms_per_mib",
                 "admission", "max_in_flight", "admission_ttft_slo_s")


def _runtime(args, inputs):
    """The config's simulation: section with the command line's runtime flags on top."""
    from services.simulator.runtime import parse_runtime

    return parse_runtime(inputs.simulation).with_overrides({key: getattr(args, key) for key in RUNTIME_FLAGS})


def _run(args) -> int:
    from services.planner.cli import load_measured_inputs
    from services.planner.inputs import PlanInputError
    from services.planner.report import run_plan
    from services.simulator.bandwidth import TraceError, parse_trace
    from services.simulator.measured import fill_arrivals, offered_rate
    from services.simulator.runtime import RuntimeInputError

    problem = _check_args(args)
    if problem:
        return _fail(problem)
    try:
        inputs, measured = load_measured_inputs(args)
        runtime = _runtime(args, inputs)
    except (PlanInputError, RuntimeInputError) as exc:
        return _fail(str(exc))
    plan = run_plan(inputs)
    try:
        replay = _replay(args)
    except PlanInputError as exc:
        return _fail(str(exc))
    if replay:
        args.requests, args.rate = len(replay), len(replay) / max(replay[-1][0], 1e-9)
    rate = offered_rate(args, measured, plan.prfaas.lambda_max)
    fill_arrivals(args, measured)
    try:
        trace = parse_trace(args.bandwidth_trace, args.requests / rate) if args.bandwidth_trace else ()
    except (TraceError, OSError) as exc:
        return _fail(str(exc))
    if args.plot:
        from services.planner.plots import MatplotlibMissing, import_pyplot

        try:
            import_pyplot()
        except MatplotlibMissing as exc:
            return _fail(str(exc))
    try:
        results = _simulate_all(args, inputs, plan, rate, trace, runtime, replay)
    except ValueError as exc:
        return _fail(str(exc))
    out = {**measured, "planner": {"threshold_tokens": plan.prfaas.threshold_tokens, "n_p": plan.prfaas.num_prefill,
                       "n_d": plan.prfaas.num_decode, "lambda_max": plan.prfaas.lambda_max},
           "offered_rate": rate, "load_factor": rate / plan.prfaas.lambda_max,
           "arrivals": "replayed" if replay else args.arrivals, "mean_length_mode": args.mean_length_mode,
           "bandwidth_trace": [list(p) for p in trace], "runtime": asdict(runtime),
           "policies": {r.policy: r.summary() for r in results}}
    if args.compare_mean_length:
        from services.simulator.capacity import mean_length_overstatement

        out["mean_length_overstatement"] = mean_length_overstatement(inputs, plan, args.requests, args.seed)
    if args.plot:
        from services.simulator.plots import write_queue_plot

        out["plots"] = [write_queue_plot(results, Path(args.plot), trace)]
    print(json.dumps(out, indent=2) if args.json else _format(out))
    return 0


def _replay(args) -> tuple[tuple[float, float], ...]:
    """``--replay``: the workload file's requests as (arrival s, prompt tokens)."""
    if not args.replay:
        return ()
    from services.planner.measured_workload import read_sample

    _, sample = read_sample(args.workload)
    return tuple(zip(sample.arrival_times_s, map(float, sample.input_lengths)))


def _simulate_all(args, inputs, plan, rate, trace, runtime, replay=()):
    from services.simulator.engine import simulate
    from services.simulator.setup import POLICIES, RunSpec, make_controller, topology_for, workload_of

    policies = POLICIES if args.policy == "all" else (args.policy,)
    results = []
    for policy in policies:
        spec = RunSpec(policy, topology_for(policy, inputs, plan), workload_of(inputs), rate, args.requests,
                       plan.prfaas.threshold_tokens if args.threshold is None else args.threshold,
                       arrivals=args.arrivals, burst_seconds=args.burst_seconds,
                       bandwidth_trace=trace, mean_length_mode=args.mean_length_mode, seed=args.seed,
                       ttft_slo_s=args.ttft_slo, slo_factor=args.slo_factor,
                       observe_interval_s=args.observe_interval,
                       reoptimize_interval_s=args.reoptimize_interval, progress=args.requests >= 200_000,
                       runtime=runtime, replay=replay)
        controller = make_controller(inputs, plan, headroom=args.headroom) if policy == "adaptive" else None
        results.append(simulate(spec, controller))
    return results


def _check_args(args) -> str | None:
    checks = [(args.requests >= 1, "--requests: must be at least 1"),
              (args.threshold is None or args.threshold >= 0, "--threshold: must not be negative"),
              (not args.replay or args.workload, "--replay: needs --workload FILE, whose requests it replays"),
              (not args.replay or (args.rate is None and args.load_factor is None and args.arrivals is None),
               "--replay: the workload's own arrivals are replayed; drop --rate, --load-factor and --arrivals"),
              (args.rate is None or args.rate > 0, "--rate: must be positive"),
              (args.load_factor is None or args.load_factor > 0, "--load-factor: must be positive"),
              (args.burst_seconds is None or args.burst_seconds > 0, "--burst-seconds: must be positive"),
              (args.ttft_slo is None or args.ttft_slo > 0, "--ttft-slo: must be positive"),
              (args.slo_factor > 0, "--slo-factor: must be positive"),
              (0 < args.headroom <= 1, "--headroom: must be in (0, 1]"),
              (args.observe_interval > 0, "--observe-interval: must be positive"),
              (args.reoptimize_interval > 0, "--reoptimize-interval: must be positive"),
              (args.chunk_tokens is None or args.chunk_tokens >= 0, "--chunk-tokens: must be 0 or positive"),
              (args.link_rtt_ms is None or args.link_rtt_ms >= 0, "--link-rtt-ms: must not be negative"),
              (args.connections is None or args.connections >= 1, "--connections: must be at least 1"),
              (args.connection_window_bytes is None or args.connection_window_bytes >= 0,
               "--connection-window-bytes: must be 0 or positive"),
              (args.pool_load_gbps is None or args.pool_load_gbps >= 0, "--pool-load-gbps: must be 0 or positive"),
              (args.local_both is None or args.local_both >= 0, "--local-both: must be 0 or positive"),
              (args.max_in_flight is None or args.max_in_flight >= 0, "--max-in-flight: must be 0 or positive"),
              (args.admission_ttft_slo_s is None or args.admission_ttft_slo_s >= 0,
               "--admission-ttft-slo: must be 0 or positive")]
    return next((message for ok, message in checks if not ok), None)


def _format(out: dict) -> str:
    from services.simulator.capacity import format_overstatement
    from services.simulator.measured import measured_lines
    from services.simulator.results import format_table

    p = out["planner"]
    lines = [*measured_lines(out),
             f"planner: t = {p['threshold_tokens']:,.0f} tokens, N_p = {p['n_p']}, N_d = {p['n_d']}, "
             f"Lambda_max = {p['lambda_max']:.3f} req/s",
             f"offered: {out['offered_rate']:.3f} req/s ({out['load_factor']:.0%} of Lambda_max), "
             f"{out['arrivals']} arrivals, {'mean-length' if out['mean_length_mode'] else 'sampled'} lengths"
             + (f", bandwidth trace {out['bandwidth_trace']}" if out["bandwidth_trace"] else ""),
             f"runtime: {_describe_runtime(out['runtime'])}",
             "", format_table(list(out["policies"].values()))]
    adaptive = out["policies"].get("adaptive", {}).get("threshold_range_tokens")
    if adaptive:
        lines.append(f"adaptive threshold ranged {adaptive[0]:,.0f} .. {adaptive[1]:,.0f} tokens")
    if "mean_length_overstatement" in out:
        lines += ["", format_overstatement(out["mean_length_overstatement"])]
    if "plots" in out:
        lines += ["", "plots: " + ", ".join(out["plots"])]
    return "\n".join(lines)


def _describe_runtime(runtime: dict) -> str:
    prefill = f"chunks of {runtime['chunk_tokens']:,} tokens" if runtime["chunk_tokens"] else "whole-request prefill"
    link = (f"{runtime['link_rtt_ms']:g} ms RTT, {runtime['connections']} connections x "
            f"{runtime['connection_window_bytes']:,} B window" if runtime["link_rtt_ms"] else "no link RTT")
    send = "layer-wise KV streaming" if runtime["layerwise"] else "KV sent after prefill"
    load = f"pool loads at {runtime['pool_load_gbps']:g} Gbps" if runtime["pool_load_gbps"] else "pool loads free"
    return ", ".join((prefill, link, send, load, _describe_dispatch(runtime)))


def _describe_dispatch(runtime: dict) -> str:
    if runtime["local_both"]:
        dispatch = f"{runtime['local_both']} colocated 'both' workers, per-instance dispatch"
    else:
        dispatch = "per-instance dispatch" if runtime["per_instance"] else "per-cluster queues"
    if not runtime["admission"]:
        return dispatch + ", no admission control"
    slo = runtime["admission_ttft_slo_s"]
    return (dispatch + f", admission control (capacity {runtime['max_in_flight'] or 'max_batch_size per instance'}"
            + (f", TTFT SLO {slo:g} s)" if slo else ")"))


def _fail(message: str) -> int:
    print(f"prfaas simulate: error: {message}", file=sys.stderr)
    return 2
