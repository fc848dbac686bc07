"""Async client of one cache pool (grpc.aio); callers see domain types only.

Block bytes take the best path the pool and this client share; gRPC always carries the metadata:

- on the pool's host (``Describe`` offers its arena and this process can map it): the arena
  (``arena_client``). A Put copies the blocks into slots the pool leased, a Get copies out of the
  slots the pool names and checks their generations; one copy each, none through gRPC;
- else, when the pool has a KV port and the client was given transport settings: the KV transport.
  A Put streams the blocks to the pool's listener, a Get has the pool push them to this client's;
- else: inline, in messages of about
  ``MESSAGE_BYTES`` each, one after another: a prompt's blocks can be far larger than gRPC's message
  limit, and small messages keep the buffers of both ends reused instead of freshly mapped for
  every call (fresh pages cost more than the copy).
"""
from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Sequence

import grpc
from prfaas.v1 import cache_pool_pb2 as pb
from prfaas.v1 import cache_pool_pb2_grpc as pb_grpc

from services.cache_pool_client import arena_client, convert
from services.cache_pool_client.arena import ArenaMapping
from services.cache_pool_client.inbox import TransferError, TransferInbox
from services.cache_pool_client.types import (Block, BlockMissingError, LookupQuery, LookupResult, Pieces, PoolStats,
                                      PutResult)
from services.kv_transport import KVTransport, TransportSettings
from services.security import GrpcSecurity

logger = logging.getLogger(__name__)

MESSAGE_BYTES = 16 << 20


