"""A Prefill call fails as soon as its KV transfer failed at the sender (services/engine/kv_sends.py)."""
from __future__ import annotations

import asyncio
import time

import pytest

from services.engine.kv_sends import KvSendFailed, KvSendWatch
from services.engine.serve import CallerGuard
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


class Aborted(Exception):
    pass


class Context:
    """What a gRPC servicer's context does here: ``abort`` ends the call with a status."""

    async def abort(self, code, details):
        raise Aborted(code, details)

    def peer(self) -> str:
        return "ipv4:127.0.0.1:1"


class Engine:
    """An engine whose prefill yields ``deltas`` slowly, and whose connector publishes ``published``."""

    def __init__(self, deltas, published: Published) -> None:
        self._deltas, self._published, self.closed = deltas, published, False

    async def generate(self, request):
        try:
            for delta in self._deltas:
                await asyncio.sleep(0.3)
                yield delta
        finally:
            self.closed = True

    def stats(self):
        from services.kv_connector.snapshot import ConnectorSnapshot
        from services.worker_api.types import EngineStats

        snapshot = self._published()
        return EngineStats(kv_connector=ConnectorSnapshot(snapshot) if snapshot is not None else None)


def _prefill(engine: Engine, kv_target: str = "127.0.0.1:9"):
    from types import SimpleNamespace

    from prfaas.v1 import worker_pb2 as pb

    from services.engine import worker_rpc

    guard = CallerGuard(kv_targets=SimpleNamespace(refusal=lambda target, tp_size: None), rejections=None)
    request = pb.PrefillRequest(request_id="req-1", prompt_token_ids=[1, 2, 3], kv_target=kv_target)
    return asyncio.run(worker_rpc.prefill(engine, guard, request, Context()))


def test_a_prefill_call_ends_aborted_when_its_kv_transfer_fails():
    import grpc

    published = Published(TransportSnapshot(sends_failed=(("req-1", "KV connection to 127.0.0.1:9 failed"),)))
    engine = Engine([TokenDelta("", (), None, 3, 0), _delta()], published)
    with pytest.raises(Aborted) as raised:
        _prefill(engine)
    assert raised.value.args[0] == grpc.StatusCode.ABORTED and "KV connection to 127.0.0.1:9 failed" in \
        raised.value.args[1]
    assert engine.closed


@pytest.mark.parametrize("deltas", [[], [TokenDelta("", (), "abort", 3, 0)]])
def test_a_prefill_the_engine_dropped_is_no_success(deltas):
    import grpc

    with pytest.raises(Aborted) as raised:
        _prefill(Engine(deltas, Published()), kv_target="")
    assert raised.value.args[0] == grpc.StatusCode.ABORTED and "unfinished" in raised.value.args[1]


def test_a_prefill_whose_kv_left_returns_its_counts():
    reply = _prefill(Engine([_delta()], Published(TransportSnapshot())))
    assert reply.num_prompt_tokens == 600
