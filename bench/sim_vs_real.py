"""The simulator's prediction against the running system, at three loads.

The embedded default (deploy/local.yaml: the router, ``prefill-0`` in the PrfaaS cluster on CPU 0,
``decode-0`` with role ``both`` on CPU 1, the embedded SmolLM2), with ``prefill-0`` in a network
namespace made here behind a link capped at 1 Gbit/s both ways (``tbf`` on a veth pair; with
``--rtt-ms`` a userspace delay line adds a round trip, tests/support/wan.py, and takes CPU the engines
need on a small machine). Steps:

1. ``prfaas profile`` measures the engine as ``decode-0`` runs it, in this run (the machine's speed
   drifts; a rerun into the same ``--out`` resumes its points; prompts without prefix hits, as the
   load generator sends), and the planner's inputs are built from that profile: one PrfaaS prefill
   instance and one colocated worker that decodes as many requests as vLLM schedules
   (``max_num_seqs``), each step priced by its batch (the profile's decode points at the workload's
   mean context), the link's capacity and round trip, the engine's token budget, the KV streamed layer
   by layer while the prefill computes (what this deployment does, measured: see ``runtime_model``),
   the deployment's threshold.
2. The knee: the simulator's capacity for the load generator's prompt-length distribution. Then a first
   figure of the CPU per request that the engines' cores spend outside the engines (the router, the load
   generator, the workers' front ends, the kernel's network work for them), from two light loads (0.13x
   and 0.4x the knee, 30 s each or long enough for the higher one to send 45 requests;
   ``--calibration-seconds`` sets it) after an unmeasured 15 s at the higher one (the processes'
   first-request work): on this machine those processes share the engines' cores, and the simulator
   slows the engines by the share they take at each load (``simulation.host_cpu_s_per_request``; the
   engines' own processes are what the profile measured). The same two loads measure the PrfaaS prefill
   worker's speed (``_prfaas_speed.py``): the profile is ``decode-0``'s engine, and ``prefill-0`` ran
   1.03 to 1.10x its latency in three full runs here (its KV sender's CPU included), which near the knee
   moves mean TTFT by more than its tolerance. The factor on the PrfaaS instance's latency curve at
   which the simulator, replaying those requests, gives their offloaded requests' measured mean TTFT is
   applied from then on, and the knee predicted again with it: the loads below are shares of that knee.
   Both knees and the factor are printed. Before that factor is fitted, long prompts sent alone and
   beside short ones decoding on ``decode-0`` measure how much the colocated worker's decoding slows the
   PrfaaS prefill (the engines share the host's memory system; ``_interference.py``), which the
   simulator charges (``simulation.colocated_interference``), and the knee becomes the rate at which the
   capacity simulated at that rate equals it. Long prompts sent back to back check the transfer model: a
   prefill queued behind another should cost what one alone does (printed, not charged). The KV sender's
   own CPU is part of every prefill's time, so the speed factor holds it; ``prefill-0``'s telemetry
   (``prfaas_kv_link_send_cpu_seconds``) gives what its sender threads used per MiB over the calibration
   loads, printed and recorded (``sender_threads_cpu_ms_per_mib``).
3. At each load (a share of the knee: light, near it, past it) the project's load generator
   (``prfaas bench serve``) runs the real system for ``--seconds`` (or ``--min-requests``) with
   Poisson arrivals and prompts no earlier load sent (none finds a prefix cached), and the
   simulator replays the very requests it sent (``prfaas simulate --replay``: each arrival time and
   prompt length). Below the knee, a load runs again with new prompts while the 95% interval of the
   prediction's error in throughput or mean TTFT is wider than half its tolerance, ``--max-runs``
   runs at most (``_sim_rows.py``: the intervals, pooled request by request). Past the knee that
   request-by-request interval says little (the requests done inside the window are the earliest to
   arrive), so the overload point runs independent replications of half ``--seconds`` each, and its
   throughput's interval is Student's t over their errors: ``--overload-runs`` of them, then more while
   that interval is wider than half its tolerance, ``--max-overload-runs`` in all at most.
4. The CPU outside the engines is read around every load, and the figure per request fitted over all
   of them (``_host_cpu.py``: CPU = c + a x seconds + b x requests; bounded by what the project's own
   processes spent); the simulator replays every load again with it. The two light loads alone
   differ by too few requests to tell a request's CPU from the services' idle polling. Both figures,
   the one used and why, are printed.

Compared: throughput (completions per second over the arrival window after its first 10%, as the
simulator counts it), the offloaded fraction (the router's counters against the simulator's
routing), mean TTFT, and whether the queue grows (requests waiting for their first token, late in
the window against early: the same function on both sides). Targets: throughput and offloaded
fraction within 10% at every load, mean TTFT within 25% at the two lower loads, a growing queue on
both sides at the overload point. The table prints each error with its interval. Writes
``<out>/sim_vs_real.json`` and ``<out>/sim_vs_real.png``, ``<out>`` by default
``bench/results/sim_vs_real-<time>``. Needs root (namespaces).

    python bench/sim_vs_real.py                     # 120 s per load, 6 to 10 runs of 60 s past the knee
    python bench/sim_vs_real.py --seconds 60 --loads 0.3,0.7,1.5
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path

import yaml

import _common  # noqa: F401  (puts the project and tests/support on sys.path)
import _host_cpu
import _interference
import _prfaas_speed
from _common import results_dir
from _sim_rows import (TARGETS, PerRequest, Segment, compare, enough_runs, plot, pooled_row, table, tested,
                       too_wide)
from support.deployment import Deployment, deployment_config
from support.netns import available, veth_link
from support.ports import free_port
from support.wan import wan_path

LINK_MBIT = 1000.0
THRESHOLD = 256                 # scheduler.offload_threshold_tokens of the embedded default
OUTPUT_TOKENS = 16
LENGTH_SCALE = 0.015            # the paper's log-normal x 0.015: median ~300 tokens, at most 1,966
# Shares of the predicted knee: light, near it, past it. Near it is 0.7x, not closer: at 0.8x the
# PrfaaS prefill worker runs at ~88% utilization, where the real system's own mean TTFT varied from
# 2.1 to 3.7 s over five runs with the very same arrivals (a few percent of capacity moves it that
# much), more than the 25% the prediction is held to.
LOADS = (0.35, 0.7, 1.5)
WARMUP_REQUESTS = 4
# Shares of the predicted knee while the CPU taken from the engines' cores per request is measured: light
# enough that no queue builds (the machine's speed sets the knee: 3.8 req/s on an AVX-512 host, ~0.6 on AVX2).
CALIBRATION_SHARES = (0.13, 0.4)
CALIBRATION_REQUESTS = 45       # at the higher calibration load, at least: its length follows from the knee
WARMUP_SECONDS = 15             # an unmeasured load at the higher calibration rate before the two measured ones
KNEE_REQUESTS = 20_000
KNEE_ITERATIONS = 6             # the knee's fixed point with interference: damped steps at most
KNEE_TOLERANCE = 0.005
# Every load sends prompts of its own (seed + its index; the calibration's from seed + 100): a prompt sent
# before would find its KV in the engines' prefix caches, which on a slow machine hold a whole light load.
CALIBRATION_SEED = 100
SEGMENT_SEED = 1000             # a load's later runs: seed + its index + this x the run's number
# Independent runs at the overload point. Its throughput's interval cannot come from one run: past the knee
# the requests done inside the window are the earliest to arrive, so the request-by-request bootstrap
# resamples a step (measured: +-9% at 355 requests, and no narrower over four runs pooled). Four runs with
# the same arrivals erred by +1.2, -2.3, +2.2 and +2.4% (sd 2.2%); six give Student's t about +-3%. With
# prompts of their own and the machine's speed drifting, six runs scattered by 4% and 6% in two full runs
# (+-4.4% and +-6.1%): at 6%, nine runs are needed for +-5%, so the point runs on while it is wider.
OVERLOAD_RUNS = 6
MAX_OVERLOAD_RUNS = 10


def make_config() -> dict:
    """deploy/local.yaml's topology with free ports and ``prefill-0`` reachable in the namespace."""
    from _common import ROOT

    embedded = yaml.safe_load((ROOT / "deploy" / "local.yaml").read_text())
    workers = [{key: value for key, value in w.items() if key not in ("port", "kv_port")} for w in embedded["workers"]]
    for worker in workers:
        if worker.get("service") == "decode_worker":
            worker["kv_port"] = free_port()
    return deployment_config(workers, router={"stats_interval_s": 0.5},
                             scheduler={"offload_threshold_tokens": THRESHOLD},
                             transport=embedded.get("transport", {}), engine=embedded.get("engine", {}))


