from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class GroupKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    GROUP_KIND_UNSPECIFIED: _ClassVar[GroupKind]
    GROUP_KIND_FULL_ATTENTION: _ClassVar[GroupKind]
    GROUP_KIND_LINEAR_ATTENTION: _ClassVar[GroupKind]
GROUP_KIND_UNSPECIFIED: GroupKind
GROUP_KIND_FULL_ATTENTION: GroupKind
GROUP_KIND_LINEAR_ATTENTION: GroupKind

class SharedArena(_message.Message):
    __slots__ = ("path", "size", "token")
    PATH_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    path: str
    size: int
    token: bytes
    def __init__(self, path: _Optional[str] = ..., size: _Optional[int] = ..., token: _Optional[bytes] = ...) -> None: ...

class ArenaLayout(_message.Message):
    __slots__ = ("token", "slot_bytes", "slots_offset")
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    SLOT_BYTES_FIELD_NUMBER: _ClassVar[int]
    SLOTS_OFFSET_FIELD_NUMBER: _ClassVar[int]
    token: bytes
    slot_bytes: int
    slots_offset: int
    def __init__(self, token: _Optional[bytes] = ..., slot_bytes: _Optional[int] = ..., slots_offset: _Optional[int] = ...) -> None: ...

class ArenaRef(_message.Message):
    __slots__ = ("slots", "generations", "size")
    SLOTS_FIELD_NUMBER: _ClassVar[int]
    GENERATIONS_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    slots: _containers.RepeatedScalarFieldContainer[int]
    generations: _containers.RepeatedScalarFieldContainer[int]
    size: int
    def __init__(self, slots: _Optional[_Iterable[int]] = ..., generations: _Optional[_Iterable[int]] = ..., size: _Optional[int] = ...) -> None: ...

class BlockSpace(_message.Message):
    __slots__ = ("group_id", "block_hash", "size")
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASH_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    group_id: int
    block_hash: bytes
    size: int
    def __init__(self, group_id: _Optional[int] = ..., block_hash: _Optional[bytes] = ..., size: _Optional[int] = ...) -> None: ...

class ReserveRequest(_message.Message):
    __slots__ = ("model", "blocks", "transfer_id")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    model: str
    blocks: _containers.RepeatedCompositeFieldContainer[BlockSpace]
    transfer_id: str
    def __init__(self, model: _Optional[str] = ..., blocks: _Optional[_Iterable[_Union[BlockSpace, _Mapping]]] = ..., transfer_id: _Optional[str] = ...) -> None: ...

class ReserveResponse(_message.Message):
    __slots__ = ("lease_id", "blocks", "layout", "lease_timeout_s")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    LEASE_TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    blocks: _containers.RepeatedCompositeFieldContainer[ArenaRef]
    layout: ArenaLayout
    lease_timeout_s: float
    def __init__(self, lease_id: _Optional[str] = ..., blocks: _Optional[_Iterable[_Union[ArenaRef, _Mapping]]] = ..., layout: _Optional[_Union[ArenaLayout, _Mapping]] = ..., lease_timeout_s: _Optional[float] = ...) -> None: ...

class CommitRequest(_message.Message):
    __slots__ = ("lease_id", "abort")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    ABORT_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    abort: bool
    def __init__(self, lease_id: _Optional[str] = ..., abort: _Optional[bool] = ...) -> None: ...

class PushRequest(_message.Message):
    __slots__ = ("model", "blocks", "kv_target", "kv_transfer_id", "caller_kv_port")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    KV_TARGET_FIELD_NUMBER: _ClassVar[int]
    KV_TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    CALLER_KV_PORT_FIELD_NUMBER: _ClassVar[int]
    model: str
    blocks: _containers.RepeatedCompositeFieldContainer[CacheBlockRef]
    kv_target: str
    kv_transfer_id: str
    caller_kv_port: int
    def __init__(self, model: _Optional[str] = ..., blocks: _Optional[_Iterable[_Union[CacheBlockRef, _Mapping]]] = ..., kv_target: _Optional[str] = ..., kv_transfer_id: _Optional[str] = ..., caller_kv_port: _Optional[int] = ...) -> None: ...

class PushResponse(_message.Message):
    __slots__ = ("num_blocks", "num_bytes")
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_BYTES_FIELD_NUMBER: _ClassVar[int]
    num_blocks: int
    num_bytes: int
    def __init__(self, num_blocks: _Optional[int] = ..., num_bytes: _Optional[int] = ...) -> None: ...

class DescribeRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class DescribeResponse(_message.Message):
    __slots__ = ("pool", "cluster", "shared_memory", "kv_port", "arena")
    POOL_FIELD_NUMBER: _ClassVar[int]
    CLUSTER_FIELD_NUMBER: _ClassVar[int]
    SHARED_MEMORY_FIELD_NUMBER: _ClassVar[int]
    KV_PORT_FIELD_NUMBER: _ClassVar[int]
    ARENA_FIELD_NUMBER: _ClassVar[int]
    pool: str
    cluster: str
    shared_memory: SharedMemory
    kv_port: int
    arena: SharedArena
    def __init__(self, pool: _Optional[str] = ..., cluster: _Optional[str] = ..., shared_memory: _Optional[_Union[SharedMemory, _Mapping]] = ..., kv_port: _Optional[int] = ..., arena: _Optional[_Union[SharedArena, _Mapping]] = ...) -> None: ...

