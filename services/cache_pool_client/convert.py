"""Protobuf ↔ domain types of the cache pool; requests are validated here (``ValueError`` names the field)."""
from __future__ import annotations

from prfaas.v1 import cache_pool_pb2 as pb

from services.cache_pool_client.arena import ArenaBlock, ArenaLayout
from services.cache_pool_client.types import Block, GroupKind, KvCacheGroup, LookupQuery, LookupResult, PoolStats

KIND_TO_PROTO = {
    GroupKind.FULL_ATTENTION: pb.GROUP_KIND_FULL_ATTENTION,
    GroupKind.LINEAR_ATTENTION: pb.GROUP_KIND_LINEAR_ATTENTION,
}
KIND_FROM_PROTO = {v: k for k, v in KIND_TO_PROTO.items()}


def lookup_query_from_proto(request: pb.LookupRequest) -> LookupQuery:
    _check_model(request.model)
    if request.block_size == 0:
        raise ValueError("block_size must be positive")
    if not request.groups:
        raise ValueError("groups is empty: list every KV-cache group of the model")
    groups = tuple(_group_from_proto(g, i) for i, g in enumerate(request.groups))
    if len({g.group_id for g in groups}) != len(groups):
        raise ValueError("groups: a group_id is listed twice")
    block_hashes = tuple(request.block_hashes)
    _check_hashes(block_hashes, "block_hashes")
    return LookupQuery(request.model, request.block_size, block_hashes, groups)


def lookup_query_to_proto(query: LookupQuery) -> pb.LookupRequest:
    return pb.LookupRequest(
        model=query.model, block_size=query.block_size, block_hashes=query.block_hashes,
        groups=[pb.KvCacheGroup(group_id=g.group_id, kind=KIND_TO_PROTO[g.kind]) for g in query.groups])


def lookup_response(result: LookupResult, pool: str, cluster: str) -> pb.LookupResponse:
    return pb.LookupResponse(
        pool=pool, cluster=cluster, num_usable_blocks=result.num_usable_blocks,
        num_usable_tokens=result.num_usable_tokens, num_full_attention_blocks=result.num_full_attention_blocks,
        model=result.model)


def lookup_result_from_proto(response: pb.LookupResponse, block_size: int) -> LookupResult:
    return LookupResult(response.num_usable_blocks, response.num_full_attention_blocks, block_size, response.model)


def blocks_from_proto(blocks) -> list[Block]:
    """Blocks with their bytes inline (arena Puts go through Reserve and Commit)."""
    result = []
    for i, block in enumerate(blocks):
        _check_hashes([block.block_hash], f"blocks[{i}].block_hash")
        if block.HasField("shm") or block.HasField("arena"):
            raise ValueError(f"blocks[{i}]: block files are no longer accepted; send data inline, or Reserve "
                             "arena slots (see Describe)")
        if not block.data:
            raise ValueError(f"blocks[{i}].data is empty")
        result.append(Block(block.group_id, block.block_hash, block.data))
    return result


def add_blocks(repeated, blocks: list[Block]) -> None:
    """Append blocks to a message's ``repeated CacheBlock`` field in place: building the messages
    first and passing them to a constructor copies every block's bytes twice. Blocks held in the
    arena go as their ``ArenaRef``."""
    for b in blocks:
        if isinstance(b.data, ArenaBlock):
            repeated.add(group_id=b.group_id, block_hash=b.block_hash, arena=arena_ref(b.data))
        else:
            repeated.add(group_id=b.group_id, block_hash=b.block_hash, data=bytes(b.data))


def arena_ref(block: ArenaBlock | None) -> pb.ArenaRef:
    if block is None:
        return pb.ArenaRef()
    return pb.ArenaRef(slots=block.slots, generations=block.generations, size=block.size)


def arena_block(ref: pb.ArenaRef, slot_bytes: int) -> ArenaBlock:
    return ArenaBlock(tuple(ref.slots), tuple(ref.generations), ref.size, slot_bytes)


def layout_to_proto(layout: ArenaLayout) -> pb.ArenaLayout:
    return pb.ArenaLayout(token=layout.token, slot_bytes=layout.slot_bytes, slots_offset=layout.slots_offset)


def block_specs_from_proto(request: pb.ReserveRequest) -> list[tuple[int, bytes, int]]:
    _check_model(request.model)
    if not request.blocks:
        raise ValueError("blocks is empty")
    for i, block in enumerate(request.blocks):
        _check_hashes([block.block_hash], f"blocks[{i}].block_hash")
        if not block.size:
            raise ValueError(f"blocks[{i}].size must be positive")
    return [(b.group_id, b.block_hash, b.size) for b in request.blocks]


def check_put(request: pb.PutRequest) -> None:
    _check_model(request.model)
    if not request.blocks:
        raise ValueError("blocks is empty")


def transfer_block_refs(blocks) -> list[tuple[int, bytes]]:
    """The blocks of a Put whose bytes come over the KV transport: keys only."""
    for i, block in enumerate(blocks):
        _check_hashes([block.block_hash], f"blocks[{i}].block_hash")
        if block.data or block.HasField("shm") or block.HasField("arena"):
            raise ValueError(f"blocks[{i}]: no data, shm or arena with kv_transfer_id "
                             "(the bytes come over the KV transport)")
    return [(b.group_id, b.block_hash) for b in blocks]


def check_push(request: pb.PushRequest) -> None:
    _check_model(request.model)
    if not request.blocks:
        raise ValueError("blocks is empty")
    _check_hashes([b.block_hash for b in request.blocks], "blocks[].block_hash")
    if request.caller_kv_port:
        if request.kv_target or request.caller_kv_port > 65535:
            raise ValueError("caller_kv_port must be a TCP port, and kv_target empty with it")
    else:
        host, _, port = request.kv_target.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"kv_target {request.kv_target!r} is not host:port")
    if not request.kv_transfer_id or len(request.kv_transfer_id.encode()) > 255:
        raise ValueError("kv_transfer_id must be 1 to 255 bytes")


def block_refs_from_proto(request: pb.GetRequest) -> list[tuple[int, bytes]]:
    _check_model(request.model)
    if request.transfer_id:
        if request.blocks:
            raise ValueError("blocks must be empty with transfer_id (a transfer is read whole)")
        return []
    if not request.blocks:
        raise ValueError("blocks is empty (and no transfer_id)")
    _check_hashes([b.block_hash for b in request.blocks], "blocks[].block_hash")
    return [(b.group_id, b.block_hash) for b in request.blocks]


def stats_to_proto(stats: PoolStats, pool: str, cluster: str, num_lookups: int,
                   lookup_seconds_total: float) -> pb.CachePoolStats:
    fields = {name: getattr(stats, name) for name in stats.__slots__}
    return pb.CachePoolStats(pool=pool, cluster=cluster, num_lookups=num_lookups,
                             lookup_seconds_total=lookup_seconds_total, **fields)


def _group_from_proto(group: pb.KvCacheGroup, index: int) -> KvCacheGroup:
    kind = KIND_FROM_PROTO.get(group.kind)
    if kind is None:
        raise ValueError(f"groups[{index}].kind: {group.kind} is not allowed "
                         "(allowed: GROUP_KIND_FULL_ATTENTION, GROUP_KIND_LINEAR_ATTENTION)")
    return KvCacheGroup(group.group_id, kind)


def _check_model(model: str) -> None:
    if not model:
        raise ValueError("model is empty: name the model and KV layout the blocks belong to")


def _check_hashes(hashes, field: str) -> None:
    if not all(hashes):
        raise ValueError(f"{field}: empty hash")
