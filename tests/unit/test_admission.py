"""Admission control: the pure decision, the prefill-queue rate estimate, QoS class resolution."""
import pytest

from services.config import parse_config
from services.router.admission import AdmissionControl, PrefillQueues
from services.router.errors import ApiError
from services.router.metrics import RouterMetrics
from services.scheduling.admission import (
    AdmissionSnapshot,
    PrefillQueue,
    QosClass,
    admit,
    class_limit,
    predicted_ttft_s,
)
from services.scheduling.placement import Route

GOLD = QosClass("gold", priority=10, reserved_fraction=0.25, ttft_slo_s=2.0)
SILVER = QosClass("silver", priority=5, reserved_fraction=0.25, ttft_slo_s=5.0)
BRONZE = QosClass("bronze", priority=0, ttft_slo_s=0.0)
CLASSES = (GOLD, SILVER, BRONZE)


def snapshot(num_in_flight=0, capacity=8, queued=0, rate=None, can_serve=True):
    return AdmissionSnapshot(can_serve=can_serve, capacity=capacity, num_in_flight=num_in_flight,
                             num_queued_prefill_tokens=queued, prefill_tokens_per_s=rate)


@pytest.mark.parametrize("qos, limit", [(GOLD, 8), (SILVER, 6), (BRONZE, 4)])
def test_each_class_may_use_what_higher_classes_do_not_reserve(qos, limit):
    assert class_limit(qos, CLASSES, 8) == limit


@pytest.mark.parametrize("qos, in_flight, queued, rate, reason", [
    (BRONZE, 0, 0, None, None),
    (BRONZE, 3, 0, None, None),
    (BRONZE, 4, 0, None, "capacity"),       # lowest class refused first
    (SILVER, 4, 0, None, None),
    (SILVER, 6, 0, None, "capacity"),
    (GOLD, 6, 0, None, None),               # the reserved share stays free for gold
    (GOLD, 7, 0, None, None),
    (GOLD, 8, 0, None, "capacity"),
    (GOLD, 0, 1000, 1000.0, None),          # (1000 + 500) / 1000 = 1.5 s <= 2 s
    (GOLD, 0, 2000, 1000.0, "ttft_slo"),    # 2.5 s > 2 s
    (SILVER, 0, 2000, 1000.0, None),        # same queue, looser SLO
    (BRONZE, 0, 10**6, 1000.0, None),       # no SLO
    (GOLD, 0, 10**6, None, None),           # rate unknown: no TTFT check
])
def test_admission_table(qos, in_flight, queued, rate, reason):
    rejection = admit(qos, CLASSES, 500, snapshot(in_flight, queued=queued, rate=rate))
    assert (rejection.reason if rejection else None) == reason
    if rejection:
        assert rejection.status == 429 and rejection.retry_after_s >= 1


def test_nothing_can_serve_is_a_503():
    rejection = admit(GOLD, CLASSES, 10, snapshot(can_serve=False), retry_after_s=3)
    assert (rejection.status, rejection.reason, rejection.retry_after_s) == (503, "no_worker", 3)


def test_ttft_retry_after_is_the_predicted_excess_capped():
    assert admit(GOLD, CLASSES, 0, snapshot(queued=5500, rate=1000.0)).retry_after_s == 4
    assert admit(GOLD, CLASSES, 0, snapshot(queued=10**9, rate=1000.0)).retry_after_s == 60


def test_predicted_ttft():
    assert predicted_ttft_s(100, snapshot(queued=300, rate=200.0)) == 2.0
    assert predicted_ttft_s(100, snapshot(queued=300, rate=None)) is None


def test_prefill_queue_measures_tokens_per_busy_second():
    queue = PrefillQueue(configured_tokens_per_s=50.0)
    assert queue.tokens_per_s == 50.0
    queue.enqueue(100, 0.0)
    queue.enqueue(300, 0.5)
    assert (queue.num_queued, queue.num_queued_tokens) == (2, 400)
    queue.dequeue(100, 1.0, prefilled=True)
    queue.dequeue(300, 2.0, prefilled=True)
    assert queue.tokens_per_s == 200.0              # 400 tokens in 2 busy seconds
    queue.enqueue(1000, 100.0)                      # idle time in between does not count
    queue.dequeue(1000, 101.0, prefilled=False)     # failed: busy time, no tokens
    assert queue.tokens_per_s == pytest.approx(400 / 3)
    assert (queue.num_queued, queue.num_queued_tokens) == (0, 0)


