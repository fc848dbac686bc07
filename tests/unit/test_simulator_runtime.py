"""The simulator's runtime inputs: link round trip and connection windows, layer-wise overlap, pool
hits and their load time, the router's placement policy, and the simulation: section and flags."""
import json
import statistics
import subprocess
import sys
from dataclasses import replace

import pytest
import yaml

from services.kv_transport.settings import TransportSettings
from services.planner.inputs import parse_plan_inputs
from services.scheduling import placement
from services.simulator import engine
from services.simulator.engine import simulate
from services.simulator.link import num_channels
from services.simulator.runtime import (
    MIB,
    NOTSENT_LOWAT_BYTES,
    RuntimeInputError,
    RuntimeModel,
    exposed_transfer_s,
    parse_runtime,
)
from services.simulator.setup import workload_of
from support.planner_inputs import CASE_STUDY
from test_simulator import spec_for

GB = 1e9 / 8


def test_defaults_follow_the_transport_settings():
    settings = TransportSettings()
    assert RuntimeModel().connections == settings.connections_per_peer
    assert NOTSENT_LOWAT_BYTES == settings.notsent_lowat_bytes


@pytest.mark.parametrize("rtt_ms, connections, window, gbps, expected_bytes_per_s", [
    (0, 8, 1 * MIB, 100, 100 * GB),                 # no round trip: the link's rate
    (20, 1, 1 * MIB, 100, 1 * MIB / 0.020),          # one connection: window / RTT = 52 MB/s
    (20, 8, 1 * MIB, 100, 8 * MIB / 0.020),          # eight: 8x
    (20, 8, 1 * MIB, 1, 1 * GB),                    # ... capped by a 1 Gbps link
    (20, 8, 0, 100, 100 * GB),                       # unbounded window
    (2, 8, 3 * MIB, 100, 100 * GB),                  # 12.6 GB/s of windows exceed 100 Gbps
])
def test_a_transfers_rate_is_bounded_by_its_connections_windows(rtt_ms, connections, window, gbps,
                                                                  expected_bytes_per_s):
    runtime = RuntimeModel(link_rtt_ms=rtt_ms, connections=connections, connection_window_bytes=window)
    assert runtime.link_bytes_per_s(gbps) == pytest.approx(expected_bytes_per_s)


@pytest.mark.parametrize("rtt_ms, connections, gbps, channels", [
    (0, 8, 100, 1), (20, 8, 100, 29), (20, 1, 100, 238), (20, 8, 1, 1), (20, 8, 3.3, 1), (20, 8, 12.6, 3),
])
def test_window_bound_transfers_share_the_link(rtt_ms, connections, gbps, channels):
    # 1 MiB windows: a connection carries 52.4 MB/s at 20 ms, eight 419 MB/s (3.36 Gbps)
    runtime = RuntimeModel(link_rtt_ms=rtt_ms, connections=connections, connection_window_bytes=MIB)
    assert num_channels(runtime, gbps) == channels


@pytest.mark.parametrize("transfer_s, overlap_s, exposed_s", [(3.0, 1.0, 2.0), (1.0, 3.0, 0.0), (2.0, 2.0, 0.0),
                                                              (2.0, 0.0, 2.0)])
def test_exposed_transfer_is_what_the_overlap_does_not_hide(transfer_s, overlap_s, exposed_s):
    assert exposed_transfer_s(transfer_s, overlap_s) == exposed_s


def single_request(case, runtime, gbps=100.0):
    """One mean-length request alone on the naive deployment (PrfaaS prefill, then the link)."""
    spec = replace(spec_for(case, "naive", 1.0, 1, mean_length_mode=True), rate=1e9, runtime=runtime)
    spec = replace(spec, topology=replace(spec.topology, link_gbps=gbps))
    topo, mean = spec.topology, spec.workload.lengths.mean
    return simulate(spec).ttfts[0], topo.prfaas_latency(mean), topo.prfaas_kv_bytes(mean)


@pytest.mark.parametrize("gbps, layerwise", [(100.0, False), (100.0, True), (1.0, False), (1.0, True)])
def test_layerwise_streaming_hides_the_transfer_under_the_prefill(case, gbps, layerwise):
    ttft, prefill_s, kv_bytes = single_request(case, RuntimeModel(layerwise=layerwise), gbps)
    transfer_s = kv_bytes / (gbps * GB)
    expected = prefill_s + (exposed_transfer_s(transfer_s, prefill_s) if layerwise else transfer_s)
    assert ttft == pytest.approx(expected, rel=1e-9)
    if layerwise and gbps == 100.0:
        assert ttft == pytest.approx(prefill_s)       # a transfer shorter than the prefill is hidden
    if layerwise and gbps == 1.0:
        assert ttft == pytest.approx(transfer_s)      # a longer one shows what the prefill did not cover


