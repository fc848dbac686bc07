"""A Prefill call fails as soon as its KV transfer failed at the sender (services/engine/kv_sends.py)."""
from __future__ import annotations

import asyncio
import time

import pytest

from services.engine.kv_sends import KvSendFailed, KvSendWatch
from services.kv_transport.telemetry import TransportSnapshot
from services.worker_api.types import TokenDelta


class Published:
    """What the connector's snapshot says, changed by the test as time goes."""

    def __init__(self, snapshot: TransportSnapshot | None = None) -> None:
        self.snapshot = snapshot

    def __call__(self) -> TransportSnapshot | None:
        return self.snapshot


def _delta() -> TokenDelta:
    return TokenDelta("x", (1,), "length", 600, 0)


async def _slow_prefill(seconds: float, closed: list[bool]):
    try:
        await asyncio.sleep(seconds)
        yield _delta()
    finally:
        closed.append(True)


@pytest.mark.parametrize("wire_id", ["req-1", "req-1#p0", "req-1#p1"])
def test_a_failure_during_the_prefill_ends_it_at_once(wire_id):
    published, closed = Published(TransportSnapshot(sends_pending=(wire_id,))), []

    async def run():
        asyncio.get_running_loop().call_later(0.2, lambda: setattr(
            published, "snapshot", TransportSnapshot(sends_failed=((wire_id, "KV connection to x failed"),))))
        await KvSendWatch("req-1", published).prefill(_slow_prefill(30, closed))

    started = time.monotonic()
    with pytest.raises(KvSendFailed, match="KV connection to x failed"):
        asyncio.run(run())
    assert time.monotonic() - started < 1.0 and closed == [True]


@pytest.mark.parametrize("snapshot", [None, TransportSnapshot(), TransportSnapshot(
    sends_failed=(("req-10", "another request"), ("other#p0", "another request")))])
def test_a_prefill_whose_transfer_did_not_fail_returns_its_last_delta(snapshot):
    closed = []
    last = asyncio.run(KvSendWatch("req-1", Published(snapshot)).prefill(_slow_prefill(0.15, closed)))
    assert last == _delta()


def test_after_the_prefill_the_call_waits_for_its_transfer_to_leave_the_sender():
    published = Published(TransportSnapshot(sends_pending=("req-1",)))

    async def run():
        asyncio.get_running_loop().call_later(0.8, lambda: setattr(published, "snapshot", TransportSnapshot()))
        await KvSendWatch("req-1", published).wait_for_sent()

    started = time.monotonic()
    asyncio.run(run())
    assert 0.8 <= time.monotonic() - started < 1.3


def test_a_failure_published_just_after_the_prefill_still_fails_the_call():
    published = Published(TransportSnapshot())

    async def run():
        asyncio.get_running_loop().call_later(0.3, lambda: setattr(
            published, "snapshot", TransportSnapshot(sends_failed=(("req-1", "no progress for 10 s"),))))
        await KvSendWatch("req-1", published).wait_for_sent()

    with pytest.raises(KvSendFailed, match="no progress"):
        asyncio.run(run())


def test_a_transfer_never_seen_pending_is_sent_once_the_snapshot_settled():
    started = time.monotonic()
    asyncio.run(KvSendWatch("req-1", Published(TransportSnapshot())).wait_for_sent())
    assert time.monotonic() - started < 1.0


def test_the_snapshot_carries_sends_through_its_file_form():
    snapshot = TransportSnapshot(sends_pending=("a#p0",), sends_failed=(("b", "why"),))
    assert TransportSnapshot.from_dict(snapshot.as_dict()) == snapshot
    assert TransportSnapshot.summed([snapshot, TransportSnapshot(sends_pending=("a#p1",))]).sends_pending == \
        ("a#p0", "a#p1")
