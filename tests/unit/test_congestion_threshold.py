"""The short-timescale threshold controller and the router's link-telemetry differencing."""
import math

import pytest
from services.worker_api.types import LinkStats, WorkerStats

from services.scheduling.link_signals import LinkSignals
from services.scheduling.congestion import CongestionAwareThreshold, CongestionControllerConfig, LinkSample

CONFIG = CongestionControllerConfig(base_threshold_tokens=1024, max_threshold_tokens=8192, link_capacity_gbps=10,
                                    raise_utilization=0.85, lower_utilization=0.6, step=2, hold_s=5)


def run(samples, config=CONFIG):
    controller = CongestionAwareThreshold(config)
    return controller, [controller.observe(s) for s in samples]


def busy(now_s, gbps=9.5, **signals):
    return LinkSample(now_s=now_s, egress_gbps=gbps, **signals)


def test_ramps_up_at_the_link_ceiling_then_stops_at_the_maximum():
    controller, thresholds = run([busy(t) for t in range(0, 40)])
    assert thresholds[0] == 2048
    assert thresholds[5] == 4096 and thresholds[10] == 8192
    assert thresholds[-1] == 8192 and controller.state == "raised"


@pytest.mark.parametrize("signals", [
    {"retransmit_ratio": 0.05},
    {"rtt_increase_ms": 50.0},
    {"num_queued": 20},
])
def test_congestion_raises_even_below_the_utilization_band(signals):
    controller, thresholds = run([busy(0, gbps=5.0, **signals)])
    assert thresholds == [2048]
    assert controller.congested


def test_comes_back_down_to_the_base_when_there_is_headroom():
    samples = [busy(t) for t in range(0, 11)] + [busy(t, gbps=1.0) for t in range(11, 60)]
    controller, thresholds = run(samples)
    assert thresholds[10] == 8192
    assert thresholds[15] == 4096 and thresholds[20] == 2048 and thresholds[25] == 1024
    assert thresholds[-1] == 1024 and controller.state == "base"


def test_holds_between_the_bands_and_does_not_flap_around_a_boundary():
    # Utilization wobbling around 0.85 raises once (it crossed), then stays: dips stay above 0.6.
    samples = [busy(t * 0.5, gbps=8.6 if t % 2 else 8.4) for t in range(1, 60)]
    controller, thresholds = run(samples)
    changes = sum(1 for a, b in zip(thresholds, thresholds[1:]) if a != b)
    assert thresholds[0] == 2048 and thresholds[-1] == 8192
    assert changes <= 2
    _, wobble = run([busy(t, gbps=g) for t, g in enumerate([7.0, 8.0, 6.5, 8.4, 6.1] * 6)])
    assert set(wobble) == {1024}


def test_hold_time_spaces_changes():
    samples = [busy(0), busy(1), busy(4.9), busy(5.0), busy(5.1, gbps=0.1), busy(9.9, gbps=0.1), busy(10, gbps=0.1)]
    _, thresholds = run(samples)
    assert thresholds == [2048, 2048, 2048, 4096, 4096, 4096, 2048]


def test_offloading_stops_without_usable_workers_and_resumes_after_the_hold():
    samples = [busy(0, gbps=1), busy(1, gbps=0, num_usable_workers=0), busy(2, gbps=0),
               busy(6.5, gbps=0), busy(7, gbps=0), busy(8, gbps=0, num_usable_workers=0), busy(9, gbps=0)]
    controller, thresholds = run(samples)
    assert thresholds[0] == 1024
    assert thresholds[1:4] == [math.inf] * 3
    assert thresholds[4] == 1024
    assert thresholds[5:] == [math.inf, math.inf]
    assert controller.observe(busy(14, gbps=0)) == 1024 and controller.offloading


def test_small_base_thresholds_still_move():
    config = CongestionControllerConfig(base_threshold_tokens=0, max_threshold_tokens=2048, link_capacity_gbps=1,
                                        hold_s=0, min_step_tokens=128)
    _, thresholds = run([busy(t, gbps=1) for t in range(3)], config)
    assert thresholds == [128, 256, 384]


@pytest.mark.parametrize("kwargs", [
    {"lower_utilization": 0.9},
    {"step": 1.0},
    {"base_threshold_tokens": 9000},
    {"link_capacity_gbps": 0},
])
def test_bad_controller_config_is_refused(kwargs):
    base = {"base_threshold_tokens": 1024, "max_threshold_tokens": 8192, "link_capacity_gbps": 10}
    with pytest.raises(ValueError):
        CongestionControllerConfig(**{**base, **kwargs})


def stats(bytes_sent=0, retransmits=0, failed=0, rtt_ms=1.0, waiting=0):
    link = LinkStats(peer="127.0.0.1:1", bytes_sent=bytes_sent, retransmits=retransmits,
                     transfers_failed=failed, rtt_ms=rtt_ms)
    return WorkerStats(kv_links=(link,), num_waiting_requests=waiting)


