"""The PrfaaS prefill slowed beyond its profile: while colocated workers decode
(``simulation.colocated_interference``: a prefill in flight moves its end as its speed changes, colocated
workers report when they decode, and the engine joins the two), and by its KV sender's CPU
(``simulation.send_cpu_ms_per_mib``: a prefill that starts as a transfer starts pays it, an idle instance
pays from its idle time)."""
import heapq
from array import array

import pytest

from services.planner.profiles import PiecewiseLinear
from services.simulator.colocated import ColocatedInstances
from services.simulator.engine import simulate
from services.simulator.prefill import PrefillCluster
from services.simulator.runtime import RuntimeInputError, RuntimeModel
from test_simulator import spec_for

LINEAR = PiecewiseLinear((0.0, 1000.0), (0.0, 10.0))      # 10 ms a token
STEP, LOADED = 0, 1


def drain(heap, cluster, changes=()):
    """Run ``cluster``'s events, applying ``changes`` ((time, speed), in order) as time passes them."""
    finished, changes = [], list(changes)
    cluster.finished = lambda now, rid: finished.append((rid, now))
    while heap:
        if changes and changes[0][0] <= heap[0][0]:
            cluster.set_speed(*changes.pop(0))
            continue
        now, _, key = heapq.heappop(heap)
        cluster.on_event(now, key)
    return finished


def run_all(heap, cluster):
    while heap:
        now, _, key = heapq.heappop(heap)
        cluster.on_event(now, key)


@pytest.mark.parametrize("chunk_tokens", [0, 256])
def test_a_prefill_in_flight_moves_its_end_with_its_speed(chunk_tokens):
    heap = []
    cluster = PrefillCluster(1, LINEAR, chunk_tokens, (STEP, LOADED), heap, array("d", [0.0, 0.0]), 2)
    cluster.slowable()
    cluster.submit(0.0, 0, 1000.0 if chunk_tokens else LINEAR(1000.0))
    # 10 s of work: 4 s at full speed, 6 s at half speed (3 s of work), the last 3 s at full speed
    finished = drain(heap, cluster, [(4.0, 0.5), (10.0, 1.0)])
    assert finished == [(0, pytest.approx(13.0))]
    assert cluster.slowed_s == pytest.approx(3.0)


@pytest.mark.parametrize("chunk_tokens", [0, 2048])
@pytest.mark.parametrize("second_at, second_ends", [
    (0.0, 22.0),        # queued: starts as the first's KV leaves, and pays the sender's 2 s
    (11.0, 22.0),       # 1 s after: the idle second paid half, the prefill pays the rest
    (13.0, 23.0),       # after the sender is done: as profiled
])
def test_the_senders_cpu_comes_out_of_the_prefill_beside_it(chunk_tokens, second_at, second_ends):
    heap, finished = [], []
    cluster = PrefillCluster(1, LINEAR, chunk_tokens, (STEP, LOADED), heap, array("d", [0.0, second_at]), 2)
    cluster.slowable()

    def done(now, rid):
        finished.append((rid, now))
        cluster.owe(now, rid, 2.0)              # the engine: the KV leaves as the prefill ends

    cluster.finished = done
    work = 1000.0 if chunk_tokens else LINEAR(1000.0)
    cluster.submit(0.0, 0, work)
    if second_at == 0.0:
        cluster.submit(0.0, 1, work)
    run_all(heap, cluster)
    if second_at:                               # after the first ended
        cluster.submit(second_at, 1, work)
        run_all(heap, cluster)
    assert finished[0] == (0, pytest.approx(10.0))
    assert finished[1] == (1, pytest.approx(second_ends))


def test_without_slowable_the_cluster_is_as_it_was():
    heap = []
    cluster = PrefillCluster(1, LINEAR, 0, (STEP, LOADED), heap, array("d", [0.0]), 1)
    cluster.submit(0.0, 0, 10.0)
    assert drain(heap, cluster) == [(0, 10.0)] and cluster.slowed_s == 0.0
    with pytest.raises(RuntimeError, match="slowable"):
        cluster.set_speed(1.0, 0.5)
    with pytest.raises(RuntimeError, match="slowable"):
        cluster.owe(1.0, 0, 0.5)


def test_a_colocated_worker_reports_when_its_steps_advance_decodes():
    heap, changes = [], []
    both = ColocatedInstances(2, LINEAR, 0, 8, 0.05, 4, (STEP, LOADED), heap, 2, lambda now, rid: None)
    both.decoding_changed = lambda now, share: changes.append((round(now, 6), share))
    both.dest[0], both.dest[1] = 0, 1
    both.prefill(0.0, 0, 100.0)          # 1 s of prefill (no decodes yet), then 3 decode steps
    both.submit(0.5, 1)                  # KV streamed in: 4 decode steps at once on the other worker
    while heap:
        now, _, key = heapq.heappop(heap)
        both.on_step(now, key)
    assert changes == [(0.5, 0.5), (0.7, 0.0), (1.0, 0.5), (1.15, 0.0)]


def test_the_prfaas_path_slows_while_the_colocated_workers_decode(case):
    def run(interference):
        runtime = RuntimeModel(local_both=4, chunk_tokens=8192, colocated_interference=interference)
        return simulate(spec_for(case, "static", 0.6, 3_000, seed=5, runtime=runtime))

    alone, slowed = run(0.0), run(0.5)
    assert alone.summary()["offloaded_fraction"] == slowed.summary()["offloaded_fraction"] > 0
    assert sum(slowed.ttfts) > sum(alone.ttfts)
    assert slowed.busy_s["prfaas_prefill"] > alone.busy_s["prfaas_prefill"]
    assert slowed.busy_s["local_prefill"] == alone.busy_s["local_prefill"]
    assert slowed.capacity() < alone.capacity()


def test_the_prfaas_path_pays_its_senders_cpu(case):
    def run(ms_per_mib):
        runtime = RuntimeModel(per_instance=True, chunk_tokens=8192, send_cpu_ms_per_mib=ms_per_mib)
        return simulate(spec_for(case, "static", 0.8, 3_000, seed=5, runtime=runtime))

    alone, paying = run(0.0), run(20.0)
    assert alone.summary()["offloaded_fraction"] == paying.summary()["offloaded_fraction"] > 0
    assert sum(paying.ttfts) > sum(alone.ttfts)
    assert paying.busy_s["prfaas_prefill"] > alone.busy_s["prfaas_prefill"]
    assert paying.capacity() < alone.capacity()
    with pytest.raises(RuntimeInputError, match="send_cpu_ms_per_mib: must be 0"):
        RuntimeModel(send_cpu_ms_per_mib=-1.0)


def test_interference_needs_colocated_workers(case):
    with pytest.raises(ValueError, match="colocated_interference: needs colocated workers"):
        simulate(spec_for(case, "static", 0.5, 10, runtime=RuntimeModel(colocated_interference=0.2)))
    with pytest.raises(RuntimeInputError, match="colocated_interference: must be 0"):
        RuntimeModel(colocated_interference=-0.1)