def place_prefill(config: dict, link) -> None:
    for worker in config["workers"]:
        worker["host"] = link.ns_addr if worker["service"] == "prefill_worker" else link.host_addr


# --- the prediction -----------------------------------------------------------------------------------

def profile(config_path: Path, out: Path, quick: bool = False, shared_cache: bool = False) -> Path:
    """``prfaas profile`` of the colocated worker's engine, measured in this run: its points are cached
    in ``out`` (a rerun into the same directory resumes), not in the shared point cache, unless
    ``shared_cache``. The baseline belongs to the run it predicts: this machine's speed drifts, and a
    profile cached hours before measured prefills 3-8% faster than the engine then ran."""
    path = out / "profile.yaml"
    cache = [] if shared_cache else ["--cache-dir", str(out / "profile-points")]
    print("sim_vs_real: profiling the engine (prfaas profile) ...", flush=True)
    # No prefix hits: the load generator's prompts share none (a quarter of the full grid's prefills).
    subprocess.run([sys.executable, "-m", "services.cli", "profile", "--config", str(config_path), "--worker",
                    "decode-0", "--output", str(path), "--hit-ratios", "0", *cache, *(["--quick"] if quick else [])],
                   check=True)
    return path


def planner_inputs(profile_path: Path):
    """The planner's inputs for this deployment: one PrfaaS prefill instance and one local instance
    (made a colocated worker by the runtime model), the measured profile for both, the link."""
    from services.planner.inputs import parse_plan_inputs
    from services.planner.measured_profile import apply_profiles, load_profile

    placeholder = {"lengths": [128, 1024], "latency_s": [0.1, 1.0], "kv_size_mib": [1.0, 8.0]}  # replaced below
    raw = {"model": "smollm2-135m-instruct", "gpus_per_instance": 1,
           "workload": {"input_length": lognormal_spec(), "output_tokens": OUTPUT_TOKENS,
                        "slo_tokens_per_second": 20},
           "profiles": {"prefill": placeholder,
                        "decode": {"max_batch_size": 8, "step_time_s": 0.05}},
           "deployments": {"prfaas_pd": {"prfaas_instances": {"profile": "prefill", "count": 1},
                                         "local_pd_instances": {"prefill_profile": "prefill",
                                                                "decode_profile": "decode", "count": 2},
                                         "cross_cluster_gbps": LINK_MBIT / 1000}}}
    measured = load_profile(profile_path)
    inputs, _ = apply_profiles(parse_plan_inputs(raw), [(None, measured)])
    # The colocated worker decodes as many requests as vLLM schedules (max_num_seqs), each step priced by
    # the batch it runs, not at most the batch that meets the profile's TPOT target.
    decode = {name: replace(profile, max_batch_size=measured.engine.get("max_num_seqs", profile.max_batch_size))
              for name, profile in inputs.decode_profiles.items()}
    return replace(inputs, decode_profiles=decode, simulation={
        **(inputs.simulation or {}), "decode_step_s_by_batch": decode_steps(profile_path, inputs)})


