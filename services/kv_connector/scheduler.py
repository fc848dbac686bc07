"""Scheduler side of the PrfaaS connector: decides per step what to send and where to receive.

Runs in vLLM's engine-core process; no network here. Producer requests compute ``prompt[:-1]``
(the last prompt token is dropped and ``max_tokens`` set to 1) and each step's newly computed
tokens become a ``SendSpec``. Consumer requests report ``N-1`` externally computed tokens, loaded
asynchronously; the blocks vLLM allocated for them become a ``RecvSpec``. With a cache pool
(``pool_scheduler.PoolPlanner``), every other request may load a cached prefix from it; every
request stores the prompt blocks it computes or received over the KV transport, so the next turn of
a conversation prefilled elsewhere is a hit in this cluster's pool.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from services.kv_connector.metadata import PrfaasConnectorMetadata, RecvSpec, SendAbort, SendSpec
from services.kv_connector.params import KvTransfer
from services.kv_connector.pool.planner import PoolPlanner
from services.kv_connector.scheduled import scheduled_requests

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class _Producing:
    params: KvTransfer
    num_tokens: int
    block_ids: list[list[int]]
    num_sent_tokens: int = 0  # KV of tokens [0, num_sent_tokens) is already handed to the worker


class PrfaasConnectorScheduler:
    def __init__(self, pool: PoolPlanner | None = None) -> None:
        self._pool = pool
        self._producing: dict[str, _Producing] = {}
        self._consuming: dict[str, str] = {}  # req_id -> transfer_id, until received or abandoned
        self._allocated: set[str] = set()
        self._recvs: list[RecvSpec] = []
        self._abandoned: list[str] = []
        self._aborted_sends: list[SendAbort] = []

    def on_new_request(self, request: Any) -> None:
        params = KvTransfer.of(request.kv_transfer_params)
        if params is not None and params.mode == "produce" and request.num_prompt_tokens >= 2:
            _truncate_last_prompt_token(request)
            self._producing[request.request_id] = _Producing(params, request.num_prompt_tokens, [])
            logger.debug("request %s: producing KV of %d tokens for %s", params.transfer_id,
                         request.num_prompt_tokens, params.peer)
        if self._pool is not None:
            self._pool.on_new_request(request, look_up=not _consumes(params))

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        params = KvTransfer.of(request.kv_transfer_params)
        if not _consumes(params):
            count = self._pool.num_matched_tokens(request, num_computed_tokens) if self._pool else 0
            return count, bool(count)
        if request.request_id in self._allocated:
            return 0, False
        count = request.num_prompt_tokens - 1 - num_computed_tokens
        return (count, True) if count > 0 else (0, False)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        params = KvTransfer.of(request.kv_transfer_params)
        if not _consumes(params):
            if self._pool is not None:
                self._pool.after_alloc(request, blocks, num_external_tokens)
            return
        if request.request_id in self._allocated:
            return
        self._allocated.add(request.request_id)
        if num_external_tokens == 0:
            self._abandoned.append(params.transfer_id)
            return
        num_tokens = request.num_prompt_tokens - 1
        block_ids = tuple(tuple(ids) for ids in blocks.get_block_ids())
        self._recvs.append(RecvSpec(request.request_id, params.transfer_id, block_ids,
                                    num_tokens - num_external_tokens, num_tokens))
        self._consuming[request.request_id] = params.transfer_id

    def build_connector_meta(self, scheduler_output: Any) -> PrfaasConnectorMetadata:
        meta = PrfaasConnectorMetadata(recvs=self._recvs, abandoned=self._abandoned,
                                       aborted_sends=self._aborted_sends,
                                       idle=scheduler_output.total_num_scheduled_tokens == 0)
        self._recvs, self._abandoned, self._aborted_sends = [], [], []
        if self._pool is not None:
            self._pool.add_to_meta(meta)
        for step in scheduled_requests(scheduler_output):
            if producing := self._producing.get(step.req_id):
                step.update(producing.block_ids)
                self._emit(meta, step.req_id, producing, step.num_computed_tokens, step.num_scheduled_tokens)
            if self._pool is not None:
                self._pool.on_scheduled(meta, step)
        return meta

    def update_connector_output(self, connector_output: Any) -> None:
        for req_id in connector_output.finished_recving or ():
            self._consuming.pop(req_id, None)
        if self._pool is not None:
            self._pool.on_loads_finished(set(connector_output.finished_recving or ()),
                                         set(connector_output.failed_recving or ()))

    def request_finished(self, request: Any) -> tuple[bool, dict | None]:
        """Blocks are always freed at once: sends copy their data, receives write on the engine thread."""
        producing = self._producing.pop(request.request_id, None)
        if producing is not None and producing.num_sent_tokens < producing.num_tokens:
            params = producing.params
            self._aborted_sends.append(SendAbort(request.request_id, params.transfer_id, params.peer,
                                                 params.peer_tp_size, started=producing.num_sent_tokens > 0))
        self._allocated.discard(request.request_id)
        self._consuming.pop(request.request_id, None)
        if self._pool is not None:
            self._pool.on_finished(request)
        params = KvTransfer.of(request.kv_transfer_params)
        if params is not None and params.mode == "consume":
            self._abandoned.append(params.transfer_id)  # a no-op on the worker once received
        return False, None

    def _emit(self, meta: PrfaasConnectorMetadata, req_id: str, producing: _Producing, num_computed: int,
              num_scheduled: int) -> None:
        """Send what this step computes, and before it anything not sent yet: the consumer has none
        of the prompt, so blocks this engine found in its own prefix cache go too."""
        start = producing.num_sent_tokens
        end = min(num_computed + num_scheduled, producing.num_tokens)
        if start >= end:
            return
        producing.num_sent_tokens = end
        block_ids = tuple(tuple(ids) for ids in producing.block_ids)
        meta.sends.append(SendSpec(req_id, producing.params.transfer_id, producing.params.peer, block_ids,
                                   start, end, producing.num_tokens, producing.params.peer_tp_size))


def _consumes(params: KvTransfer | None) -> bool:
    return params is not None and params.mode == "consume"


def _truncate_last_prompt_token(request: Any) -> None:
    """The consumer recomputes the last prompt token itself, so the producer stops one short."""
    request.prompt_token_ids.pop()
    request._all_token_ids.pop()
    request.num_prompt_tokens -= 1
    request.max_tokens = 1
