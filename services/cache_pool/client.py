"""Async client of one cache pool (grpc.aio); callers see domain types only.

On the pool's host (``Describe`` offers a shared-memory directory and its probe file reads back
right), block bytes go through files there (``shm``): a Put writes one file per block and sends
only names, a Get reads the files the pool names; one copy each, in a worker thread so the event
loop keeps running. Elsewhere, or when the files cannot be written (a full tmpfs), Put and Get move
bytes inline in messages of about ``MESSAGE_BYTES`` each, one after another: a prompt's blocks can
be far larger than gRPC's message limit, and small messages keep the buffers of both ends reused
instead of freshly mapped for every call (fresh pages cost more than the copy).
"""
from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import secrets
from collections.abc import Sequence

import grpc
from prfaas.v1 import cache_pool_pb2 as pb
from prfaas.v1 import cache_pool_pb2_grpc as pb_grpc

from services.cache_pool import convert, shm
from services.cache_pool.server import GRPC_OPTIONS
from services.cache_pool.types import Block, BlockMissingError, LookupQuery, LookupResult, PoolStats, PutResult

logger = logging.getLogger(__name__)

MESSAGE_BYTES = 16 << 20


class CachePoolClient:
    def __init__(self, address: str, shared_memory: bool = True) -> None:
        """``shared_memory`` False: always inline bytes, even on the pool's host."""
        self.address = address
        self._channel = grpc.aio.insecure_channel(address, options=GRPC_OPTIONS)
        self._stub = pb_grpc.CachePoolStub(self._channel)
        self._shared_memory = shared_memory
        self._described: pb.DescribeResponse | None = None
        self._shm_dir: str | None = None
        self._names = itertools.count()
        self._token = secrets.token_hex(4)

    async def describe(self) -> pb.DescribeResponse:
        """The pool's ``Describe`` answer (asked once; a pool without the call offers nothing)."""
        if self._described is None:
            try:
                described = await self._stub.Describe(pb.DescribeRequest())
            except grpc.aio.AioRpcError as exc:
                if exc.code() != grpc.StatusCode.UNIMPLEMENTED:
                    raise
                described = pb.DescribeResponse()
            info = described.shared_memory
            if self._shared_memory:
                self._shm_dir = shm.same_host_directory(info.directory, info.probe_file, info.probe_token)
            self._described = described
        return self._described

    async def shared_memory_dir(self) -> str | None:
        """The pool's shared-memory directory when this process shares it, else None."""
        await self.describe()
        return self._shm_dir

    async def kv_address(self) -> str | None:
        """``host:port`` of the pool's KV transport listener (its gRPC host), None when it has none."""
        kv_port = (await self.describe()).kv_port
        return f"{self.address.rpartition(':')[0]}:{kv_port}" if kv_port else None

    async def push(self, model: str, refs: Sequence[tuple[int, bytes]], kv_target: str, kv_transfer_id: str) -> PutResult:
        """Have the pool send these blocks to another pool's KV listener (``kv_address``), which
        stores them on ``put_pushed`` with the same ``kv_transfer_id``."""
        response = await self._stub.Push(pb.PushRequest(
            model=model, kv_target=kv_target, kv_transfer_id=kv_transfer_id,
            blocks=[pb.CacheBlockRef(group_id=g, block_hash=h) for g, h in refs]))
        return PutResult(response.num_blocks, response.num_bytes)

    async def put_pushed(self, model: str, refs: Sequence[tuple[int, bytes]], kv_transfer_id: str) -> PutResult:
        """Store the blocks another pool pushes here as ``kv_transfer_id`` (waits for them)."""
        request = pb.PutRequest(model=model, kv_transfer_id=kv_transfer_id,
                                blocks=[pb.CacheBlock(group_id=g, block_hash=h) for g, h in refs])
        response = await self._stub.Put(request)
        return PutResult(response.num_blocks_stored, response.num_bytes_stored)

    async def lookup(self, query: LookupQuery, timeout_s: float | None = None) -> LookupResult:
        response = await self._stub.Lookup(convert.lookup_query_to_proto(query), timeout=timeout_s)
        return convert.lookup_result_from_proto(response, query.block_size)

    async def put(self, model: str, blocks: list[Block], transfer_id: str = "") -> PutResult:
        """Stores ``blocks`` in prompt order: through shared memory, or in Puts of about
        ``MESSAGE_BYTES`` each."""
        if blocks and (directory := await self.shared_memory_dir()) is not None:
            names = [f"{shm.PUT_PREFIX}{os.getpid()}-{self._token}-{next(self._names):x}" for _ in blocks]
            try:
                await asyncio.to_thread(_write_files, directory, names, blocks)
            except OSError as exc:
                logger.warning("cache pool %s: block files not written to %s (%s); sending bytes inline",
                               self.address, directory, exc)
            else:
                request = pb.PutRequest(model=model, transfer_id=transfer_id)
                convert.add_blocks(request.blocks, [Block(b.group_id, b.block_hash, shm.ShmFile(n, len(b.data)))
                                                    for b, n in zip(blocks, names)])
                try:
                    response = await self._stub.Put(request)
                except BaseException:  # the pool took none of the files (or the call was cut short)
                    _remove_files(directory, names)
                    raise
                return PutResult(response.num_blocks_stored, response.num_bytes_stored)
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
        Through shared memory in one call, else about ``MESSAGE_BYTES`` at a time, sized from the
        blocks of the first (one block)."""
        if refs and (directory := await self.shared_memory_dir()) is not None:
            request = pb.GetRequest(model=model, shared_memory=True,
                                    blocks=[pb.CacheBlockRef(group_id=g, block_hash=h) for g, h in refs])
            return await asyncio.to_thread(_read_files, directory, (await self._stub.Get(request)).blocks, False)
        blocks: list[Block] = []
        while len(blocks) < len(refs):
            count = max(1, MESSAGE_BYTES // max(1, len(blocks[-1].data))) if blocks else 1
            batch = refs[len(blocks):len(blocks) + count]
            request = pb.GetRequest(model=model, blocks=[pb.CacheBlockRef(group_id=g, block_hash=h) for g, h in batch])
            blocks += _blocks((await self._stub.Get(request)).blocks)
        return blocks

    async def take_transfer(self, model: str, transfer_id: str) -> list[Block]:
        """A transfer's blocks, which the pool then frees (its files become ours, read and removed)."""
        directory = await self.shared_memory_dir()
        request = pb.GetRequest(model=model, transfer_id=transfer_id, shared_memory=directory is not None)
        messages = (await self._stub.Get(request)).blocks
        if directory is None:
            return _blocks(messages)
        return await asyncio.to_thread(_read_files, directory, messages, True)

    async def stats(self) -> PoolStats:
        response = await self._stub.GetStats(pb.CachePoolStatsRequest())
        return PoolStats(**{name: getattr(response, name) for name in PoolStats.__slots__})

    async def close(self) -> None:
        await self._channel.close()