class SharedMemory(_message.Message):
    __slots__ = ("directory", "probe_file", "probe_token")
    DIRECTORY_FIELD_NUMBER: _ClassVar[int]
    PROBE_FILE_FIELD_NUMBER: _ClassVar[int]
    PROBE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    directory: str
    probe_file: str
    probe_token: bytes
    def __init__(self, directory: _Optional[str] = ..., probe_file: _Optional[str] = ..., probe_token: _Optional[bytes] = ...) -> None: ...

class ShmFile(_message.Message):
    __slots__ = ("name", "size")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    name: str
    size: int
    def __init__(self, name: _Optional[str] = ..., size: _Optional[int] = ...) -> None: ...

class KvCacheGroup(_message.Message):
    __slots__ = ("group_id", "kind")
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    group_id: int
    kind: GroupKind
    def __init__(self, group_id: _Optional[int] = ..., kind: _Optional[_Union[GroupKind, str]] = ...) -> None: ...

class LookupRequest(_message.Message):
    __slots__ = ("model", "block_size", "block_hashes", "groups")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    GROUPS_FIELD_NUMBER: _ClassVar[int]
    model: str
    block_size: int
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    groups: _containers.RepeatedCompositeFieldContainer[KvCacheGroup]
    def __init__(self, model: _Optional[str] = ..., block_size: _Optional[int] = ..., block_hashes: _Optional[_Iterable[bytes]] = ..., groups: _Optional[_Iterable[_Union[KvCacheGroup, _Mapping]]] = ...) -> None: ...

class LookupResponse(_message.Message):
    __slots__ = ("pool", "cluster", "num_usable_blocks", "num_usable_tokens", "num_full_attention_blocks", "model")
    POOL_FIELD_NUMBER: _ClassVar[int]
    CLUSTER_FIELD_NUMBER: _ClassVar[int]
    NUM_USABLE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_USABLE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_FULL_ATTENTION_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    pool: str
    cluster: str
    num_usable_blocks: int
    num_usable_tokens: int
    num_full_attention_blocks: int
    model: str
    def __init__(self, pool: _Optional[str] = ..., cluster: _Optional[str] = ..., num_usable_blocks: _Optional[int] = ..., num_usable_tokens: _Optional[int] = ..., num_full_attention_blocks: _Optional[int] = ..., model: _Optional[str] = ...) -> None: ...

class CacheBlock(_message.Message):
    __slots__ = ("group_id", "block_hash", "data", "shm", "arena")
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASH_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    SHM_FIELD_NUMBER: _ClassVar[int]
    ARENA_FIELD_NUMBER: _ClassVar[int]
    group_id: int
    block_hash: bytes
    data: bytes
    shm: ShmFile
    arena: ArenaRef
    def __init__(self, group_id: _Optional[int] = ..., block_hash: _Optional[bytes] = ..., data: _Optional[bytes] = ..., shm: _Optional[_Union[ShmFile, _Mapping]] = ..., arena: _Optional[_Union[ArenaRef, _Mapping]] = ...) -> None: ...

class PutRequest(_message.Message):
    __slots__ = ("model", "blocks", "transfer_id", "kv_transfer_id")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    KV_TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    model: str
    blocks: _containers.RepeatedCompositeFieldContainer[CacheBlock]
    transfer_id: str
    kv_transfer_id: str
    def __init__(self, model: _Optional[str] = ..., blocks: _Optional[_Iterable[_Union[CacheBlock, _Mapping]]] = ..., transfer_id: _Optional[str] = ..., kv_transfer_id: _Optional[str] = ...) -> None: ...

class PutResponse(_message.Message):
    __slots__ = ("num_blocks_stored", "num_bytes_stored")
    NUM_BLOCKS_STORED_FIELD_NUMBER: _ClassVar[int]
    NUM_BYTES_STORED_FIELD_NUMBER: _ClassVar[int]
    num_blocks_stored: int
    num_bytes_stored: int
    def __init__(self, num_blocks_stored: _Optional[int] = ..., num_bytes_stored: _Optional[int] = ...) -> None: ...

class CacheBlockRef(_message.Message):
    __slots__ = ("group_id", "block_hash")
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASH_FIELD_NUMBER: _ClassVar[int]
    group_id: int
    block_hash: bytes
    def __init__(self, group_id: _Optional[int] = ..., block_hash: _Optional[bytes] = ...) -> None: ...

