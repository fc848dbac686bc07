"""A Push returns once its blocks are queued: the KV transport's backpressure holds the pool's sender
thread, never a gRPC thread, and a full queue refuses the Push with RESOURCE_EXHAUSTED."""
from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import grpc
import pytest
from prfaas.v1 import cache_pool_pb2 as pb

from support.cache_pool import FULL, MODEL, blocks, hashes, prompt

from services.cache_pool.pool import CachePool
from services.cache_pool.server import CachePoolServicer, PoolIdentity

PROMPT = hashes(prompt(2))


class _StalledTransport:
    """A KV transport whose first send blocks until ``release`` (a peer that does not read)."""

    def __init__(self) -> None:
        self.sending = threading.Event()
        self.released = threading.Event()
        self.finished: list[str] = []

    def send_block(self, peer, transfer_id, index, group, payload) -> None:
        self.sending.set()
        assert self.released.wait(10)

    def finish(self, peer, transfer_id) -> None:
        self.finished.append(transfer_id)

    def close(self) -> None:
        self.released.set()


class _Aborted(Exception):
    def __init__(self, code, details) -> None:
        super().__init__(details)
        self.code, self.details = code, details


class _Context:
    def peer(self) -> str:
        return "ipv4:127.0.0.1:40000"

    def abort(self, code, details):
        raise _Aborted(code, details)


@pytest.fixture
def stalled():
    transport = _StalledTransport()
    pool = CachePool(1 << 20)
    pool.put(MODEL, blocks(FULL.group_id, PROMPT))
    inbox = SimpleNamespace(transport=transport, close=transport.close)
    servicer = CachePoolServicer(pool, PoolIdentity("pool-t", "local"), inbox, max_pending_pushes=2)
    yield servicer, transport
    servicer.close()


def _push(servicer, transfer_id: str) -> pb.PushResponse:
    request = pb.PushRequest(model=MODEL, kv_transfer_id=transfer_id, caller_kv_port=7000,
                             blocks=[pb.CacheBlockRef(group_id=FULL.group_id, block_hash=h) for h in PROMPT])
    return servicer.Push(request, _Context())


def test_a_push_returns_while_the_transport_is_stalled(stalled):
    servicer, transport = stalled
    started = time.monotonic()
    response = _push(servicer, "t-1")
    assert (response.num_blocks, response.num_bytes) == (2, 200)
    assert transport.sending.wait(5)  # the sender thread, not this one, waits for the peer
    assert time.monotonic() - started < 5
    transport.released.set()
    deadline = time.monotonic() + 5
    while transport.finished != ["t-1"]:
        assert time.monotonic() < deadline, "the queued push was never sent"
        time.sleep(0.01)


def test_a_full_queue_refuses_the_push_with_resource_exhausted(stalled):
    servicer, transport = stalled
    _push(servicer, "t-1")
    assert transport.sending.wait(5)  # t-1 is being sent: the queue is empty again
    _push(servicer, "t-2")
    _push(servicer, "t-3")
    with pytest.raises(_Aborted) as refused:
        _push(servicer, "t-4")
    assert refused.value.code is grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "2 pushes are already waiting" in refused.value.details and "t-4" in refused.value.details
    transport.released.set()
    deadline = time.monotonic() + 5
    while transport.finished != ["t-1", "t-2", "t-3"]:
        assert time.monotonic() < deadline, f"sent only {transport.finished}"
        time.sleep(0.01)