def test_link_signals_difference_successive_stats():
    signals = LinkSignals()
    first = signals.sample(0.0, [("p0", True, stats())])
    assert first.egress_gbps == 0 and first.num_usable_workers == 1
    second = signals.sample(1.0, [("p0", True, stats(bytes_sent=125_000_000, retransmits=864, rtt_ms=31.0,
                                                      waiting=3))])
    assert second.egress_gbps == pytest.approx(1.0)
    assert second.retransmit_ratio == pytest.approx(0.01, rel=0.01)
    assert second.rtt_increase_ms == pytest.approx(30.0)
    assert second.num_queued == 3


def test_failed_transfers_or_ill_health_make_a_worker_unusable():
    signals = LinkSignals()
    signals.sample(0.0, [("p0", True, stats()), ("p1", True, stats())])
    sample = signals.sample(1.0, [("p0", True, stats(failed=1)), ("p1", False, stats())])
    assert sample.num_usable_workers == 0
    assert signals.sample(2.0, [("p0", True, stats(failed=1)), ("p1", True, stats())]).num_usable_workers == 2


def test_router_loop_sets_the_dispatch_threshold_and_metrics():
    from types import SimpleNamespace

    from services.config import parse_config
    from services.router.metrics import RouterMetrics
    from services.scheduling.placement import WorkerView, choose_route
    from services.router.placement import Placement
    from services.router.threshold_control import ThresholdControl

    config = parse_config({"workers": [{"name": "p0", "service": "prefill_worker", "cluster": "prfaas", "port": 1},
                                       {"name": "d0", "port": 2, "kv_port": 3}],
                           "scheduler": {"adaptive_threshold": True, "threshold_hold_s": 0}})
    prefill = SimpleNamespace(name="p0", healthy=True, prefill=object(), config=config.workers[0], stats=stats(),
                              num_handoffs_waiting=0)
    pool = SimpleNamespace(handles=(prefill,))
    clock = iter(range(100))
    metrics = RouterMetrics()
    control = ThresholdControl(config, pool, metrics, clock=lambda: next(clock))
    placement = Placement(config, pool, metrics, threshold=control.controller)  # reads the one owner
    control.on_poll()
    assert placement.threshold_tokens == 1024
    prefill.healthy = False
    control.on_poll()
    assert placement.threshold_tokens == math.inf
    assert metrics.controller_state.labels("stopped")._value.get() == 1
    assert metrics.threshold._value.get() == math.inf
    workers = (WorkerView("p0", True, cluster="prfaas", generates=False, prefills=True),
               WorkerView("d0", True, receives_kv=True))
    assert choose_route(workers, 100_000, placement.threshold_tokens).path == "local"
    assert choose_route(workers, 100_000, 1024).path == "prfaas"


def test_link_signals_rate_over_distinct_snapshots_and_forget_stale_ones():
    """Snapshots come once a second (with the engine's forwards); polls twice as often must not
    read 0 and 2x the rate, and a snapshot left over from the last busy second is no congestion."""
    signals = LinkSignals()
    signals.sample(0.0, [("p0", True, stats())])
    readings = [signals.sample(0.5 * i, [("p0", True, stats(bytes_sent=125_000_000 * (i // 2), rtt_ms=31.0))])
                for i in range(1, 7)]
    assert [r.egress_gbps for r in readings[1:]] == pytest.approx([1.0] * 5)
    assert all(r.rtt_increase_ms == pytest.approx(30.0) for r in readings[1:])
    idle = signals.sample(10.0, [("p0", True, stats(bytes_sent=375_000_000, rtt_ms=31.0))])
    assert idle.egress_gbps == idle.rtt_increase_ms == 0


def test_requests_waiting_at_the_router_for_a_hand_off_count_in_the_prfaas_queue():
    """The router holds back hand-offs past ``router.max_handoffs_per_prefill_worker``, so the worker's
    own queue stays short while the link is squeezed; the controller must still see the backlog (a
    10x bandwidth cut kept every long prompt on the PrfaaS path for the whole cut in the chaos soak)."""
    from types import SimpleNamespace

    from services.config import parse_config
    from services.router.metrics import RouterMetrics
    from services.router.threshold_control import ThresholdControl

    config = parse_config({"workers": [{"name": "p0", "service": "prefill_worker", "cluster": "prfaas", "port": 1},
                                       {"name": "d0", "port": 2, "kv_port": 3}],
                           "scheduler": {"adaptive_threshold": True, "threshold_hold_s": 0}})
    prefill = SimpleNamespace(name="p0", healthy=True, prefill=object(), config=config.workers[0],
                              stats=stats(waiting=2), num_handoffs_waiting=0)
    clock = iter(range(100))
    control = ThresholdControl(config, SimpleNamespace(handles=(prefill,)), RouterMetrics(), clock=lambda: next(clock))
    control.on_poll()
    control.on_poll()
    assert control.controller.threshold_tokens == 1024 and not control.controller.congested
    prefill.num_handoffs_waiting = 12
    control.on_poll()
    assert control.controller.congested and control.controller.threshold_tokens > 1024

    signals = LinkSignals()
    assert signals.sample(0.0, [("p0", True, stats(waiting=2))], {"p0": 12, "p1": 5}).num_queued == 14
