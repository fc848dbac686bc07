"""Admission on the predicted decode load at a request's completion."""
import pytest

from services.scheduling.admission import AdmissionSnapshot, QosClass, admit
from services.scheduling.decode_load import DecodeLoad, decode_overload

CAP = 10_000


def load(name="d", running=0, max_running=4, kv=0.0, committed=0, capacity=CAP):
    return DecodeLoad(name, running, max_running, kv, committed, capacity)


@pytest.mark.parametrize("worker, request_tokens, predicted", [
    (load(), 1000, 0.1),
    (load(kv=0.5), 1000, 0.6),
    (load(kv=0.2, committed=5000), 1000, 0.6),        # running requests grow to their committed size
    (load(kv=0.7, committed=5000), 1000, 0.8),        # usage above the commitment (e.g. another router)
    (load(capacity=0), 1000, None),
])
def test_predicted_kv_usage(worker, request_tokens, predicted):
    assert worker.predicted_kv_usage(request_tokens) == (pytest.approx(predicted) if predicted is not None else None)


@pytest.mark.parametrize("workers, request_tokens, overloaded", [
    ((load(),), 1000, False),
    ((load(running=4),), 1000, True),                              # no free sequence slot
    ((load(committed=9000),), 1000, False),                        # exactly at the limit of 1.0
    ((load(committed=9001),), 1000, True),
    ((load("a", committed=9500), load("b", committed=1000)), 1000, False),   # one worker fits
    ((load("a", running=4, capacity=0),), 10**9, True),
    ((load("a", capacity=0),), 10**9, False),                       # capacity unknown: slots only
    ((), 10, True),
])
def test_decode_overload(workers, request_tokens, overloaded):
    assert (decode_overload(workers, request_tokens, kv_limit=1.0) is not None) is overloaded


def test_admit_rejects_on_decode_load_with_a_429_and_a_reason():
    snap = AdmissionSnapshot(can_serve=True, capacity=8, num_in_flight=0, decode_workers=(load(committed=9000),),
                             decode_kv_limit=0.95)
    rejection = admit(QosClass("default"), (QosClass("default"),), 400, snap, retry_after_s=2, num_output_tokens=200)
    assert (rejection.status, rejection.reason, rejection.retry_after_s) == (429, "decode_load", 2)
    assert "predicted KV usage" in rejection.detail
    assert admit(QosClass("default"), (QosClass("default"),), 400, snap, num_output_tokens=0) is None
    off = AdmissionSnapshot(can_serve=True, capacity=8, num_in_flight=0)
    assert admit(QosClass("default"), (QosClass("default"),), 10**6, off, num_output_tokens=10**6) is None