class GetRequest(_message.Message):
    __slots__ = ("model", "blocks", "transfer_id", "shared_memory", "arena")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    SHARED_MEMORY_FIELD_NUMBER: _ClassVar[int]
    ARENA_FIELD_NUMBER: _ClassVar[int]
    model: str
    blocks: _containers.RepeatedCompositeFieldContainer[CacheBlockRef]
    transfer_id: str
    shared_memory: bool
    arena: bool
    def __init__(self, model: _Optional[str] = ..., blocks: _Optional[_Iterable[_Union[CacheBlockRef, _Mapping]]] = ..., transfer_id: _Optional[str] = ..., shared_memory: _Optional[bool] = ..., arena: _Optional[bool] = ...) -> None: ...

class GetResponse(_message.Message):
    __slots__ = ("blocks", "layout")
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    blocks: _containers.RepeatedCompositeFieldContainer[CacheBlock]
    layout: ArenaLayout
    def __init__(self, blocks: _Optional[_Iterable[_Union[CacheBlock, _Mapping]]] = ..., layout: _Optional[_Union[ArenaLayout, _Mapping]] = ...) -> None: ...

class CachePoolStatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class CachePoolStats(_message.Message):
    __slots__ = ("pool", "cluster", "memory_budget_bytes", "memory_bytes", "memory_blocks", "ssd_budget_bytes", "ssd_bytes", "ssd_blocks", "transfer_bytes", "num_transfers", "full_attention_hits", "full_attention_misses", "linear_attention_hits", "linear_attention_misses", "memory_evictions", "ssd_evictions", "ssd_read_errors", "num_lookups", "lookup_seconds_total", "arena_slot_bytes", "arena_slots", "arena_free_slots", "leased_slots", "lease_expiries")
    POOL_FIELD_NUMBER: _ClassVar[int]
    CLUSTER_FIELD_NUMBER: _ClassVar[int]
    MEMORY_BUDGET_BYTES_FIELD_NUMBER: _ClassVar[int]
    MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    MEMORY_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    SSD_BUDGET_BYTES_FIELD_NUMBER: _ClassVar[int]
    SSD_BYTES_FIELD_NUMBER: _ClassVar[int]
    SSD_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_BYTES_FIELD_NUMBER: _ClassVar[int]
    NUM_TRANSFERS_FIELD_NUMBER: _ClassVar[int]
    FULL_ATTENTION_HITS_FIELD_NUMBER: _ClassVar[int]
    FULL_ATTENTION_MISSES_FIELD_NUMBER: _ClassVar[int]
    LINEAR_ATTENTION_HITS_FIELD_NUMBER: _ClassVar[int]
    LINEAR_ATTENTION_MISSES_FIELD_NUMBER: _ClassVar[int]
    MEMORY_EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    SSD_EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    SSD_READ_ERRORS_FIELD_NUMBER: _ClassVar[int]
    NUM_LOOKUPS_FIELD_NUMBER: _ClassVar[int]
    LOOKUP_SECONDS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    ARENA_SLOT_BYTES_FIELD_NUMBER: _ClassVar[int]
    ARENA_SLOTS_FIELD_NUMBER: _ClassVar[int]
    ARENA_FREE_SLOTS_FIELD_NUMBER: _ClassVar[int]
    LEASED_SLOTS_FIELD_NUMBER: _ClassVar[int]
    LEASE_EXPIRIES_FIELD_NUMBER: _ClassVar[int]
    pool: str
    cluster: str
    memory_budget_bytes: int
    memory_bytes: int
    memory_blocks: int
    ssd_budget_bytes: int
    ssd_bytes: int
    ssd_blocks: int
    transfer_bytes: int
    num_transfers: int
    full_attention_hits: int
    full_attention_misses: int
    linear_attention_hits: int
    linear_attention_misses: int
    memory_evictions: int
    ssd_evictions: int
    ssd_read_errors: int
    num_lookups: int
    lookup_seconds_total: float
    arena_slot_bytes: int
    arena_slots: int
    arena_free_slots: int
    leased_slots: int
    lease_expiries: int
    def __init__(self, pool: _Optional[str] = ..., cluster: _Optional[str] = ..., memory_budget_bytes: _Optional[int] = ..., memory_bytes: _Optional[int] = ..., memory_blocks: _Optional[int] = ..., ssd_budget_bytes: _Optional[int] = ..., ssd_bytes: _Optional[int] = ..., ssd_blocks: _Optional[int] = ..., transfer_bytes: _Optional[int] = ..., num_transfers: _Optional[int] = ..., full_attention_hits: _Optional[int] = ..., full_attention_misses: _Optional[int] = ..., linear_attention_hits: _Optional[int] = ..., linear_attention_misses: _Optional[int] = ..., memory_evictions: _Optional[int] = ..., ssd_evictions: _Optional[int] = ..., ssd_read_errors: _Optional[int] = ..., num_lookups: _Optional[int] = ..., lookup_seconds_total: _Optional[float] = ..., arena_slot_bytes: _Optional[int] = ..., arena_slots: _Optional[int] = ..., arena_free_slots: _Optional[int] = ..., leased_slots: _Optional[int] = ..., lease_expiries: _Optional[int] = ...) -> None: ...