def test_prefill_queue_window_forgets_old_rates():
    queue = PrefillQueue(window_s=10.0)
    queue.enqueue(100, 0.0)
    queue.dequeue(100, 100.0, prefilled=True)      # 1 token/s over 100 s, scaled into the window
    queue.enqueue(10_000, 200.0)
    queue.dequeue(10_000, 210.0, prefilled=True)   # 1000 tokens/s
    assert queue.tokens_per_s > 400


class FakePool:
    """Admission reads the pool's workers only (none here); the route comes from the dispatcher."""

    handles = ()

    def views(self):
        return ()


LOCAL = Route("local", "d0")


def control(scheduler):
    config = parse_config({"workers": [{"name": "d0", "port": 50071}],
                           "scheduler": {"admission_control": True, **scheduler}})
    metrics = RouterMetrics()
    queues = PrefillQueues(config.scheduler.prefill_tokens_per_s, metrics, clock=lambda: 0.0)
    return AdmissionControl(config, FakePool(), queues, metrics), metrics


QOS = {"qos_classes": [{"name": "gold", "priority": 10, "reserved_fraction": 0.5, "api_keys": ["k-gold"]},
                       {"name": "free", "priority": 0, "api_keys": ["k-free"]}],
       "default_qos_class": "free", "max_in_flight_requests": 2}


@pytest.mark.parametrize("header, key, expected", [
    (None, None, "free"),
    (None, "k-gold", "gold"),
    ("gold", None, "gold"),
    (" free ", "k-gold", "free"),     # a key's holder may step down
    (None, "unmapped", "free"),
])
def test_qos_class_from_header_or_key(header, key, expected):
    admission, _ = control(QOS)
    assert admission.qos_class(header, key).name == expected


@pytest.mark.parametrize("header, key, status, code", [
    ("platinum", None, 400, "unknown_qos_class"),
    ("gold", "k-free", 403, "qos_class_not_allowed"),
])
def test_bad_qos_header(header, key, status, code):
    admission, _ = control(QOS)
    with pytest.raises(ApiError) as excinfo:
        admission.qos_class(header, key)
    assert (excinfo.value.status, excinfo.value.code, excinfo.value.param) == (status, code, "X-PrfaaS-QoS")


def test_without_classes_there_is_one_default_class():
    admission, _ = control({})
    assert admission.qos_class(None, None).name == "default"
    with pytest.raises(ApiError):
        admission.qos_class("gold", None)


def test_admitted_counts_in_flight_and_rejects_with_retry_after():
    admission, metrics = control({**QOS, "retry_after_s": 2})
    gold, free = admission.qos_class("gold", None), admission.qos_class("free", None)
    with admission.admitted("r1", free, LOCAL, 10):
        with pytest.raises(ApiError) as excinfo:
            with admission.admitted("r2", free, LOCAL, 10):
                pass
        assert excinfo.value.status == 429 and excinfo.value.headers == {"Retry-After": "2"}
        with admission.admitted("r3", gold, LOCAL, 10):
            assert admission.num_in_flight == 2
    assert admission.num_in_flight == 0
    assert metrics.rejected.labels("capacity", "free")._value.get() == 1
    assert metrics.admitted.labels("gold")._value.get() == 1


def test_no_route_is_a_503_with_retry_after():
    admission, metrics = control({"retry_after_s": 5})
    with pytest.raises(ApiError) as excinfo:
        with admission.admitted("r1", admission.qos_class(None, None), None, 10):
            pass
    assert excinfo.value.status == 503 and excinfo.value.headers == {"Retry-After": "5"}
    assert excinfo.value.body()["error"]["type"] == "service_unavailable"
    assert metrics.rejected.labels("no_worker", "default")._value.get() == 1


def test_configured_prefill_rate_drives_ttft_rejection():
    admission, _ = control({"prefill_tokens_per_s": {"local": 100.0}, "max_in_flight_requests": 4,
                            "qos_classes": [{"name": "default", "ttft_slo_ms": 1000}]})
    qos = admission.qos_class(None, None)
    with admission.admitted("r1", qos, LOCAL, 90):
        pass
    with pytest.raises(ApiError) as excinfo:
        with admission.admitted("r2", qos, LOCAL, 150):
            pass
    assert excinfo.value.code == "ttft_slo" and excinfo.value.body()["error"]["type"] == "rate_limit_error"


def test_errors_raised_while_admitted_pass_through_and_release_the_slot():
    admission, _ = control({"max_in_flight_requests": 1})
    with pytest.raises(ApiError) as excinfo:
        with admission.admitted("r1", admission.qos_class(None, None), LOCAL, 10):
            raise ApiError(503, "worker failed", type="service_unavailable")
    assert excinfo.value.message == "worker failed"
    assert admission.num_in_flight == 0
