"""Decode batch slots: a request's TTFT ends when its KV sits on a decode instance with a free slot,
which it then holds for ``output_tokens * step_time``.

:class:`DecodePool`: every instance's slots in one pool with one FIFO queue (the router's choice
taken as a cluster). :class:`DecodeInstances`: each instance its own slots and queue, the instance
being the one the router chose when the request arrived (``dest[rid]``), and the load the router
sees of it for its next choice.
"""
from __future__ import annotations

import heapq
from array import array
from collections import deque
from collections.abc import Callable

from services.scheduling.placement import WorkerView

Event = Callable[[float, int], None]


class DecodePool:
    def __init__(self, num_slots: int, decode_s: float, kind: int, heap: list, num_requests: int,
                 first_token: Event) -> None:
        """``kind``: the heap event kind of a finished decode, which the owner routes to :meth:`on_decoded`;
        ``first_token``: called when a request takes its slot."""
        self.free, self.decode_s, self.kind, self.heap, self.first_token = num_slots, decode_s, kind, heap, first_token
        self.queue: deque[int] = deque()
        self.since = array("d", bytes(8 * num_requests))
        self.wait_s, self.max_queue = 0.0, 0
        self.finished: Event = _nothing

    @property
    def num_queued(self) -> int:
        return len(self.queue)

    def submit(self, now: float, rid: int) -> None:
        if self.free:
            self.free -= 1
            self._start(now, rid)
        else:
            self.since[rid] = now
            self.queue.append(rid)
            if len(self.queue) > self.max_queue:
                self.max_queue = len(self.queue)

    def on_decoded(self, now: float, rid: int) -> None:
        if self.queue:
            nxt = self.queue.popleft()
            self.wait_s += now - self.since[nxt]
            self._start(now, nxt)
        else:
            self.free += 1
        self.finished(now, rid)

    def _start(self, now: float, rid: int) -> None:
        self.first_token(now, rid)
        heapq.heappush(self.heap, (now + self.decode_s, self.kind, rid))


class DecodeInstances:
    def __init__(self, num_instances: int, max_batch_size: int, decode_s: float, kind: int, heap: list,
                 dest: array, num_requests: int, first_token: Event) -> None:
        """``dest[rid]``: the instance the router chose for ``rid`` (set before :meth:`submit`)."""
        self.pools = [DecodePool(max_batch_size, decode_s, kind, heap, num_requests, first_token)
                      for _ in range(num_instances)]
        for pool in self.pools[1:]:
            pool.since = self.pools[0].since
        self.num_instances, self.max_batch_size, self.dest = num_instances, max_batch_size, dest
        self.num_in_flight = [0] * num_instances      # routed here and not finished: the router's count
        self.dirty: set[int] = set(range(num_instances))
        self.max_queue = 0
        self.finished: Event = _nothing

    @property
    def num_queued(self) -> int:
        return sum(len(pool.queue) for pool in self.pools)

    @property
    def wait_s(self) -> float:
        return sum(pool.wait_s for pool in self.pools)

    def routed(self, instance: int) -> None:
        self.num_in_flight[instance] += 1
        self.dirty.add(instance)

    def submit(self, now: float, rid: int) -> None:
        instance = self.dest[rid]
        pool = self.pools[instance]
        pool.submit(now, rid)
        self.dirty.add(instance)
        if pool.max_queue > self.max_queue:
            self.max_queue = pool.max_queue

    def on_decoded(self, now: float, rid: int) -> None:
        instance = self.dest[rid]
        self.num_in_flight[instance] -= 1
        self.dirty.add(instance)
        self.pools[instance].on_decoded(now, rid)
        self.finished(now, rid)

    def view(self, instance: int) -> WorkerView:
        pool = self.pools[instance]
        return WorkerView(f"decode-{instance}", True, role="decode", receives_kv=True,
                          num_in_flight=self.num_in_flight[instance], num_running=self.max_batch_size - pool.free,
                          num_waiting=len(pool.queue))


def _nothing(now: float, rid: int) -> None:
    return None
