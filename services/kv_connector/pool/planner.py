"""Scheduler side of the cache-pool integration: which prompt blocks to load from the cluster's pool
and which to store into it, decided per request and per step. Engine-core process.

A new request's chained block hashes (``hashing.prompt_block_hashes``) go to the pool's Lookup in
the background; ``num_matched_tokens`` answers None ("ask again") until it returns. A usable prefix
longer than the engine's own cache hit is loaded asynchronously into the blocks vLLM allocates. At
most ``N-1`` prompt tokens are looked up, so the engine always computes at least one. Each step's
newly computed prompt blocks (and recurrent states where a step ends on a block boundary) become a
``PoolStoreSpec`` for the worker; a consumer of a KV stream stores the blocks it received too, at its
first computed step (vLLM schedules it only once they are in place). One load attempt per request:
a failed load is recomputed.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from services.cache_pool_client.hashing import prompt_block_hashes
from services.kv_connector.metadata import PoolLoadSpec, PoolStoreSpec, PrfaasConnectorMetadata
from services.kv_connector.pool.io import PoolModel
from services.kv_connector.scheduled import Scheduled

logger = logging.getLogger(__name__)

LOOKUP_GRACE_S = 0.1  # beyond the RPC's own deadline, before a lookup counts as a miss


@dataclass(slots=True)
class _Prompt:
    block_hashes: tuple[bytes, ...]
    num_tokens: int
    lookup: Future | None
    lookup_deadline: float
    block_ids: list[list[int]] = field(default_factory=list)
    num_usable_blocks: int | None = None
    load_decided: bool = False
    num_stored_tokens: int = 0  # prompt tokens [0, n) already handed to the worker for storing
    received: bool = False  # its KV comes over the KV transport: stored from token 0, never looked up


class PoolPlanner:
    def __init__(self, io, model: PoolModel, clock: Callable[[], float] = time.monotonic) -> None:
        self._io = io
        self.model = model
        self._clock = clock
        self._prompts: dict[str, _Prompt] = {}
        self._loading: set[str] = set()
        self._loads: list[PoolLoadSpec] = []
        self._abandoned: list[str] = []

    def on_new_request(self, request: Any, look_up: bool = True) -> None:
        """``look_up`` False: a consumer of a KV stream, whose received blocks are stored once the
        engine has them (its first computed step), and nothing is loaded."""
        block_size = self.model.block_size
        hashes = tuple(prompt_block_hashes(request.prompt_token_ids, block_size))
        max_blocks = (request.num_prompt_tokens - 1) // block_size
        lookup = None
        if max_blocks > 0 and look_up:
            lookup = self._io.start_lookup(*self.model.queries(hashes[:max_blocks]))
        deadline = self._clock() + self._io.lookup_timeout_s + LOOKUP_GRACE_S
        self._prompts[request.request_id] = _Prompt(hashes, request.num_prompt_tokens, lookup, deadline,
                                                    received=not look_up)

    def num_matched_tokens(self, request: Any, num_computed_tokens: int) -> int | None:
        """Tokens the pool can add beyond ``num_computed_tokens``; None while the lookup runs."""
        prompt = self._prompts.get(request.request_id)
        if prompt is None or prompt.load_decided or prompt.lookup is None:
            return 0
        if prompt.num_usable_blocks is None:
            if not prompt.lookup.done():
                if self._clock() < prompt.lookup_deadline:
                    return None
                prompt.lookup.cancel()
                logger.warning("request %s: cache pool lookup timed out", request.request_id)
                prompt.num_usable_blocks = 0
            else:
                prompt.num_usable_blocks = self._usable_blocks(request.request_id, prompt.lookup)
        return max(0, prompt.num_usable_blocks * self.model.block_size - num_computed_tokens)

    def after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        prompt = self._prompts.get(request.request_id)
        if prompt is None or prompt.load_decided or not prompt.num_usable_blocks:
            return
        prompt.load_decided = True
        if num_external_tokens == 0:
            return
        num_blocks = prompt.num_usable_blocks
        first_token = num_blocks * self.model.block_size - num_external_tokens
        block_ids = tuple(tuple(ids) for ids in blocks.get_block_ids())
        prompt.num_stored_tokens = num_blocks * self.model.block_size  # the pool has these already
        self._loads.append(PoolLoadSpec(request.request_id, block_ids, prompt.block_hashes[:num_blocks],
                                        first_token // self.model.block_size))
        self._loading.add(request.request_id)
        logger.debug("request %s: loading prompt tokens [%d, %d) from the cache pool", request.request_id,
                     first_token, num_blocks * self.model.block_size)

    def add_to_meta(self, meta: PrfaasConnectorMetadata) -> None:
        """The loads planned and abandoned since the last step."""
        meta.pool_loads, meta.pool_abandoned = self._loads, self._abandoned
        self._loads, self._abandoned = [], []

    def on_scheduled(self, meta: PrfaasConnectorMetadata, step: Scheduled) -> None:
        """Stores what a scheduled prompt computes in this step."""
        if prompt := self._prompts.get(step.req_id):
            step.update(prompt.block_ids)
            self._store(meta, step.req_id, prompt, step.num_computed_tokens, step.num_scheduled_tokens)

    def on_loads_finished(self, finished: set[str], failed: set[str]) -> None:
        """A failed load is recomputed from the first token, so its blocks are stored again."""
        self._loading.difference_update(finished)
        for req_id in failed:
            if prompt := self._prompts.get(req_id):
                prompt.num_stored_tokens = 0

    def on_finished(self, request: Any) -> None:
        prompt = self._prompts.pop(request.request_id, None)
        if prompt is not None and prompt.lookup is not None:
            prompt.lookup.cancel()
        if request.request_id in self._loading:
            self._loading.discard(request.request_id)
            self._abandoned.append(request.request_id)

    def _usable_blocks(self, req_id: str, lookup: Future) -> int:
        try:
            return lookup.result().num_usable_blocks
        except Exception as exc:  # noqa: BLE001 - a pool failure is a miss, never a failed request
            logger.warning("request %s: cache pool lookup failed: %s", req_id, exc)
            return 0

    def _store(self, meta: PrfaasConnectorMetadata, req_id: str, prompt: _Prompt, num_computed: int,
               num_scheduled: int) -> None:
        start = prompt.num_stored_tokens if prompt.received else max(num_computed, prompt.num_stored_tokens)
        end = min(num_computed + num_scheduled, prompt.num_tokens)
        if start >= end:
            return
        prompt.num_stored_tokens = end
        block_size = self.model.block_size
        blocks = tuple((i, prompt.block_hashes[i]) for i in range(start // block_size,
                                                                 min(end // block_size, len(prompt.block_hashes))))
        state_hash = None
        if self.model.linear_group_ids and end % block_size == 0 and end // block_size <= len(prompt.block_hashes):
            state_hash = prompt.block_hashes[end // block_size - 1]
        if blocks or state_hash:
            block_ids = tuple(tuple(ids) for ids in prompt.block_ids)
            meta.pool_stores.append(PoolStoreSpec(req_id, block_ids, blocks, state_hash, end))
