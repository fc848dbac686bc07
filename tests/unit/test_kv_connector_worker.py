"""The consumer half of the connector's worker core: what it reports to vLLM about each receive.

The transport is replaced by a queue of events (this tests the worker layer alone); the real
transport and engines are covered by tests/e2e/test_kv_data_plane.py.
"""
from __future__ import annotations

import types

import pytest

from services.kv_connector import consumer as consumer_module
from services.kv_connector.consumer import Consumer, ReceiveSettings
from services.kv_connector.device.consumer import BlockLoader
from services.kv_connector.device.streams import Device
from services.kv_connector.metadata import PrfaasConnectorMetadata, RecvSpec
from services.kv_connector.layouts.reblock import ReblockPlans
from services.kv_transport import Frame, TransferDone, TransferFailed, protocol


class _Events:
    """Stands in for KVTransport: hands out queued events, records what was forgotten."""

    def __init__(self) -> None:
        self.pending: list = []
        self.forgotten: list[str] = []

    def poll(self, wait_s: float) -> list:
        events, self.pending = self.pending, []
        return events

    def forget(self, transfer_id: str) -> None:
        self.forgotten.append(transfer_id)


@pytest.fixture
def worker():
    layout = types.SimpleNamespace(fingerprint="layout")
    return Consumer(_Events(), layout, ReblockPlans(layout, None), BlockLoader(Device("cpu"), 1 << 10),
                    ReceiveSettings(10.0, 1 << 20, first_frame_timeout_s=60.0))


def _frame(transfer_id: str) -> Frame:
    """The first frame a producer sends: its layout fingerprint (matches the worker's layout)."""
    return Frame(transfer_id, 0, 0, 0, 0, memoryview(b"layout"), protocol.LAYOUT)


def _recv(req_id: str, transfer_id: str) -> RecvSpec:
    return RecvSpec(req_id, transfer_id, ((1, 2),), 0, 32)


def test_a_completed_receive_is_reported_once(worker):
    worker.on_metadata(PrfaasConnectorMetadata(recvs=[_recv("r1", "t1")]))
    worker.streams.pending.append(TransferDone("t1"))
    assert worker.get_transfer_results().finished_recving == {"r1"}
    assert worker.get_transfer_results().finished_recving == set()
    worker.on_metadata(PrfaasConnectorMetadata(abandoned=["t1"]))  # vLLM's request_finished after completion
    assert worker.get_transfer_results().finished_recving == set()


def test_a_failed_receive_is_finished_and_failed(worker):
    worker.on_metadata(PrfaasConnectorMetadata(recvs=[_recv("r1", "t1")]))
    worker.streams.pending.append(TransferFailed("t1", "checksum mismatch"))
    results = worker.get_transfer_results()
    assert results.finished_recving == results.failed_recving == {"r1"}
    assert worker.streams.forgotten == ["t1"]


def test_an_aborted_request_waiting_for_kv_releases_its_blocks(worker):
    """vLLM frees an aborted request's blocks only once its receive is reported finished."""
    worker.on_metadata(PrfaasConnectorMetadata(recvs=[_recv("r1", "t1")]))
    worker.get_transfer_results()
    worker.on_metadata(PrfaasConnectorMetadata(abandoned=["t1"]))
    results = worker.get_transfer_results()
    assert results.finished_recving == {"r1"} and results.failed_recving == set()
    assert worker.num_receiving == 0
    worker.streams.pending.append(TransferDone("t1"))  # frames still in flight are dropped
    assert worker.get_transfer_results().finished_recving == set()


def test_allocated_and_aborted_in_one_step(worker):
    worker.on_metadata(PrfaasConnectorMetadata(recvs=[_recv("r1", "t1")], abandoned=["t1"]))
    assert worker.get_transfer_results().finished_recving == {"r1"}


def test_kv_for_a_request_not_admitted_yet_waits_longer_than_the_idle_timeout(worker, monkeypatch):
    clock = [1000.0]
    monkeypatch.setattr(consumer_module.time, "monotonic", lambda: clock[0])
    worker.streams.pending.append(TransferDone("t1"))  # arrives before the engine allocated blocks
    worker.get_transfer_results()
    clock[0] += 60.0  # the request queues behind running ones
    worker.get_transfer_results()
    worker.on_metadata(PrfaasConnectorMetadata(recvs=[_recv("r1", "t1")]))
    assert worker.get_transfer_results().finished_recving == {"r1"}
    worker.streams.pending.append(TransferDone("t2"))
    worker.get_transfer_results()
    clock[0] += consumer_module.STAGED_TIMEOUT_S + 1
    worker.get_transfer_results()
    assert worker.streams.forgotten == ["t2"]  # no request ever claimed it


def test_a_receive_that_stalls_fails_after_the_idle_timeout(worker, monkeypatch):
    clock = [1000.0]
    monkeypatch.setattr(consumer_module.time, "monotonic", lambda: clock[0])
    worker.on_metadata(PrfaasConnectorMetadata(recvs=[_recv("r1", "t1")]))
    worker.streams.pending.append(TransferFailed("other", "x"))  # unrelated: t1 has seen nothing yet
    clock[0] += 11.0  # its prefill waits in the prefill engine's queue: not a stall
    assert worker.get_transfer_results().failed_recving == set()
    worker.streams.pending.append(_frame("t1"))
    worker.get_transfer_results()
    clock[0] += 9.0
    assert worker.get_transfer_results().failed_recving == set()
    clock[0] += 2.0  # KV flowed, then stopped for longer than the idle timeout
    assert worker.get_transfer_results().failed_recving == {"r1"}


def test_a_receive_whose_first_kv_never_comes_fails_after_the_first_frame_timeout(worker, monkeypatch):
    clock = [1000.0]
    monkeypatch.setattr(consumer_module.time, "monotonic", lambda: clock[0])
    worker.on_metadata(PrfaasConnectorMetadata(recvs=[_recv("r1", "t1")]))
    clock[0] += 59.0
    assert worker.get_transfer_results().failed_recving == set()
    clock[0] += 2.0
    assert worker.get_transfer_results().failed_recving == {"r1"}