@pytest.mark.parametrize("connections", [1, 8])
def test_round_trip_and_window_time_one_transfer(case, connections):
    runtime = RuntimeModel(link_rtt_ms=20, connections=connections, connection_window_bytes=MIB)
    ttft, prefill_s, kv_bytes = single_request(case, runtime)
    assert ttft == pytest.approx(prefill_s + kv_bytes / (connections * MIB / 0.020) + 0.010, rel=1e-9)


def hit_spec(case, probability, runtime=None, policy="static"):
    raw = yaml.safe_load(CASE_STUDY.read_text())
    raw["workload"]["prefix_hit"] = {"probability": probability, "min_fraction": 0.5, "max_fraction": 0.5}
    return replace(spec_for(case, policy, 0.5, 5_000), workload=workload_of(parse_plan_inputs(raw)),
                   runtime=runtime or RuntimeModel())


@pytest.mark.parametrize("probability", [0.5, 1.0])
def test_pool_hits_reduce_prefill_work(case, probability):
    # half of a hit prompt is cached and not recomputed (the curve's fixed cost stays)
    without = simulate(hit_spec(case, 0.0, policy="homogeneous")).busy_s["local_prefill"]
    with_hits = simulate(hit_spec(case, probability, policy="homogeneous")).busy_s["local_prefill"]
    assert (1 - 0.5 * probability) * without < with_hits < (1 - 0.35 * probability) * without


@pytest.mark.parametrize("pool_load_gbps", [400.0, 50.0])
def test_a_pool_hit_is_loaded_before_its_uncached_part_is_computed(case, pool_load_gbps):
    spec = hit_spec(case, 1.0, RuntimeModel(pool_load_gbps=pool_load_gbps), policy="homogeneous")
    spec = replace(spec, num_requests=1, rate=1e9, mean_length_mode=False)
    free = simulate(replace(spec, runtime=RuntimeModel())).ttfts[0]
    load_s = simulate(spec).ttfts[0] - free
    assert load_s > 0
    # the load moves the prefix's KV at the pool's bandwidth: twice as long at half the bandwidth
    slower = simulate(replace(spec, runtime=RuntimeModel(pool_load_gbps=pool_load_gbps / 2))).ttfts[0] - free
    assert slower == pytest.approx(2 * load_s, rel=1e-9)


def test_every_arrival_is_routed_by_the_routers_policy(case, monkeypatch):
    calls = []

    def spy(*args, **kwargs):
        route = placement.choose_route(*args, **kwargs)
        calls.append(route.path)
        return route

    monkeypatch.setattr(engine, "choose_route", spy)
    result = simulate(spec_for(case, "static", 0.5, 2_000)).summary()
    assert len(calls) == 2_000
    assert calls.count("prfaas") / 2_000 == result["offloaded_fraction"] > 0
    assert set(calls) == {"prfaas", "pd"}


@pytest.mark.parametrize("raw, message", [
    ({"chunk_tokens": -1}, "simulation.chunk_tokens: must be 0"),
    ({"chunk_tokens": 1.5}, "simulation.chunk_tokens: expected an integer"),
    ({"link_rtt_ms": "fast"}, "simulation.link_rtt_ms: expected a number"),
    ({"layerwise": 1}, "simulation.layerwise: expected true or false"),
    ({"connections": 0}, "simulation.connections: must be at least 1"),
    ({"pool_gbps": 1}, "simulation.pool_gbps: unknown key"),
    ({"decode_step_s_by_batch": [[1, 0.02]]}, "simulation.decode_step_s_by_batch: needs at least two"),
    ({"decode_step_s_by_batch": [[4, 0.03], [2, 0.02]]}, "simulation.decode_step_s_by_batch: needs at least two"),
    ({"decode_step_s_by_batch": [1, 2]}, "simulation.decode_step_s_by_batch: expected a list of"),
    ([1], "simulation: expected a mapping"),
])
def test_bad_simulation_inputs_name_the_key(raw, message):
    with pytest.raises(RuntimeInputError, match=message.replace(".", r"\.")):
        parse_runtime(raw)


def run_cli(config, *args):
    return subprocess.run([sys.executable, "-m", "services.cli", "simulate", "--config", str(config), "--policy",
                           "static", "--requests", "500", "--json", *args], capture_output=True, text=True)


