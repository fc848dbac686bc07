"""The cross-cluster link: KV transfers taken from one FIFO queue, each at the rate of the moment.

Without a window bound the link sends one transfer at a time at its full bandwidth. With one
(:meth:`~services.simulator.runtime.RuntimeModel.window_bytes_per_s`: a transfer's connections can
carry no more than their windows per round trip), a transfer goes at most at that rate, and as many
transfers go at once as that rate fits into the link's nominal bandwidth (prefill workers stream to
several decode workers at once, each pair over its own connections); each channel gets
``min(window rate, bandwidth / channels)``. A bandwidth step re-times the transfers in flight: the
bytes sent so far stay sent, the rest goes at the new rate.
"""
from __future__ import annotations

import heapq
import math
from array import array
from collections import deque
from collections.abc import Callable

from services.simulator.runtime import GBPS, RuntimeModel

Sent = Callable[[float, int], None]


def num_channels(runtime: RuntimeModel, gbps: float) -> int:
    """Transfers the link carries at once: how many window-bound transfers fit its bandwidth (at least 1)."""
    window = runtime.window_bytes_per_s
    return max(1, math.floor(gbps * GBPS / window)) if window < gbps * GBPS else 1


class Link:
    def __init__(self, runtime: RuntimeModel, nominal_gbps: float, gbps: float, kind: int, heap: list, kv: array,
                 num_requests: int) -> None:
        """``kind``: the heap event kind of a finished transfer, which the owner routes to :meth:`on_sent`."""
        self.runtime, self.kind, self.heap, self.kv = runtime, kind, heap, kv
        self.num_channels = n = num_channels(runtime, nominal_gbps)
        self.gbps_now = gbps
        self.bw = self._rate(gbps)
        self.queue: deque[int] = deque()
        self.queued_at = array("d", bytes(8 * num_requests))
        self.rid, self.left, self.since, self.version = [-1] * n, [0.0] * n, [0.0] * n, [0] * n
        self.idle = list(range(n - 1, -1, -1))
        self.num_versions = 0
        self.sent_done = 0.0
        self.wait_s = 0.0
        self.max_queue = 0
        self.sent: Sent = _nothing

    @property
    def num_waiting(self) -> int:
        """Transfers queued or on the link."""
        return len(self.queue) + self.num_channels - len(self.idle)

    @property
    def num_sending(self) -> int:
        return self.num_channels - len(self.idle)

    def submit(self, now: float, rid: int) -> None:
        if self.idle:
            self._send(now, self.idle.pop(), rid)
            return
        self.queued_at[rid] = now
        queue = self.queue
        queue.append(rid)
        if len(queue) > self.max_queue:
            self.max_queue = len(queue)

    def on_sent(self, now: float, event: int) -> None:
        channel = event % self.num_channels
        if event // self.num_channels != self.version[channel]:
            return  # a transfer re-timed by a bandwidth step
        rid = self.rid[channel]
        self.sent_done += self.kv[rid]
        if self.queue:
            nxt = self.queue.popleft()
            self.wait_s += now - self.queued_at[nxt]
            self._send(now, channel, nxt)
        else:
            self.rid[channel] = -1
            self.idle.append(channel)
        self.sent(now, rid)

    def on_bandwidth(self, now: float, gbps: float) -> None:
        self.gbps_now = gbps
        bw = self._rate(gbps)
        for channel, rid in enumerate(self.rid):
            if rid < 0:
                continue
            self.left[channel] -= (now - self.since[channel]) * self.bw
            self.since[channel] = now
            version = self._next_version(channel)
            if gbps > 0:
                heapq.heappush(self.heap, (now + max(self.left[channel], 0.0) / bw, self.kind,
                                           version * self.num_channels + channel))
        self.bw = bw

    def sent_bytes(self, now: float) -> float:
        """Bytes sent so far, the transfers in flight included."""
        kv, sent = self.kv, self.sent_done
        for channel, rid in enumerate(self.rid):
            if rid >= 0:
                sent += min(kv[rid], kv[rid] - self.left[channel] + (now - self.since[channel]) * self.bw)
        return sent

    def oldest_wait_s(self, now: float) -> float:
        return now - self.queued_at[self.queue[0]] if self.queue else 0.0

    def _rate(self, gbps: float) -> float:
        """One channel's rate on a link of ``gbps`` now."""
        return self.runtime.link_bytes_per_s(gbps / self.num_channels if self.num_channels > 1 else gbps)

    def _next_version(self, channel: int) -> int:
        self.num_versions += 1
        self.version[channel] = self.num_versions
        return self.num_versions

    def _send(self, now: float, channel: int, rid: int) -> None:
        self.rid[channel], self.left[channel], self.since[channel] = rid, self.kv[rid], now
        version = self._next_version(channel)
        if self.bw > 0:
            heapq.heappush(self.heap, (now + self.left[channel] / self.bw, self.kind,
                                       version * self.num_channels + channel))


def _nothing(now: float, rid: int) -> None:
    return None
