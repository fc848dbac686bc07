"""Long-timescale role flips: binding-stage detection, sustain, dwell time, drain, cancel."""
import pytest

from services.scheduling.roles import (PdWorkerLoad, RoleAction, RoleBalancer, RoleFlipConfig, StageSnapshot,
                                       binding_stage)

CONFIG = RoleFlipConfig(min_dwell_s=100.0, sustain_s=10.0, max_drain_s=30.0)


def p(name, queued=0, in_flight=0, flippable=True):
    return PdWorkerLoad(name, "prefill", num_in_flight=in_flight, num_prefill_queued=queued, flippable=flippable)


def d(name, utilization=0.0, in_flight=0, flippable=True):
    return PdWorkerLoad(name, "decode", num_in_flight=in_flight, decode_utilization=utilization, flippable=flippable)


@pytest.mark.parametrize("workers, expected", [
    ((p("p1", queued=8), d("d1", 0.2), d("d2", 0.4)), "prefill"),
    ((p("p1", queued=8), d("d1", 0.9), d("d2", 0.9)), None),          # both busy: flipping helps neither
    ((p("p1", queued=0), d("d1", 0.9), d("d2", 0.95)), "decode"),
    ((p("p1", queued=2), d("d1", 0.9)), None),                        # prefill not keeping up well enough
    ((p("p1", queued=4), p("p2", queued=4), d("d1", 0.1)), "prefill"),
    ((p("p1", queued=9),), None),                                     # one role only: nothing to compare
])
def test_binding_stage(workers, expected):
    assert binding_stage(StageSnapshot(0.0, workers), CONFIG) == expected


def run(balancer, steps):
    """``steps``: (time, workers); returns the actions taken, with their time."""
    actions = []
    for now, workers in steps:
        action = balancer.observe(StageSnapshot(now, workers))
        if action is not None:
            actions.append((now, action))
    return actions


PREFILL_BOUND = (p("p1", queued=8), d("d1", 0.2), d("d2", 0.3, in_flight=1))
DECODE_BOUND = (p("p1"), p("p2", in_flight=1), d("d1", 0.9))


@pytest.mark.parametrize("steps, expected", [
    # binding must last sustain_s before a drain starts; the least busy donor drains
    ([(0, PREFILL_BOUND), (5, PREFILL_BOUND), (10, PREFILL_BOUND)], [(10, RoleAction("drain", "d1", "prefill"))]),
    ([(0, DECODE_BOUND), (10, DECODE_BOUND)], [(10, RoleAction("drain", "p1", "decode"))]),
    # an interruption restarts the sustain clock
    ([(0, PREFILL_BOUND), (5, (p("p1"), d("d1", 0.2), d("d2"))), (10, PREFILL_BOUND), (19, PREFILL_BOUND)], []),
    # the last worker of a role never flips; unflippable workers are not donors
    ([(0, (p("p1", queued=8), d("d1", 0.2))), (20, (p("p1", queued=8), d("d1", 0.2)))], []),
    ([(0, (p("p1", queued=8), d("d1", 0.2, flippable=False), d("d2", 0.2, flippable=False))),
      (20, (p("p1", queued=8), d("d1", 0.2, flippable=False), d("d2", 0.2, flippable=False)))], []),
])
def test_drain_starts_after_sustain(steps, expected):
    assert run(RoleBalancer(CONFIG), steps) == expected


def test_flip_waits_for_the_drain_then_dwells():
    balancer = RoleBalancer(CONFIG)
    busy = (p("p1", queued=8), d("d1", 0.2, in_flight=2), d("d2", 0.3, in_flight=3))
    idle = (p("p1", queued=8), d("d1", 0.2, in_flight=0), d("d2", 0.3, in_flight=3))
    assert run(balancer, [(0, busy), (10, busy)]) == [(10, RoleAction("drain", "d1", "prefill"))]
    assert run(balancer, [(15, busy), (20, busy)]) == []                     # still in flight: keep draining
    assert run(balancer, [(25, idle)]) == [(25, RoleAction("flip", "d1", "prefill"))]
    flipped = (p("p1", queued=8), p("d1", queued=8), d("d2", 0.1), d("d3", 0.1))
    assert run(balancer, [(40, flipped), (100, flipped), (124, flipped)]) == []   # min_dwell_s after the flip
    assert run(balancer, [(125, flipped)]) == [(125, RoleAction("drain", "d2", "prefill"))]


def test_a_drain_that_takes_too_long_is_cancelled():
    balancer = RoleBalancer(CONFIG)
    busy = (p("p1", queued=8), d("d1", 0.2, in_flight=2), d("d2", 0.3, in_flight=3))
    run(balancer, [(0, busy), (10, busy)])
    assert run(balancer, [(40, busy)]) == []
    assert run(balancer, [(41, busy)]) == [(41, RoleAction("cancel", "d1", "prefill"))]
    assert balancer.draining is None
    assert run(balancer, [(50, busy)]) == []                                 # sustain starts over
    assert run(balancer, [(51, busy)]) == [(51, RoleAction("drain", "d1", "prefill"))]   # no flip: no dwell


def test_a_worker_gone_from_the_snapshot_cancels_its_drain():
    balancer = RoleBalancer(CONFIG)
    run(balancer, [(0, PREFILL_BOUND), (10, PREFILL_BOUND)])
    assert run(balancer, [(11, (p("p1", queued=8), d("d2", 0.3)))]) == [(11, RoleAction("cancel", "d1", "prefill"))]


def test_a_worker_lent_to_the_other_stage_goes_home_first():
    """Decode binds with two PD-P workers: the one configured as decode (lent to prefill) flips back,
    even when the configured PD-P worker is the less busy one; with no home role the least busy goes."""
    lent = PdWorkerLoad("d1", "prefill", num_in_flight=2, home_role="decode")
    home = PdWorkerLoad("p1", "prefill", num_in_flight=0, home_role="prefill")
    busy = d("d2", 0.9)
    assert run(RoleBalancer(CONFIG), [(0, (home, lent, busy)), (10, (home, lent, busy))]) == [
        (10, RoleAction("drain", "d1", "decode"))]
    assert run(RoleBalancer(CONFIG), [(0, (p("p1"), p("d1", in_flight=2), busy)),
                                      (10, (p("p1"), p("d1", in_flight=2), busy))]) == [
        (10, RoleAction("drain", "p1", "decode"))]
