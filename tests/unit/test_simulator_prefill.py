"""The simulator's prefill instances: vLLM-style chunked steps and asynchronous pool loads, timed by hand
on a linear latency curve T(l) = 0.1 s + l / 10,000 tokens/s."""
import heapq
from array import array

import pytest

from services.planner.profiles import PiecewiseLinear
from services.simulator.prefill import PrefillCluster

CURVE = PiecewiseLinear((0.0, 10_000.0), (0.1, 1.1))


def run_cluster(arrivals, chunk_tokens, num_instances=1):
    """``arrivals``: (time, uncached tokens, pool load seconds) per request. Returns each request's
    prefill end time and the cluster."""
    heap: list = []
    arrival_t = array("d", [a[0] for a in arrivals])
    cluster = PrefillCluster(num_instances, CURVE, chunk_tokens, (0, 1), heap, arrival_t, len(arrivals))
    ends = [None] * len(arrivals)
    cluster.finished = lambda now, rid: ends.__setitem__(rid, now)
    handlers = (cluster.on_event, cluster.on_loaded)
    pending = sorted((t, rid) for rid, (t, _, _) in enumerate(arrivals))
    while pending or heap:
        if pending and (not heap or pending[0][0] <= heap[0][0]):
            t, rid = pending.pop(0)
            _, tokens, load_s = arrivals[rid]
            cluster.submit(t, rid, tokens if chunk_tokens else CURVE(tokens), load_s)
            continue
        now, kind, key = heapq.heappop(heap)
        handlers[kind](now, key)
    return ends, cluster


@pytest.mark.parametrize("tokens, chunk_tokens", [(10_000, 2_000), (10_000, 3_000), (9_000, 2_000), (500, 2_000)])
def test_a_prompt_alone_takes_the_curves_time_in_any_number_of_chunks(tokens, chunk_tokens):
    # the chunks' times T(b) - T(a) (the first T(b)) add up to T(l): the profile measured the engine as it chunks
    ends, _ = run_cluster([(0.0, tokens, 0.0)], chunk_tokens)
    assert ends[0] == pytest.approx(CURVE(tokens))


@pytest.mark.parametrize("name, arrivals, chunk_tokens, expected", [
    # vLLM schedules running prefills first with the whole budget: the short prompt waits for the
    # long one's 5 chunks (0.3 + 4 x 0.2 s), then runs
    ("10k then 1k, budget 2k", [(0.0, 10_000, 0.0), (0.01, 1_000, 0.0)], 2_000, [1.1, 1.3]),
    # the long one's last chunk (1k) leaves 1k of budget: the short prompt shares that step, and
    # the long one ends after the whole step (0.1 + 0.2 s) instead of at T(9k) = 1.0 s
    ("9k then 1k, budget 2k", [(0.0, 9_000, 0.0), (0.01, 1_000, 0.0)], 2_000, [1.2, 1.2]),
    ("9k then 1k, whole requests", [(0.0, 9_000, 0.0), (0.01, 1_000, 0.0)], 0, [1.0, 1.2]),
    # 5k + 5k, budget 2k: [A 2k][A 2k][A 1k + B 1k][B 2k][B 2k]
    ("5k then 5k, budget 2k", [(0.0, 5_000, 0.0), (0.01, 5_000, 0.0)], 2_000, [0.8, 1.2]),
    # three prompts share one step when they fit its budget
    # the first starts a step alone on the idle instance; the next two, queued meanwhile, share the next one
    ("three short ones", [(0.0, 100, 0.0), (0.0, 300, 0.0), (0.0, 500, 0.0)], 2_000, [0.11, 0.39, 0.39]),
])
def test_chunked_steps_follow_vllms_schedule(name, arrivals, chunk_tokens, expected):
    ends, _ = run_cluster(arrivals, chunk_tokens)
    assert ends == pytest.approx(expected), name


@pytest.mark.parametrize("chunk_tokens, long_end", [
    (2_000, 1.1),         # 10k is 5 whole chunks: the long prompt runs alone, as without chunking
    (8_000, 1.3),         # its last chunk (2k) shares a step with the short prompt's 1k
])
def test_a_short_prompt_behind_a_long_one_ends_at_most_one_chunk_after_it(chunk_tokens, long_end):
    ends, _ = run_cluster([(0.0, 10_000, 0.0), (0.01, 1_000, 0.0)], chunk_tokens)
    assert ends[0] == pytest.approx(long_end)
    assert 0 <= ends[1] - ends[0] <= CURVE(chunk_tokens)


@pytest.mark.parametrize("chunk_tokens", [0, 2_000])
def test_a_second_instance_takes_the_short_prompt_at_once(chunk_tokens):
    ends, _ = run_cluster([(0.0, 10_000, 0.0), (0.01, 1_000, 0.0)], chunk_tokens, num_instances=2)
    assert ends == pytest.approx([1.1, 0.01 + 0.2])


@pytest.mark.parametrize("chunk_tokens", [0, 2_000])
def test_a_pool_load_does_not_hold_the_instance(chunk_tokens):
    # A loads its cached prefix for 1 s; B (arriving meanwhile) computes in the gap; A then computes its 1k
    ends, cluster = run_cluster([(0.0, 1_000, 1.0), (0.1, 1_000, 0.0)], chunk_tokens)
    assert ends == pytest.approx([1.0 + 0.2, 0.1 + 0.2])
    assert cluster.wait_s == pytest.approx(1.0)  # A's load counts as its wait


@pytest.mark.parametrize("chunk_tokens, expected", [
    # B, C, D queue behind A's 10k prefill (0-1.1 s). B's 0.1 s load starts at its turn (vLLM looks at
    # the waiting queue only when budget is left); C runs meanwhile, and B, loaded at 1.2 s, goes
    # before D
    (0, [1.1, 1.5, 1.3, 1.7]),
    # chunked: C and D share the step that starts at 1.1 s; B, loaded meanwhile, runs next
    (2_000, [1.1, 1.7, 1.5, 1.5]),
])
def test_a_load_starts_at_the_requests_turn_and_it_returns_to_the_head(chunk_tokens, expected):
    arrivals = [(0.0, 10_000, 0.0), (0.1, 1_000, 0.1), (0.2, 1_000, 0.0), (0.3, 1_000, 0.0)]
    ends, _ = run_cluster(arrivals, chunk_tokens)
    assert ends == pytest.approx(expected)
