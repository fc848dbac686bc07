"""One cluster's prefill instances, fed from one FIFO queue: whole requests, or vLLM's chunked steps.

Whole requests (``chunk_tokens`` 0): an instance prefills one request at a time, for T(l) with
l the request's uncached length and T the profile's latency curve.

Chunked (``chunk_tokens`` B > 0, the engine's ``max_num_batched_tokens``): an instance runs steps
of at most B tokens and forms them as vLLM's scheduler does by default: the requests it already
runs first, in the order they started, each taking what it still needs up to the budget left, then
new requests from the queue while budget is left. A piece covering a request's uncached tokens
[a, b) costs T(b) - T(a), its first piece T(b) (which carries the fixed cost of a prefill), and a
step costs the sum of its pieces; so a request alone on an instance takes T(l) whatever B, the
time the profile measured. vLLM gives a running prefill the whole budget (no
``long_prefill_token_threshold``), so a request queued behind a long prefill waits for that
prefill's last step, which it shares. Steps that only continue one request are one event.

Pool hits (``load_s`` > 0): the connector loads a cached prefix asynchronously, off the compute.
When a request's turn comes its load starts and the instance takes the next request; once loaded,
the request goes back to the head of the queue (vLLM leaves a request waiting for remote KV in its
place).

Slowed (:meth:`PrefillCluster.slowable`, then :meth:`PrefillCluster.set_speed` and
:meth:`PrefillCluster.owe`): the instance computes at a share of the profile's speed that changes while
its work runs (an engine sharing its host's memory with engines that decode:
``RuntimeModel.colocated_interference``), and its cores owe CPU to its KV sender
(``RuntimeModel.send_cpu_ms_per_mib``): a prefill (step) that starts as a transfer starts takes that
much longer; an idle instance pays from its idle time, and what is left when its next prefill starts
makes that one longer. Each prefill or step in flight keeps its work in the profile's seconds; a change
of speed or a debt moves its end, and ``slowed_s`` sums the seconds it ran beyond that work.
"""
from __future__ import annotations

import heapq
from array import array
from collections import deque
from collections.abc import Callable

from services.planner.profiles import PiecewiseLinear

Finished = Callable[[float, int], None]


