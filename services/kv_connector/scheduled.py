"""One walk over vLLM's ``SchedulerOutput`` for both scheduler halves of the connector (the KV
transfer's and the cache pool's): per scheduled request, the tokens computed before this step, the
tokens it computes, and the block ids it was given."""
from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class Scheduled:
    req_id: str
    num_computed_tokens: int
    num_scheduled_tokens: int
    new_block_ids: Any  # per KV-cache group, or None when the step added no block
    replaces: bool      # a new request, or one vLLM resumed after preemption: its ids replace the old

    def update(self, block_ids: list[list[int]]) -> None:
        """Adds this step's block ids to a request's (replacing them where ``replaces``)."""
        if self.new_block_ids is None:
            return
        if self.replaces:
            block_ids[:] = [list(ids) for ids in self.new_block_ids]
            return
        for group, ids in enumerate(self.new_block_ids):
            block_ids[group].extend(ids)


def scheduled_requests(scheduler_output: Any) -> Iterator[Scheduled]:
    scheduled = scheduler_output.num_scheduled_tokens
    for new in scheduler_output.scheduled_new_reqs:
        yield Scheduled(new.req_id, new.num_computed_tokens, scheduled[new.req_id], new.block_ids, True)
    cached = scheduler_output.scheduled_cached_reqs
    for i, req_id in enumerate(cached.req_ids):
        yield Scheduled(req_id, cached.num_computed_tokens[i], scheduled[req_id], cached.new_block_ids[i],
                        req_id in cached.resumed_req_ids)