def decode_steps(profile_path: Path, inputs) -> list[list[float]]:
    """The colocated worker's decode step time by batch size at the workload's mean context (its mean
    prompt and half its output), from the profile's decode points."""
    from services.planner.distribution import TruncatedLogNormal
    from services.planner.measured_profile import decode_step_curve

    lengths = TruncatedLogNormal.from_spec(inputs.workload.input_length)
    context = lengths.partial_mean(lengths.lo, lengths.hi) + OUTPUT_TOKENS / 2
    points = yaml.safe_load(profile_path.read_text())["decode"]["points"]
    return [list(point) for point in decode_step_curve(points, context)]


def lognormal_spec() -> dict:
    """The load generator's lognormal dataset (services/loadgen/config.py defaults) scaled by LENGTH_SCALE."""
    import math

    from services.loadgen.config import WorkloadConfig

    w = WorkloadConfig()
    return {"distribution": "truncated_lognormal", "mu": w.lognormal_mu + math.log(LENGTH_SCALE),
            "sigma": w.lognormal_sigma, "min_tokens": w.lognormal_min * LENGTH_SCALE,
            "max_tokens": w.lognormal_max * LENGTH_SCALE}


def runtime_model(inputs, rtt_ms: float, host_cpu_s: float = 0.0):
    from services.simulator.runtime import parse_runtime

    # layer-wise: measured here with prefill-0's debug log, a request's KV reaches decode-0 within
    # milliseconds of its prefill's end, alone or queued behind another (its layers leave while later ones
    # compute, the sender threads taking under 1 ms of the engine's core per MiB), and a prefill queued
    # behind another costs what one alone does (``_interference``'s back-to-back check).
    return parse_runtime(inputs.simulation).with_overrides(
        {"link_rtt_ms": rtt_ms, "layerwise": True, "local_both": 1, "per_instance": True,
         "host_cpu_s_per_request": host_cpu_s, "host_cores": len(os.sched_getaffinity(0))})