class PrefillCluster:
    def __init__(self, num_instances: int, latency: PiecewiseLinear | None, chunk_tokens: int, kinds: tuple[int, int],
                 heap: list, arrival_t: array, num_requests: int, event_base: int = 0,
                 shared: PrefillCluster | None = None) -> None:
        """``kinds``: the heap event kinds of a finished prefill (or step) and of a finished pool
        load; the owner routes those events to :meth:`on_event` and :meth:`on_loaded`. A chunked
        step's event carries ``event_base`` + its instance. ``shared``: a cluster whose per-request
        arrays this one uses too (one-instance clusters standing for the instances of one cluster)."""
        self.num_instances, self.latency, self.chunk_tokens = num_instances, latency, chunk_tokens
        self.kind, self.loaded_kind = kinds
        self.heap, self.arrival_t, self.event_base = heap, arrival_t, event_base
        self.queue: deque[int] = deque()
        self.free = num_instances
        if shared is not None:
            self.work, self.load, self.done = shared.work, shared.load, shared.done
        else:
            self.work = array("d", bytes(8 * num_requests))        # whole: T(l); chunked: l
            self.load = array("d", bytes(8 * num_requests))        # pool load still to do, seconds
            self.done = array("d", bytes(8 * num_requests)) if chunk_tokens else self.work
        self.running: list[deque[int]] = [deque() for _ in range(num_instances)]
        self.pieces: list[tuple[tuple[int, float], ...]] = [()] * num_instances
        self.idle = list(range(num_instances - 1, -1, -1))
        self.wait_s = 0.0
        self.max_queue = 0
        self.finished: Finished = _nothing
        self.started: Finished | None = None
        self.on_event = self._on_step if chunk_tokens else self._on_prefilled
        self.speed = 1.0
        self.in_flight: dict[int, tuple[float, float, float]] | None = None   # key: (end, start, work s)
        self.slowed_s = 0.0
        self.debt_s = self.debt_at = 0.0

    def slowable(self) -> None:
        """Track the prefills (steps) in flight, so that :meth:`set_speed` can move their ends."""
        if self.in_flight is None:
            self.in_flight = {}

    def set_speed(self, now: float, speed: float) -> None:
        """From ``now`` on the instance computes at ``speed`` (0 < speed <= 1) of the profile's speed."""
        in_flight = self.in_flight
        if in_flight is None:
            raise RuntimeError("set_speed needs slowable() first")
        if speed == self.speed:
            return
        for key, (end, start, work) in list(in_flight.items()):
            end = now + (end - now) * self.speed / speed
            in_flight[key] = (end, start, work)
            heapq.heappush(self.heap, (end, self.kind, key))
        self.speed = speed

    def owe(self, now: float, rid: int, cpu_s: float) -> None:
        """The instance's cores owe ``cpu_s`` seconds of CPU to its sender of ``rid``'s KV, whose transfer
        starts ``now``: the prefill (step) started now ends that much later; with none, the instance pays
        from its idle time and the rest lengthens its next one."""
        in_flight = self.in_flight
        if in_flight is None:
            raise RuntimeError("owe needs slowable() first")
        for key, (end, start, work) in in_flight.items():
            if start == now:
                in_flight[key] = (end + cpu_s, start, work)
                heapq.heappush(self.heap, (end + cpu_s, self.kind, key))
                return
        self.debt_s = max(0.0, self.debt_s - (now - self.debt_at)) + cpu_s
        self.debt_at = now

    def _push(self, now: float, work: float, key: int) -> None:
        if self.in_flight is None:
            heapq.heappush(self.heap, (now + work, self.kind, key))
            return
        end = now + work / self.speed
        if self.debt_s:
            end += max(0.0, self.debt_s - (now - self.debt_at))
            self.debt_s = 0.0
        self.in_flight[key] = (end, now, work)
        heapq.heappush(self.heap, (end, self.kind, key))

    def _current(self, now: float, key: int) -> bool:
        """Whether the event of ``key`` at ``now`` is its end as last scheduled (not one a change of speed moved)."""
        in_flight = self.in_flight
        if in_flight is None:
            return True
        entry = in_flight.get(key)
        if entry is None or entry[0] != now:
            return False
        del in_flight[key]
        self.slowed_s += now - entry[1] - entry[2]
        return True

    @property
    def num_queued(self) -> int:
        return len(self.queue)

    def submit(self, now: float, rid: int, work: float, load_s: float = 0.0) -> None:
        """A request arrives: ``work`` is its prefill time T(l) (whole) or its uncached tokens l (chunked)."""
        self.work[rid] = work
        if load_s:
            self.load[rid] = load_s
        if self.chunk_tokens:
            self._append(rid)
            if self.idle:
                self._step(now, self.idle.pop())
        elif self.free:
            if load_s:
                self._set_aside(now, rid)
            else:
                self.free -= 1
                self._start(now, rid)
        else:
            self._append(rid)

    def on_loaded(self, now: float, rid: int) -> None:
        self.queue.appendleft(rid)
        self.max_queue = max(self.max_queue, len(self.queue))
        if self.chunk_tokens:
            if self.idle:
                self._step(now, self.idle.pop())
        elif self.free:
            self.free -= 1
            self._next(now)

    def _append(self, rid: int) -> None:
        queue = self.queue
        queue.append(rid)
        if len(queue) > self.max_queue:
            self.max_queue = len(queue)

    def _set_aside(self, now: float, rid: int) -> None:
        heapq.heappush(self.heap, (now + self.load[rid], self.loaded_kind, rid))
        self.load[rid] = 0.0

    def _take(self, now: float) -> int:
        """The oldest queued request ready to compute (starting the loads of those before it); -1 if none."""
        queue, load = self.queue, self.load
        while queue:
            rid = queue.popleft()
            if load[rid]:
                self._set_aside(now, rid)
                continue
            self.wait_s += now - self.arrival_t[rid]
            if self.started is not None:
                self.started(now, rid)
            return rid
        return -1

    # Whole requests -----------------------------------------------------------------------------

    def _start(self, now: float, rid: int) -> None:
        self._push(now, self.work[rid], rid)
        if self.started is not None:
            self.started(now, rid)

    def _next(self, now: float) -> bool:
        """Start the oldest ready request on the instance that just finished one; False if none."""
        rid = self._take(now)
        if rid < 0:
            return False
        self._push(now, self.work[rid], rid)
        return True

    def _on_prefilled(self, now: float, rid: int) -> None:
        if not self._current(now, rid):
            return
        if not self._next(now):
            self.free += 1
        self.finished(now, rid)

    # Chunked steps ------------------------------------------------------------------------------

    def _step(self, now: float, instance: int) -> None:
        """Form and start ``instance``'s next step; it goes idle when nothing is left."""
        budget, tokens, done, cost_of = float(self.chunk_tokens), self.work, self.done, self._cost
        running = self.running[instance]
        if running:
            rid = running[0]
            left = tokens[rid] - done[rid]
            if left > budget:                                  # whole steps of one running prefill
                end = done[rid] + (left // budget) * budget
                self._schedule(now, instance, cost_of(rid, end if end < tokens[rid] else tokens[rid]),
                               ((rid, end),))
                return
        pieces, cost = [], 0.0
        for rid in running:
            if budget <= 0:
                break
            end, budget = self._piece(rid, budget)
            cost += cost_of(rid, end)
            pieces.append((rid, end))
        while budget > 0:
            rid = self._take(now)
            if rid < 0:
                break
            running.append(rid)
            end, budget = self._piece(rid, budget)
            cost += cost_of(rid, end)
            pieces.append((rid, end))
        if pieces:
            self._schedule(now, instance, cost, tuple(pieces))
        else:
            self.idle.append(instance)

    def _piece(self, rid: int, budget: float) -> tuple[float, float]:
        return step_piece(self.work[rid], self.done[rid], budget)

    def _cost(self, rid: int, end: float) -> float:
        start = self.done[rid]
        return self.latency(end) - self.latency(start) if start else self.latency(end)

    def _schedule(self, now: float, instance: int, cost: float, pieces: tuple[tuple[int, float], ...]) -> None:
        self.pieces[instance] = pieces
        self._push(now, cost, self.event_base + instance)

    def _on_step(self, now: float, event: int) -> None:
        if not self._current(now, event):
            return
        instance = event - self.event_base
        tokens, done, running = self.work, self.done, self.running[instance]
        finished = []
        for rid, end in self.pieces[instance]:
            done[rid] = end
            if end >= tokens[rid]:
                finished.append(rid)
                running.popleft()
        self._step(now, instance)
        for rid in finished:
            self.finished(now, rid)


def step_piece(work: float, done: float, budget: float) -> tuple[float, float]:
    """(where a prompt's piece of this step ends, the step's token budget left after it), for a prompt
    of ``work`` tokens of which ``done`` are prefilled."""
    left = work - done
    if left <= budget:
        return work, budget - left
    return done + budget, 0.0


def _nothing(now: float, rid: int) -> None:
    return None