class CachePoolClient:
    def __init__(self, address: str, shared_memory: bool = True, transport: TransportSettings | None = None,
                 kv_host: str = "", security: GrpcSecurity | None = None) -> None:
        """``security``: the deployment's gRPC credentials (``GrpcSecurity.of(config)``).
        ``shared_memory`` False: never through shared memory, even on the pool's host.
        ``transport``: where shared memory is not available and the pool has a KV port, Puts send
        the bytes over a KV transport of these settings, and Gets (with ``kv_host``, this host's
        address as the pool can reach it) have the pool push them to a listener opened here."""
        self.address = address
        self._kv_settings = transport
        self._kv_host = "" if kv_host in ("0.0.0.0", "::") else kv_host
        self._kv: TransferInbox | None = None
        self._kv_sender: KVTransport | None = None
        self._channel = (security or GrpcSecurity()).aio_channel(address)
        self._stub = pb_grpc.CachePoolStub(self._channel)
        self._shared_memory = shared_memory
        self._described: pb.DescribeResponse | None = None
        self._arena: ArenaMapping | None = None

    async def describe(self) -> pb.DescribeResponse:
        """The pool's ``Describe`` answer (asked once; a pool without the call offers nothing)."""
        if self._described is None:
            try:
                described = await self._stub.Describe(pb.DescribeRequest())
            except grpc.aio.AioRpcError as exc:
                if exc.code() != grpc.StatusCode.UNIMPLEMENTED:
                    raise
                described = pb.DescribeResponse()
            info = described.arena
            if self._shared_memory and described.HasField("arena"):
                self._arena = ArenaMapping.open(info.path, info.size, info.token)
            self._described = described
        return self._described

    async def arena(self) -> ArenaMapping | None:
        """The pool's arena, mapped here, when this process shares it; else None."""
        await self.describe()
        return self._arena

    def _forget_arena(self) -> None:
        """The pool restarted with another arena: describe it again on the next call (the old mapping
        stays alive as long as views of it do)."""
        self._described, self._arena = None, None

    async def kv_address(self) -> str | None:
        """``host:port`` of the pool's KV transport listener (its gRPC host), None when it has none."""
        kv_port = (await self.describe()).kv_port
        return f"{self.address.rpartition(':')[0]}:{kv_port}" if kv_port else None

    async def push(self, model: str, refs: Sequence[tuple[int, bytes]], kv_target: str,
                   kv_transfer_id: str) -> PutResult:
        """Have the pool send these blocks to another pool's KV listener (``kv_address``), which
        stores them on ``put_pushed`` with the same ``kv_transfer_id``."""
        response = await self._stub.Push(pb.PushRequest(
            model=model, kv_target=kv_target, kv_transfer_id=kv_transfer_id,
            blocks=[pb.CacheBlockRef(group_id=g, block_hash=h) for g, h in refs]))
        return PutResult(response.num_blocks, response.num_bytes)

    async def put_pushed(self, model: str, refs: Sequence[tuple[int, bytes]], kv_transfer_id: str,
                         transfer_id: str = "") -> PutResult:
        """Store the blocks pushed to the pool as ``kv_transfer_id`` (waits for them)."""
        request = pb.PutRequest(model=model, kv_transfer_id=kv_transfer_id, transfer_id=transfer_id,
                                blocks=[pb.CacheBlock(group_id=g, block_hash=h) for g, h in refs])
        response = await self._stub.Put(request)
        return PutResult(response.num_blocks_stored, response.num_bytes_stored)

    async def lookup(self, query: LookupQuery, timeout_s: float | None = None) -> LookupResult:
        response = await self._stub.Lookup(convert.lookup_query_to_proto(query), timeout=timeout_s)
        return convert.lookup_result_from_proto(response, query.block_size)

    async def put(self, model: str, blocks: list[Block], transfer_id: str = "") -> PutResult:
        """Stores ``blocks`` in prompt order: through shared memory, or in Puts of about
        ``MESSAGE_BYTES`` each."""
        if blocks and (arena := await self.arena()) is not None:
            try:
                return await arena_client.put(self._stub, arena, model, blocks, transfer_id)
            except arena_client.ArenaMoved:
                self._forget_arena()
                return await self.put(model, blocks, transfer_id)
        if blocks and self._kv_settings is not None and (kv_target := await self.kv_address()) is not None:
            kv_transfer_id = f"pool-put-{uuid.uuid4().hex}"
            await asyncio.to_thread(self._send_blocks, kv_target, kv_transfer_id, blocks)  # may wait: backpressure
            return await self.put_pushed(model, [(b.group_id, b.block_hash) for b in blocks], kv_transfer_id,
                                         transfer_id)
        num_blocks = num_bytes = 0
        for batch in _batches(blocks):
            request = pb.PutRequest(model=model, transfer_id=transfer_id)
            convert.add_blocks(request.blocks, batch)
            response = await self._stub.Put(request)
            num_blocks += response.num_blocks_stored
            num_bytes += response.num_bytes_stored
        return PutResult(num_blocks, num_bytes)

    async def get(self, model: str, refs: Sequence[tuple[int, bytes]]) -> list[Block]:
        """Raises ``grpc.aio.AioRpcError`` NOT_FOUND when any block is missing, or
        ``BlockMissingError`` when one was evicted while being read (treat either as a miss).
        Through the arena in one call, else about ``MESSAGE_BYTES`` at a time, sized from the
        blocks of the first (one block)."""
        blocks = await self.get_views(model, refs)
        return await asyncio.to_thread(arena_client.read, blocks)

    async def read_into(self, model: str, refs: Sequence[tuple[int, bytes]], targets: Sequence[Sequence]) -> None:
        """Copy each block into its target buffers (sizes adding up to the block's), e.g. an engine's
        or a benchmark's tensors; fails as ``get`` does."""
        blocks = await self.get_views(model, refs)
        await asyncio.to_thread(arena_client.read_into, blocks, targets)

    async def get_views(self, model: str, refs: Sequence[tuple[int, bytes]]) -> list[Block]:
        """As ``get``, but through the arena the blocks come as ``arena_client.ArenaView``s, not yet
        copied: copy them out, then check ``arena_client.intact`` (False: evicted meanwhile, a miss)."""
        if refs and (arena := await self.arena()) is not None:
            try:
                return await arena_client.get_views(self._stub, arena, model, refs)
            except arena_client.ArenaMoved:
                self._forget_arena()
                raise BlockMissingError("the pool restarted (a new arena) during the Get") from None
        if refs and self._kv_settings is not None and self._kv_host and await self.kv_address() is not None:
            return await self._get_pushed(model, refs)
        blocks: list[Block] = []
        while len(blocks) < len(refs):
            count = max(1, MESSAGE_BYTES // max(1, len(blocks[-1].data))) if blocks else 1
            batch = refs[len(blocks):len(blocks) + count]
            request = pb.GetRequest(model=model, blocks=[pb.CacheBlockRef(group_id=g, block_hash=h) for g, h in batch])
            blocks += _blocks((await self._stub.Get(request)).blocks)
        return blocks

    async def _get_pushed(self, model: str, refs: Sequence[tuple[int, bytes]]) -> list[Block]:
        """The pool pushes the blocks to this client's KV listener (opened on first use), at the
        address it sees this call come from."""
        inbox = self._kv_inbox()
        kv_transfer_id = f"pool-get-{uuid.uuid4().hex}"
        await self._stub.Push(pb.PushRequest(
            model=model, caller_kv_port=inbox.transport.port, kv_transfer_id=kv_transfer_id,
            blocks=[pb.CacheBlockRef(group_id=g, block_hash=h) for g, h in refs]))
        try:
            frames = await asyncio.to_thread(inbox.take, kv_transfer_id, self._kv_settings.recv_idle_timeout_s)
        except TransferError as exc:
            raise BlockMissingError(f"blocks pushed by the pool did not arrive: {exc}") from None
        by_index = {frame.block_index: frame for frame in frames}
        if sorted(by_index) != list(range(len(refs))):
            raise BlockMissingError(f"the pool pushed {len(frames)} frames for {len(refs)} blocks")
        return [Block(g, h, bytes(by_index[i].payload)) for i, (g, h) in enumerate(refs)]

    def _kv_inbox(self) -> TransferInbox:
        if self._kv is None:
            settings = self._kv_settings
            self._kv = TransferInbox(KVTransport(settings, listen_host=self._kv_host, listen_port=0),
                                     settings.recv_idle_timeout_s)
        return self._kv

    def _send_blocks(self, kv_target: str, kv_transfer_id: str, blocks: list[Block]) -> None:
        transport = self._kv_inbox().transport if self._kv_host else self._sender()
        for i, block in enumerate(blocks):
            transport.send_block(kv_target, kv_transfer_id, i, block.group_id, _inline(block.data))
        transport.finish(kv_target, kv_transfer_id)

    def _sender(self) -> KVTransport:
        """A send-only transport, for a client without an address the pool could reach."""
        if self._kv_sender is None:
            self._kv_sender = KVTransport(self._kv_settings)
        return self._kv_sender

    async def take_transfer(self, model: str, transfer_id: str) -> list[Block]:
        """A transfer's blocks (always inline), which the pool then frees."""
        return _blocks((await self._stub.Get(pb.GetRequest(model=model, transfer_id=transfer_id))).blocks)

    async def stats(self) -> PoolStats:
        response = await self._stub.GetStats(pb.CachePoolStatsRequest())
        return PoolStats(**{name: getattr(response, name) for name in PoolStats.__slots__})

    async def close(self) -> None:
        await self._channel.close()
        if self._kv is not None:
            self._kv.close()
        if self._kv_sender is not None:
            self._kv_sender.close()


def _blocks(messages) -> list[Block]:
    return [Block(m.group_id, m.block_hash, m.data) for m in messages]


def _inline(data):
    return bytes(data) if isinstance(data, Pieces) else data


def _batches(blocks: list[Block]) -> list[list[Block]]:
    """Consecutive runs of blocks of about ``MESSAGE_BYTES`` (at least one block each)."""
    batches: list[list[Block]] = [[]]
    num_bytes = 0
    for block in blocks:
        if batches[-1] and num_bytes + len(block.data) > MESSAGE_BYTES:
            batches.append([])
            num_bytes = 0
        batches[-1].append(block)
        num_bytes += len(block.data)
    return batches