def run_spec(inputs, rtt_ms: float, rate: float, num_requests: int, replay=(), seed: int = 0,
             host_cpu_s: float = 0.0):
    from services.planner.report import run_plan
    from services.simulator.setup import RunSpec, topology_for, workload_of

    plan = run_plan(inputs)
    return RunSpec("static", topology_for("static", inputs, plan), workload_of(inputs), rate, num_requests,
                   THRESHOLD, seed=seed, runtime=runtime_model(inputs, rtt_ms, host_cpu_s), replay=tuple(replay))


def predicted_knee(inputs, rtt_ms: float, seed: int) -> float:
    """The simulator's capacity (utilization law over its resources) for the workload's distribution,
    engines on cores of their own. With interference the PrfaaS prefill's busy time grows with the rate
    (the colocated worker decodes more, or the sender's CPU comes out of its compute when prefills queue):
    the knee is then the rate at which the capacity simulated at that rate equals it, found by damped
    steps from the capacity at a light rate."""
    from services.simulator.engine import simulate

    knee = simulate(run_spec(inputs, rtt_ms, 0.2, KNEE_REQUESTS, seed=seed)).capacity()
    simulation = inputs.simulation or {}
    if not (simulation.get("colocated_interference") or simulation.get("send_cpu_ms_per_mib")):
        return knee
    for _ in range(KNEE_ITERATIONS):
        again = simulate(run_spec(inputs, rtt_ms, knee, KNEE_REQUESTS, seed=seed)).capacity()
        if abs(again - knee) <= KNEE_TOLERANCE * knee:
            return again
        knee = (knee + again) / 2
    return knee


def with_interference(inputs, measured: _interference.Interference):
    """``inputs`` whose simulation slows the PrfaaS prefill while the colocated worker decodes, as measured."""
    return replace(inputs, simulation={**(inputs.simulation or {}), "colocated_interference": measured.colocated})


def interference(deployment: Deployment, inputs, rtt_ms: float, pairs: int) -> _interference.Interference:
    """What slows the PrfaaS prefill worker beyond its profile, measured on the deployment
    (``_interference``): the exposed KV transfer and the decode steps it subtracts come from the profile and
    the link."""
    import math

    from services.planner.profiles import PiecewiseLinear
    from services.simulator.runtime import exposed_transfer_s

    spec = run_spec(inputs, rtt_ms, 0.2, 1)
    topo, tokens = spec.topology, _interference.PROMPT_TOKENS
    kv_bytes = topo.prfaas_kv_bytes(tokens)
    prefill = topo.prfaas_latency(tokens)
    exposed = exposed_transfer_s(kv_bytes / spec.runtime.link_bytes_per_s(topo.link_gbps), prefill)
    curve = inputs.simulation["decode_step_s_by_batch"]
    step = PiecewiseLinear(tuple(float(b) for b, _ in curve), tuple(float(t) for _, t in curve))
    alone = prefill + exposed + step(1)
    decode_tokens = math.ceil(_interference.OUTLAST * alone / step(_interference.BACKGROUND))
    return _interference.fit(*_interference.measure(deployment.base_url, decode_tokens, pairs), exposed, kv_bytes,
                             step)


def predict(inputs, rtt_ms: float, replay, host_cpu_s: float) -> tuple[dict, PerRequest]:
    """The simulator's figures for the replayed requests, and per request (in replay order) its TTFT
    and whether it completed inside the throughput window."""
    from services.simulator.engine import simulate

    rate = len(replay) / max(replay[-1][0], 1e-9)
    result = simulate(run_spec(inputs, rtt_ms, rate, len(replay), replay, host_cpu_s=host_cpu_s))
    summary = result.summary()
    ttfts, arrivals = list(result.ttfts), list(result.arrivals)
    predicted = {"throughput": summary["throughput"], "offloaded_fraction": summary["offloaded_fraction"],
                 "ttft_mean": statistics.fmean(ttfts), "queue_growth": queue_growth(arrivals, ttfts)}
    return predicted, PerRequest.of(arrivals, ttfts, list(result.finish_times))