def _blocks(messages) -> list[Block]:
    return [Block(m.group_id, m.block_hash, m.data) for m in messages]


def _write_files(directory: str, names: list[str], blocks: list[Block]) -> None:
    for i, (name, block) in enumerate(zip(names, blocks)):
        try:
            shm.write_file(os.path.join(directory, name), block.data)
        except OSError:
            _remove_files(directory, names[:i])
            raise


def _remove_files(directory: str, names: list[str]) -> None:
    for name in names:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(directory, name))


def _read_files(directory: str, messages, owned: bool) -> list[Block]:
    """Blocks of a Get answer, reading the files it names (inline ones as they are); ``owned``:
    the files are ours (a transfer's) and removed once read, or on failure."""
    blocks = []
    try:
        for m in messages:
            if not m.HasField("shm"):
                blocks.append(Block(m.group_id, m.block_hash, m.data))
                continue
            if "/" in m.shm.name:
                raise ValueError(f"the pool named a block file with a path: {m.shm.name!r}")
            try:
                data = shm.read_file(os.path.join(directory, m.shm.name), m.shm.size)
            except FileNotFoundError:
                raise BlockMissingError((m.group_id, m.block_hash)) from None
            blocks.append(Block(m.group_id, m.block_hash, data))
    finally:
        if owned:
            _remove_files(directory, [m.shm.name for m in messages if m.HasField("shm") and "/" not in m.shm.name])
    return blocks


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