def test_simulation_section_and_flags(tmp_path):
    raw = yaml.safe_load(CASE_STUDY.read_text())
    raw["simulation"] = {"chunk_tokens": 8192, "link_rtt_ms": 20, "layerwise": True, "local_both": 4}
    config = tmp_path / "plan.yaml"
    config.write_text(yaml.safe_dump(raw))
    result = run_cli(config, "--link-rtt-ms", "5", "--pool-load-gbps", "100", "--admission")
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["runtime"] == {
        "chunk_tokens": 8192, "link_rtt_ms": 5.0, "connections": 8, "connection_window_bytes": 3 * MIB,
        "layerwise": True, "pool_load_gbps": 100.0, "per_instance": False, "local_both": 4,
        "host_cpu_s_per_request": 0.0, "host_cores": 0, "decode_step_s_by_batch": [], "colocated_interference": 0.0,
        "send_cpu_ms_per_mib": 0.0, "admission": True,
        "max_in_flight": 0, "admission_ttft_slo_s": 0.0}
    bad = run_cli(config, "--connections", "0")
    assert bad.returncode == 2 and bad.stderr.startswith("prfaas simulate: error: --connections: must be at least 1")


REPLAY = ((0.5, 30_000.0), (0.9, 4_000.0), (1.0, 60_000.0), (7.25, 12_000.0), (7.25, 90_000.0))


def test_a_replayed_workload_keeps_each_requests_arrival_and_length(case):
    spec = replace(spec_for(case, "static", 1.0, len(REPLAY)), replay=REPLAY)
    result = simulate(spec)
    assert tuple(result.arrivals) == tuple(t for t, _ in REPLAY)
    assert result.num_offloaded == sum(1 for _, length in REPLAY if length > spec.threshold_tokens)


@pytest.mark.parametrize("replay, message", [(REPLAY[:2], "replayed workload of 2 requests cannot run 5"),
                                             ((REPLAY[1], REPLAY[0], *REPLAY[2:]), "must not decrease")])
def test_a_bad_replay_is_refused(case, replay, message):
    with pytest.raises(ValueError, match=message):
        replace(spec_for(case, "static", 1.0, len(REPLAY)), replay=replay)


def test_replay_flag_replays_the_workload_file(tmp_path):
    trace = tmp_path / "trace.jsonl"
    trace.write_text("".join(json.dumps({"arrival_s": t, "input_length": int(n), "output_length": 64}) + "\n"
                             for t, n in REPLAY))
    result = run_cli(CASE_STUDY, "--workload", str(trace), "--replay")
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout)
    assert out["arrivals"] == "replayed" and out["policies"]["static"]["requests"] == len(REPLAY)
    threshold = out["planner"]["threshold_tokens"]
    assert out["policies"]["static"]["offloaded_fraction"] == sum(n > threshold for _, n in REPLAY) / len(REPLAY)
    fixed = json.loads(run_cli(CASE_STUDY, "--workload", str(trace), "--replay", "--threshold", "50000").stdout)
    assert fixed["policies"]["static"]["offloaded_fraction"] == sum(n > 50_000 for _, n in REPLAY) / len(REPLAY)
    refused = run_cli(CASE_STUDY, "--replay")
    assert refused.returncode == 2 and "--replay: needs --workload FILE" in refused.stderr


def test_engines_lose_the_share_of_the_host_that_the_serving_processes_take():
    """At 20 req/s, 25 ms of router and client CPU per request is half a core of 2: engine steps take
    1 / (1 - 0.25) as long; the share is capped below the whole host."""
    from services.simulator.runtime import MAX_HOST_SHARE, RuntimeModel

    assert RuntimeModel().contention_factor(20.0) == 1.0
    contended = RuntimeModel(host_cpu_s_per_request=0.025, host_cores=2)
    assert contended.contention_factor(20.0) == pytest.approx(1 / 0.75)
    assert contended.contention_factor(1e6) == pytest.approx(1 / (1 - MAX_HOST_SHARE))
    with pytest.raises(RuntimeInputError, match="simulation.host_cores"):
        RuntimeModel(host_cores=-1)


def test_a_contended_host_slows_every_engine_in_the_simulation(case):
    from services.simulator.runtime import RuntimeModel

    spec = spec_for(case, "static", 1.0, 2_000)
    alone = simulate(spec)
    runtime = RuntimeModel(host_cpu_s_per_request=0.1 / spec.rate, host_cores=1)  # a tenth of the host
    shared = simulate(replace(spec, runtime=runtime))
    assert runtime.contention_factor(spec.rate) == pytest.approx(1 / 0.9)
    assert shared.capacity() == pytest.approx(alone.capacity() * 0.9, rel=0.02)
    assert statistics.fmean(shared.ttfts) > statistics.fmean(alone.ttfts)