# --- the measurement ------------------------------------------------------------------------------

def measure(deployment: Deployment, rate: float, seconds: float, seed: int,
            out: Path) -> tuple[dict, list, PerRequest]:
    """One load-generator run; its figures, the requests it sent as (arrival s, prompt tokens), and per
    request (in arrival order) its TTFT and whether it completed inside the throughput window."""
    path = out / f"loadgen-{rate:.3f}-seed{seed}.json"
    argv = [sys.executable, "-m", "services.cli", "bench", "serve", "--base-url", deployment.base_url,
            "--dataset", "lognormal", "--length-scale", str(LENGTH_SCALE), "--output-len", str(OUTPUT_TOKENS),
            "--ignore-eos", "--temperature", "0", "--request-rate", f"{rate:.4f}", "--duration", str(seconds),
            "--warmup", str(WARMUP_REQUESTS), "--seed", str(seed), "--result-file", str(path), "--no-progress"]
    subprocess.run(argv, check=True, stdout=subprocess.DEVNULL)
    result = json.loads(path.read_text())
    ok = [i for i, status in enumerate(result["statuses"]) if status == 200]
    if len(ok) != len(result["statuses"]):
        raise SystemExit(f"sim_vs_real: {len(result['statuses']) - len(ok)} requests failed at {rate:.3f} req/s "
                         f"(see {path})")
    starts, ttfts, e2els = result["start_times"], result["ttfts"], result["e2els"]
    lengths = [used or asked for used, asked in zip(result["usage_prompt_tokens"], result["input_lens"])]
    first = min(starts)
    order = sorted(range(len(starts)), key=starts.__getitem__)
    arrivals = [starts[i] - first for i in order]
    requests = PerRequest.of(arrivals, [ttfts[i] for i in order], [a + e2els[i] for a, i in zip(arrivals, order)])
    router = result.get("router_metrics") or {}
    measured = {"throughput": requests.throughput, "offloaded_fraction": router.get("offloaded_fraction"),
                "ttft_mean": statistics.fmean(ttfts), "queue_growth": queue_growth(arrivals, requests.ttfts),
                "requests": len(starts), "rate": len(starts) / max(arrivals)}
    return measured, [(a, float(lengths[i])) for a, i in zip(arrivals, order)], requests


def metered(deployment: Deployment, rate: float, seconds: float, seed: int,
            out: Path) -> tuple[dict, list, PerRequest, _host_cpu.Load]:
    """``measure``, and what the load used of the CPU outside the engines, for ``_host_cpu.fit``."""
    before, started = _host_cpu.read(), time.monotonic()
    measured, replay, requests = measure(deployment, rate, seconds, seed, out)
    load = _host_cpu.Load(_host_cpu.read() - before, time.monotonic() - started, len(replay))
    return measured, replay, requests, load


def calibrate(deployment: Deployment, rates: tuple[float, float], seconds: float, seed: int,
              out: Path) -> tuple[list[_host_cpu.Load], list[tuple[list, PerRequest]]]:
    """Two light loads of equal length: what each used of the CPU outside the engines, for a first figure
    of the CPU per request that the engines' cores spend on anything but the engines (``_host_cpu``: what
    is read, and how a noisy reading is bounded; every measured load adds to it), and the requests each
    sent with their measured TTFTs, for the PrfaaS prefill worker's speed (``_prfaas_speed``)."""
    # Unmeasured first: what the processes do once, on their first requests of either path (lazy
    # imports, the KV connections and their handshakes), would otherwise all fall in the lighter
    # load and make the difference between the loads too small, or negative.
    measure(deployment, rates[-1], WARMUP_SECONDS, seed + CALIBRATION_SEED + len(rates), out)
    loads, samples = [], []
    for index, rate in enumerate(rates):
        _, replay, real, load = metered(deployment, rate, seconds, seed + CALIBRATION_SEED + index, out)
        loads.append(load)
        samples.append((replay, real))
    return loads, samples


