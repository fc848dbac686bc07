"""Colocated 'both' workers: prefill pieces and decode steps share each engine step (additive step
time), timed by hand on T(l) = 0.1 s + l / 10,000 tokens/s and a 0.1 s decode step. A local prefill's
last piece makes its first token; KV streamed in makes its first token in the first step it runs in."""
import heapq

import pytest

from services.planner.profiles import PiecewiseLinear
from services.simulator.colocated import ColocatedInstances

CURVE = PiecewiseLinear((0.0, 10_000.0), (0.1, 1.1))
STEP_S = 0.1


def run_worker(arrivals, chunk_tokens=0, output_tokens=4, max_batch_size=8, num_instances=1, step_curve=None):
    """``arrivals``: (time, instance, uncached prompt tokens or None for KV streamed in, pool load s).
    Returns each request's first-token and last-token times."""
    heap: list = []
    first, last = {}, {}
    worker = ColocatedInstances(num_instances, CURVE, chunk_tokens, max_batch_size, STEP_S, output_tokens, (0, 1),
                                heap, len(arrivals), lambda now, rid: first.__setitem__(rid, now), step_curve)
    worker.finished = lambda now, rid: last.__setitem__(rid, now)
    handlers = (worker.on_step, worker.on_loaded)
    pending = sorted((a[0], rid) for rid, a in enumerate(arrivals))
    while pending or heap:
        if pending and (not heap or pending[0][0] <= heap[0][0]):
            t, rid = pending.pop(0)
            _, instance, tokens, load_s = arrivals[rid]
            worker.dest[rid] = instance
            worker.routed(instance)
            if tokens is None:
                worker.submit(t, rid)
            else:
                worker.prefill(t, rid, tokens, load_s)
            continue
        now, kind, key = heapq.heappop(heap)
        handlers[kind](now, key)
    assert sum(worker.num_in_flight) == 0
    return [first[r] for r in range(len(arrivals))], [last[r] for r in range(len(arrivals))]


@pytest.mark.parametrize("name, arrivals, kwargs, firsts, lasts", [
    ("KV streamed in makes its first token in one step", [(0.0, 0, None, 0.0)], {}, [0.1], [0.4]),
    ("a local prefill alone takes T(l), then decodes 3 more", [(0.0, 0, 10_000, 0.0)], {}, [1.1], [1.4]),
    # A's first token at 0.1; B's prefill (T = 0.2) arrives at 0.25 and joins at the boundary 0.3: a step of
    # 0.2 + 0.1 ends at 0.6 (A's 4th token, B's 1st); A's 6 other tokens end at 1.2, B's 9 others at 1.5
    ("a prefill cuts a decode run at the next step boundary", [(0.0, 0, None, 0.0), (0.25, 0, 1_000, 0.0)],
     {"output_tokens": 10}, [0.1, 0.6], [1.2, 1.5]),
    # both arrive at 0, so the first step carries both: chunks of 4,000 priced T(4k) = 0.5, T(8k) - T(4k) = 0.4,
    # T(10k) - T(8k) = 0.2, each + 0.1 of decode: A's first token waits for the first chunk (0.6), B's prefill
    # ends at 1.4 (A's 3rd token), A's 97 others at 11.1, B's 99 others 2 steps after
    ("streamed KV waits for the step under way", [(0.0, 0, None, 0.0), (0.0, 0, 10_000, 0.0)],
     {"chunk_tokens": 4_000, "output_tokens": 100}, [0.6, 1.4], [11.1, 11.3]),
    ("a chunked prefill with nothing decoding costs T(l)", [(0.0, 0, 10_000, 0.0)], {"chunk_tokens": 4_000},
     [1.1], [1.4]),
    ("a full batch makes KV wait for a slot", [(0.0, 0, None, 0.0), (0.0, 0, None, 0.0)], {"max_batch_size": 1},
     [0.1, 0.5], [0.4, 0.8]),
    ("instances do not share steps", [(0.0, 0, 10_000, 0.0), (0.0, 1, 10_000, 0.0)], {"num_instances": 2},
     [1.1, 1.1], [1.4, 1.4]),
    # whole prefills one per step: the second waits for the first's step, and its step (0.2 + 0.1) slows the
    # first's decode
    ("whole prefills queue on their instance", [(0.0, 0, 10_000, 0.0), (0.0, 0, 1_000, 0.0)], {},
     [1.1, 1.4], [1.6, 1.7]),
    # a pool load of 0.5 s does not hold the worker: the second prefill runs meanwhile (0 .. 0.2) and its 3
    # decode steps end at 0.5; the loaded one's prefill then runs alone (0.5 .. 0.7)
    ("a pool load lets the next prefill run", [(0.0, 0, 1_000, 0.5), (0.0, 0, 1_000, 0.0)], {},
     [0.7, 0.2], [1.0, 0.5]),
    # a step curve of 0.1 s at batch 1, 0.2 s at 2: A decodes alone (0.1 per step); B's KV arrives at 0.25 and
    # the run ends at the boundary 0.3; the step of both takes 0.2 (A's 4th token, B's 1st at 0.5), B's 3 others
    # 0.1 each
    ("the batch's size prices its step", [(0.0, 0, None, 0.0), (0.25, 0, None, 0.0)],
     {"step_curve": PiecewiseLinear((1.0, 2.0), (0.1, 0.2))}, [0.1, 0.5], [0.5, 0.8]),
    # a prefill step adds the step of the batch decoding: B's prefill joins at 0.1, 0.2 + 0.1 (A alone) ends at
    # 0.4; then both decode at 0.2 a step (A's last at 0.8), and B alone its last at 0.9
    ("a prefill step adds the decoding batch's step", [(0.0, 0, None, 0.0), (0.05, 0, 1_000, 0.0)],
     {"step_curve": PiecewiseLinear((1.0, 2.0), (0.1, 0.2))}, [0.1, 0.4], [0.8, 0.9]),
])
def test_steps_timed_by_hand(name, arrivals, kwargs, firsts, lasts):
    got_first, got_last = run_worker(arrivals, **kwargs)
    assert got_first == pytest.approx(firsts, abs=1e-9), name
    assert got_last == pytest.approx(lasts, abs=1e-9), name


def test_views_count_what_the_router_sees():
    worker = ColocatedInstances(2, CURVE, 0, 8, STEP_S, 4, (0, 1), [], 3, lambda now, rid: None)
    for rid in range(3):
        worker.dest[rid] = 0
        worker.routed(0)
    worker.prefill(0.0, 0, 1_000)
    worker.prefill(0.0, 1, 1_000)
    worker.submit(0.0, 2)
    view = worker.view(0)
    assert (view.role, view.generates, view.prefills, view.receives_kv) == ("both", True, True, True)
    assert (view.num_in_flight, view.num_running, view.num_waiting) == (3, 2, 1)
    assert worker.view(1).load == 0
