"""What the connector's scheduler side tells its worker side each engine step.

Everything crossing from the scheduler process to the worker process lives here, as plain types:
the connector (``connector.py``) registers ``PrfaasConnectorMetadata`` as a virtual subclass of
vLLM's ``KVConnectorMetadata``, so this module, and the worker core that reads it, import no vLLM.
"""
from __future__ import annotations

from dataclasses import dataclass, field

BlockIds = tuple[tuple[int, ...], ...]  # one tuple of block ids per KV-cache group


@dataclass(frozen=True, slots=True)
class SendSpec:
    """A producer request computed prompt tokens ``[start, end)`` this step."""

    req_id: str
    transfer_id: str
    peer: str
    block_ids: BlockIds
    start: int
    end: int
    num_tokens: int
    peer_tp_size: int = 1  # the consumer engine's TP size: its rank r receives at peer's port + r

    @property
    def is_last(self) -> bool:
        return self.end >= self.num_tokens


@dataclass(frozen=True, slots=True)
class RecvSpec:
    """A consumer request waits for tokens ``[first_token, num_tokens)`` to land in ``block_ids``."""

    req_id: str
    transfer_id: str
    block_ids: BlockIds
    first_token: int
    num_tokens: int


@dataclass(frozen=True, slots=True)
class PoolLoadSpec:
    """Load blocks ``[first_block, len(block_hashes))`` of a prompt from the cluster's cache pool into
    ``block_ids``: full-attention blocks, and each state group's state at the last of those blocks."""

    req_id: str
    block_ids: BlockIds
    block_hashes: tuple[bytes, ...]  # of blocks 0..n-1
    first_block: int

    @property
    def num_blocks(self) -> int:
        return len(self.block_hashes) - self.first_block


@dataclass(frozen=True, slots=True)
class PoolStoreSpec:
    """This step completed full-attention blocks ``blocks`` (index, hash) of a prompt; with
    ``state_hash``, the step ended on a block boundary and each state group's state there is stored
    under that block's hash."""

    req_id: str
    block_ids: BlockIds
    blocks: tuple[tuple[int, bytes], ...]
    state_hash: bytes | None
    end: int


@dataclass(frozen=True, slots=True)
class SendAbort:
    """A producer request ended (aborted) before all of its KV was handed on: its transfer must end
    on both ends, or the consumer's receive and the sender's state stay until a timeout."""

    req_id: str
    transfer_id: str
    peer: str
    peer_tp_size: int = 1
    started: bool = True  # some of its KV was handed on (so the transfer exists on the wire)


@dataclass
class PrfaasConnectorMetadata:
    sends: list[SendSpec] = field(default_factory=list)
    recvs: list[RecvSpec] = field(default_factory=list)
    # Transfers the engine no longer waits for (aborted, or nothing left to load).
    abandoned: list[str] = field(default_factory=list)
    # Transfers this engine will not finish sending (their request was aborted).
    aborted_sends: list[SendAbort] = field(default_factory=list)
    pool_loads: list[PoolLoadSpec] = field(default_factory=list)
    pool_stores: list[PoolStoreSpec] = field(default_factory=list)
    # Requests whose pool load the engine no longer waits for (aborted).
    pool_abandoned: list[str] = field(default_factory=list)
    # True when this step computes nothing: the engine is only waiting (e.g. for streamed KV).
    idle: bool = False