def prfaas_speed(inputs, rtt_ms: float, samples: list[tuple[list, PerRequest]],
                 host_cpu_s: float) -> _prfaas_speed.Speed:
    """The factor on the PrfaaS instance's prefill latency at which the simulator, replaying the calibration
    loads' requests, gives their offloaded requests' measured mean TTFT (``_prfaas_speed``). Offloaded: longer
    than the threshold, the router's rule (both sides route the very same requests alike)."""
    picks = [[i for i, (_, tokens) in enumerate(replay) if tokens > THRESHOLD] for replay, _ in samples]
    measured = [real.ttfts[i] for (_, real), chosen in zip(samples, picks) for i in chosen]

    def mean_at(factor: float) -> float:
        scaled = _prfaas_speed.with_factor(inputs, factor)
        ttfts = [sim.ttfts[i] for (replay, _), chosen in zip(samples, picks) if chosen
                 for sim in [predict(scaled, rtt_ms, replay, host_cpu_s)[1]] for i in chosen]
        return statistics.fmean(ttfts) if ttfts else 0.0

    return _prfaas_speed.fit(mean_at, measured)


def queue_growth(arrivals: list[float], ttfts: list[float]) -> float:
    """Mean number of requests waiting for their first token over the last quarter of the arrival
    window, minus over its second quarter."""
    window = max(arrivals)

    def mean_waiting(start: float, end: float, points: int = 200) -> float:
        times = [start + (end - start) * (i + 0.5) / points for i in range(points)]
        return statistics.fmean(sum(1 for a, t in zip(arrivals, ttfts) if a <= x < a + t) for x in times)

    return mean_waiting(0.75 * window, window) - mean_waiting(0.25 * window, 0.5 * window)


def run_load(deployment: Deployment, inputs, args, index: int, rate: float, host_cpu_s: float,
             loads: list[_host_cpu.Load]) -> list[Segment]:
    """The ``index``-th load: run, replayed in the simulator, and run again with new prompts while a figure
    it tests has too wide an interval, ``--max-runs`` at most. The overload point runs independent
    replications of half ``--seconds`` each instead, ``--overload-runs`` at least and more while its
    throughput's interval is too wide, ``--max-overload-runs`` at most. Each run's CPU readings go to ``loads``."""
    share, started, segments = args.shares[index], time.monotonic(), []
    overload = index == len(args.shares) - 1
    least, most = (args.overload_runs, args.max_overload_runs) if overload else (1, args.max_runs)
    seconds = max(args.seconds / 2 if overload else args.seconds, args.min_requests / rate)
    while True:
        seed = args.seed + index + SEGMENT_SEED * len(segments)
        measured, replay, real, load = metered(deployment, rate, seconds, seed, args.out)
        loads.append(load)
        predicted, sim = predict(inputs, args.rtt_ms, replay, host_cpu_s)
        segments.append(Segment(measured, predicted, real, sim, tuple(replay)))
        row = pooled_row(share, rate, segments, replications=overload)
        elapsed = time.monotonic() - started
        wide = too_wide(row, tested(index, len(args.shares)))
        print(f"sim_vs_real: {share:g}x the knee, run {len(segments)}: {row['measured']['requests']} requests in "
              f"{elapsed:.0f} s" + (f"; interval still wide for {', '.join(wide)}" if wide else ""), flush=True)
        if enough_runs(len(segments), wide, least, most):
            return segments


