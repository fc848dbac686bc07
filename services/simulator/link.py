"""The cross-cluster link: KV transfers one at a time (FIFO), each at the rate of the moment.

A transfer's rate is the link's bandwidth, or less when its TCP connections' windows bound it
(:meth:`~services.simulator.runtime.RuntimeModel.link_bytes_per_s`). A bandwidth step re-times the
transfer in flight: the bytes sent so far stay sent, the rest goes at the new rate.
"""
from __future__ import annotations

import heapq
from array import array
from collections import deque
from collections.abc import Callable

from services.simulator.runtime import RuntimeModel

Sent = Callable[[float, int], None]


class Link:
    def __init__(self, runtime: RuntimeModel, gbps: float, kind: int, heap: list, kv: array,
                 num_requests: int) -> None:
        """``kind``: the heap event kind of a finished transfer, which the owner routes to :meth:`on_sent`."""
        self.runtime, self.kind, self.heap, self.kv = runtime, kind, heap, kv
        self.gbps_now = gbps
        self.bw = runtime.link_bytes_per_s(gbps)
        self.queue: deque[int] = deque()
        self.queued_at = array("d", bytes(8 * num_requests))
        self.rid, self.left, self.since, self.version = -1, 0.0, 0.0, 0
        self.sent_done = 0.0
        self.wait_s = 0.0
        self.max_queue = 0
        self.sent: Sent = _nothing

    @property
    def num_waiting(self) -> int:
        """Transfers queued or on the link."""
        return len(self.queue) + (self.rid >= 0)

    def submit(self, now: float, rid: int) -> None:
        if self.rid < 0:
            self._send(now, rid)
            return
        self.queued_at[rid] = now
        queue = self.queue
        queue.append(rid)
        if len(queue) > self.max_queue:
            self.max_queue = len(queue)

    def on_sent(self, now: float, version: int) -> None:
        if version != self.version:
            return  # a transfer re-timed by a bandwidth step
        rid = self.rid
        self.sent_done += self.kv[rid]
        if self.queue:
            nxt = self.queue.popleft()
            self.wait_s += now - self.queued_at[nxt]
            self._send(now, nxt)
        else:
            self.rid = -1
        self.sent(now, rid)

    def on_bandwidth(self, now: float, gbps: float) -> None:
        self.gbps_now = gbps
        bw = self.runtime.link_bytes_per_s(gbps)
        if self.rid >= 0:
            self.left -= (now - self.since) * self.bw
            self.since = now
            self.version += 1
            if gbps > 0:
                heapq.heappush(self.heap, (now + max(self.left, 0.0) / bw, self.kind, self.version))
        self.bw = bw

    def sent_bytes(self, now: float) -> float:
        """Bytes sent so far, the transfer in flight included."""
        rid, kv = self.rid, self.kv
        return self.sent_done + (min(kv[rid], kv[rid] - self.left + (now - self.since) * self.bw) if rid >= 0 else 0.0)

    def oldest_wait_s(self, now: float) -> float:
        return now - self.queued_at[self.queue[0]] if self.queue else 0.0

    def _send(self, now: float, rid: int) -> None:
        self.rid, self.left, self.since = rid, self.kv[rid], now
        self.version += 1
        if self.bw > 0:
            heapq.heappush(self.heap, (now + self.left / self.bw, self.kind, self.version))


def _nothing(now: float, rid: int) -> None:
    return None
