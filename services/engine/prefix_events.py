"""What the engine's prefix cache holds, kept by the worker from vLLM's KV-cache events
(``kv_events_config``: BlockStored / BlockRemoved / AllBlocksCleared, read from the engine core's
ZMQ publisher on a socket in the worker's private IPC directory) and streamed to every router
(``WatchPrefixCache``).

Blocks are renamed from the engine's hashes to the project's chain (``vllm_block_hashes``: sha256 of
the parent's hash and the block's tokens), so a router compares a prompt's blocks with them whatever
hash the engine uses. A block whose parent the worker never saw stored (none should be: the worker
subscribes before its engine serves) is skipped. ``PrefixCacheIndex`` is plain (no ZMQ, no gRPC)."""
from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable
from dataclasses import dataclass, field

from services.cache_pool_client.hashing import hash_block_tokens, none_hash
from services.worker_api.types import PrefixUpdate

logger = logging.getLogger(__name__)

SNAPSHOT_CHUNK = 4096   # block hashes per snapshot message (32 bytes each: ~128 KiB)
SUBSCRIBER_QUEUE = 1024  # updates a router's stream may fall behind before it is ended


@dataclass(slots=True)
class Subscriber:
    updates: asyncio.Queue = field(default_factory=lambda: asyncio.Queue(SUBSCRIBER_QUEUE))
    overflowed: bool = False


class PrefixCacheIndex:
    """The engine's cached full blocks of its first KV-cache group, by the project's chained hash."""

    def __init__(self) -> None:
        self.block_size = 0
        self._ours: dict[object, bytes] = {}  # the engine's block hash -> ours
        self._subscribers: list[Subscriber] = []
        self._root = none_hash()

    @property
    def num_blocks(self) -> int:
        return len(self._ours)

    def apply(self, events: Iterable[object]) -> None:
        """vLLM's events of one batch, in order (BlockStored, BlockRemoved, AllBlocksCleared by class name)."""
        for event in events:
            kind = type(event).__name__
            if getattr(event, "group_idx", None) not in (None, 0):
                continue
            if kind == "BlockStored":
                self._stored(event)
            elif kind == "BlockRemoved":
                removed = tuple(self._ours.pop(h) for h in event.block_hashes if h in self._ours)
                if removed:
                    self._publish(PrefixUpdate(block_size=self.block_size, removed=removed))
            elif kind == "AllBlocksCleared":
                self._ours.clear()
                self._publish(PrefixUpdate(reset=True, block_size=self.block_size))

    def _stored(self, event) -> None:
        if event.parent_block_hash is None:
            parent = self._root
        elif (parent := self._ours.get(event.parent_block_hash)) is None:
            return
        size = event.block_size
        self.block_size = size
        stored = []
        for i, engine_hash in enumerate(event.block_hashes):
            tokens = event.token_ids[i * size:(i + 1) * size]
            if len(tokens) < size:
                break
            parent = hash_block_tokens(parent, tokens)
            self._ours[engine_hash] = parent
            stored.append(parent)
        if stored:
            self._publish(PrefixUpdate(block_size=size, stored=tuple(stored)))

    def subscribe(self) -> tuple[Subscriber, list[PrefixUpdate]]:
        """A new router's stream: its snapshot now, then every update through ``Subscriber.updates``."""
        subscriber = Subscriber()
        self._subscribers.append(subscriber)
        blocks = list(self._ours.values())
        chunks = [tuple(blocks[i:i + SNAPSHOT_CHUNK]) for i in range(0, len(blocks), SNAPSHOT_CHUNK)] or [()]
        snapshot = [PrefixUpdate(reset=i == 0, block_size=self.block_size, stored=chunk)
                    for i, chunk in enumerate(chunks)]
        return subscriber, snapshot

    def unsubscribe(self, subscriber: Subscriber) -> None:
        if subscriber in self._subscribers:
            self._subscribers.remove(subscriber)

    def _publish(self, update: PrefixUpdate) -> None:
        for subscriber in self._subscribers:
            try:
                subscriber.updates.put_nowait(update)
            except asyncio.QueueFull:
                subscriber.overflowed = True


async def follow_engine_events(index: PrefixCacheIndex, endpoint: str) -> None:
    """Reads the engine core's KV-event publisher at ``endpoint`` until cancelled."""
    import msgspec
    import zmq
    import zmq.asyncio
    from vllm.distributed.kv_events import KVEventBatch

    decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
    context = zmq.asyncio.Context()
    socket = context.socket(zmq.SUB)
    socket.setsockopt(zmq.SUBSCRIBE, b"")
    socket.connect(endpoint)
    try:
        while True:
            _topic, _seq, payload = await socket.recv_multipart()
            try:
                index.apply(decoder.decode(payload).events)
            except msgspec.DecodeError as exc:
                logger.warning("undecodable KV-event batch: %s", exc)
    finally:
        socket.close(linger=0)
        context.term()