def replayed(inputs, args, segments: list[Segment], host_cpu_s: float) -> list[Segment]:
    """The segments predicted again with the CPU per request fitted over every load."""
    again = []
    for segment in segments:
        predicted, sim = predict(inputs, args.rtt_ms, list(segment.replay), host_cpu_s)
        again.append(replace(segment, predicted=predicted, sim=sim))
    return again


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=120.0, help="load per point, seconds (default: 120)")
    parser.add_argument("--min-requests", type=int, default=0,
                        help="run each load longer than --seconds where it would send fewer requests: on a slow "
                        "machine the knee, and so every load, is low (default: 0, --seconds alone)")
    parser.add_argument("--loads", default=",".join(map(str, LOADS)),
                        help="shares of the predicted knee, light to overload (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0,
                        help="arrivals and prompts of the first load; each later load adds 1 (default: 0)")
    parser.add_argument("--calibration-seconds", type=float, default=0.0,
                        help="each of two light loads (0.13x and 0.4x the knee) that measure the CPU per request the "
                        "engines' cores spend outside the engines (default: 30, or long enough for the higher one "
                        f"to send {CALIBRATION_REQUESTS} requests on a machine where the knee is low)")
    parser.add_argument("--interference-pairs", type=int, default=_interference.PAIRS,
                        help="rounds of long prompts alone, back to back and beside decoding requests that measure "
                        "what slows the PrfaaS prefill beyond its profile (its KV sender's CPU, the colocated worker's "
                        "decoding; the medians are used; default: %(default)s)")
    parser.add_argument("--rtt-ms", type=float, default=0.0,
                        help="round trip added by a userspace delay line (default: 0, a veth pair with only "
                        "the cap: the delay line's packet copying takes CPU the engines need on a small machine)")
    parser.add_argument("--max-runs", type=int, default=2,
                        help="a load below the knee runs again (new prompts, once the last drained) while the "
                        "interval of a figure it tests is wider than half that figure's tolerance, at most this "
                        "many runs in all (default: %(default)s; the overload point: --overload-runs)")
    parser.add_argument("--overload-runs", type=int, default=OVERLOAD_RUNS,
                        help="the overload point's independent runs at least, half --seconds each, each drained, "
                        "with prompts of its own: its throughput's interval is Student's t over their errors "
                        "(default: %(default)s)")
    parser.add_argument("--max-overload-runs", type=int, default=None,
                        help="the overload point runs again while its throughput's interval is wider than half "
                        f"its tolerance, at most this many runs in all (default: {MAX_OVERLOAD_RUNS}, or "
                        "--overload-runs where that is more)")
    parser.add_argument("--out", type=Path, default=None,
                        help="output directory (default: bench/results/sim_vs_real-<time>; an earlier run's resumes "
                        "its profile)")
    parser.add_argument("--quick", action="store_true",
                        help="profile with `prfaas profile --quick` (prompts up to 1,024 tokens, extrapolated)")
    parser.add_argument("--shared-profile-cache", action="store_true",
                        help="reuse profile points from `prfaas profile`'s shared cache (~/.cache/prfaas/profiles), "
                        "however old, instead of measuring the engine in this run (default: measure, a few minutes)")
    args = parser.parse_args(argv)
    args.shares = [float(x) for x in args.loads.split(",")]
    args.out = args.out or results_dir("sim_vs_real")
    if args.max_overload_runs is None:
        args.max_overload_runs = max(MAX_OVERLOAD_RUNS, args.overload_runs)
    if (len(args.shares) < 2 or args.seconds < 20 or args.max_runs < 1 or args.overload_runs < 2
            or args.max_overload_runs < args.overload_runs or args.interference_pairs < 1):
        parser.error("--loads: need at least two shares (the last is the overload point); --seconds at least 20; "
                     "--max-runs at least 1; --overload-runs at least 2; --max-overload-runs at least "
                     "--overload-runs; --interference-pairs at least 1")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if (reason := available()) is not None:
        sys.exit(f"sim_vs_real: {reason}")
    args.out.mkdir(parents=True, exist_ok=True)
    config = make_config()
    path = wan_path(LINK_MBIT, args.rtt_ms, subnet="10.213.91") if args.rtt_ms else \
        veth_link("10.213.91", LINK_MBIT, side="host")
    with path as link:
        link.set_rate(LINK_MBIT, side="ns", action="replace" if args.rtt_ms else "add")  # the KV direction too
        place_prefill(config, link)
        deployment = Deployment(config, args.out, prefixes={"prefill-0": link.exec_argv([])})
        deployment.config_path.write_text(yaml.safe_dump(config))
        inputs = planner_inputs(profile(deployment.config_path, args.out, args.quick, args.shared_profile_cache))
        profiled_knee = predicted_knee(inputs, args.rtt_ms, args.seed)
        print(f"sim_vs_real: predicted knee with the profile as it is {profiled_knee:.3f} req/s", flush=True)
        print("sim_vs_real: starting the deployment ...", flush=True)
        deployment.start()
        runs, loads = [], []
        try:
            rates = tuple(share * profiled_knee for share in CALIBRATION_SHARES)
            seconds = args.calibration_seconds or max(30.0, CALIBRATION_REQUESTS / rates[-1])
            print(f"sim_vs_real: calibrating at {rates[0]:.2f} and {rates[1]:.2f} req/s, {seconds:.0f} s each, after "
                  f"{WARMUP_SECONDS} s unmeasured ...",
                  flush=True)
            sender_before = _interference.SenderCpu.of(deployment.worker_stats("prefill-0"))
            loads, samples = calibrate(deployment, rates, seconds, args.seed, args.out)
            time.sleep(1.0)  # the connector publishes its telemetry every quarter second
            sender_ms = _interference.SenderCpu.of(deployment.worker_stats("prefill-0")).ms_per_mib_since(sender_before)
            print(f"sim_vs_real: prefill-0's KV sender threads used "
                  f"{'no reading' if sender_ms is None else f'{sender_ms:.2f} ms'} of CPU per MiB sent over the "
                  "calibration loads (its telemetry)", flush=True)
            first = _host_cpu.fit(loads)
            print(f"sim_vs_real: outside the engines (the router, load generator, workers' front ends, the kernel's "
                  f"work for them) the engines' {len(os.sched_getaffinity(0))} cores spend, at first, "
                  f"{first.describe()}", flush=True)
            print("sim_vs_real: measuring what slows the PrfaaS prefill worker (the colocated worker's decoding) "
                  "and checking a prefill queued behind another ...", flush=True)
            slowdown = interference(deployment, inputs, args.rtt_ms, args.interference_pairs)
            print(f"sim_vs_real: {slowdown.describe()}", flush=True)
            inputs = with_interference(inputs, slowdown)
            speed = prfaas_speed(inputs, args.rtt_ms, samples, first.cpu_s)
            inputs = _prfaas_speed.with_factor(inputs, speed.factor)
            knee = predicted_knee(inputs, args.rtt_ms, args.seed)
            print(f"sim_vs_real: the PrfaaS prefill worker runs at {speed.describe()}", flush=True)
            print(f"sim_vs_real: predicted knee {knee:.3f} req/s; loads {', '.join(f'{s:g}x' for s in args.shares)}, "
                  f"{args.seconds:g} s each below the knee, {args.overload_runs} to {args.max_overload_runs} runs of "
                  f"{args.seconds / 2:g} s past it", flush=True)
            for index, share in enumerate(args.shares):
                runs.append(run_load(deployment, inputs, args, index, share * knee, first.cpu_s, loads))
        finally:
            deployment.stop()
    host_cpu = _host_cpu.fit(loads)
    print(f"sim_vs_real: over every load the engines' cores spend {host_cpu.describe()}; the simulator replays "
          "each load again with it", flush=True)
    rows = [pooled_row(share, share * knee, replayed(inputs, args, segments, host_cpu.cpu_s),
                       replications=index == len(runs) - 1)
            for index, (share, segments) in enumerate(zip(args.shares, runs))]
    worst, failures = compare(rows)
    (args.out / "sim_vs_real.json").write_text(json.dumps(
        {"knee_req_s": knee, "profiled_knee_req_s": profiled_knee, "prfaas_speed": asdict(speed),
         "interference": asdict(slowdown), "sender_threads_cpu_ms_per_mib": sender_ms,
         "targets": TARGETS, "host_cpu_s_per_request": host_cpu.cpu_s,
         "host_cpu_calibration": asdict(first), "host_cpu_fit": asdict(host_cpu),
         "runtime": str(runtime_model(inputs, args.rtt_ms, host_cpu.cpu_s)), "rows": rows},
        indent=2))
    plot(rows, args.out / "sim_vs_real.png")
    print(table(rows))
    for index, row in enumerate(rows):
        if not (wide := too_wide(row, tested(index, len(rows)))):
            continue
        if index < len(rows) - 1:
            print(f"note: at {row['share']:g}x the knee the interval of {', '.join(wide)} is wider than half its "
                  f"tolerance after {row['segments']} run(s) (--max-runs {args.max_runs}): more runs would "
                  "say more")
        else:
            print(f"note: at {row['share']:g}x the knee the interval of {', '.join(wide)} over {row['segments']} "
                  f"independent runs is wider than half its tolerance (--max-overload-runs {args.max_overload_runs}): "
                  "more runs would narrow it")
    for failure in failures:
        print("FAIL:", failure)
    verdict = "PASS" if not failures else "FAIL"
    print(f"sim_vs_real: worst error {worst:.2f}x its target (throughput and offload within 10%, mean TTFT within "
          f"25% at the lower loads, a growing queue past the knee): {verdict}")
    return 0 if not failures else 1


if __name__ == "__main__":
    sys.exit(main())
