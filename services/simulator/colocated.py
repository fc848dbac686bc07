"""Colocated ``both`` workers: one engine per instance that prefills the requests routed to it on the
local path and decodes every request whose decode worker it is (its own prefills and KV streamed from
the PrfaaS cluster), so prefill chunks and decode steps share each engine step.

The step model is additive: a step costs the latency curve's price of its prefill pieces (formed as
:mod:`services.simulator.prefill` forms chunked steps; with ``chunk_tokens`` 0 one whole request per
step) plus the decode step time when it also advances running decodes: ``step_curve`` at the number
decoding (the profile's step time by batch size), or ``step_s`` for any batch without one. A step with
no prefill advances only the decodes; such steps run back to back as one event until the next decode
ends, prefill work arrives or (with a step curve) the batch grows, each at the next step boundary. Every running
decode advances one token per step; at most ``max_batch_size`` decode at once, others wait for a slot
in arrival order. A request's first token comes at the end of the step that makes it, as in vLLM: a
local prefill's last piece; for KV streamed in, the first step the request runs in once its KV has
arrived and it holds a slot (the engine computes its last prompt token there), so it waits for the
step under way, a long prefill chunk maybe, and then for its own. Its TTFT ends there; each output
token after the first takes one more step. Pool loads as in :mod:`services.simulator.prefill`.

``decoding_changed``, when set, hears the share of the instances whose step advances decodes each
time it changes (the engine slows the PrfaaS prefill with it: ``RuntimeModel.colocated_interference``).
"""
from __future__ import annotations

import heapq
import math
from array import array
from collections import deque
from collections.abc import Callable

from services.planner.profiles import PiecewiseLinear
from services.scheduling.placement import WorkerView
from services.simulator.prefill import step_piece

Event = Callable[[float, int], None]
IDLE, MIXED, DECODING = range(3)
BOUNDARY_TOLERANCE = 1e-9        # steps: an arrival this close to a step boundary joins the step starting there


class ColocatedInstances:
    def __init__(self, num_instances: int, latency: PiecewiseLinear | None, chunk_tokens: int, max_batch_size: int,
                 step_s: float, output_tokens: int, kinds: tuple[int, int], heap: list, num_requests: int,
                 first_token: Event, step_curve: PiecewiseLinear | None = None) -> None:
        """``kinds``: heap event kinds of a finished step (keyed by instance and version) and of a finished
        pool load (keyed by request), routed by the owner to :meth:`on_step` and :meth:`on_loaded`.
        ``latency``: the local prefill curve (None: the deployment routes nothing to the local path)."""
        n = self.num_instances = num_instances
        self.latency, self.chunk_tokens, self.max_batch_size = latency, chunk_tokens, max_batch_size
        self.step_s, self.output_tokens, self.first_token = step_s, output_tokens, first_token
        self.step_curve = step_curve
        self.kind, self.loaded_kind = kinds
        self.heap = heap
        self.dest = array("i", bytes(4 * num_requests))
        self.work, self.done, self.load = (array("d", bytes(8 * num_requests)) for _ in range(3))
        self.since = array("d", bytes(8 * num_requests))
        self.streamed = bytearray(num_requests)      # 1: KV streamed in, its first token from a step of its own
        self.queue: list[deque[int]] = [deque() for _ in range(n)]          # prefills not started
        self.prefilling: list[deque[int]] = [deque() for _ in range(n)]     # chunked prefills started
        self.decoding: list[deque[tuple[int, int]]] = [deque() for _ in range(n)]   # (last step, rid)
        self.first_pending: list[deque[tuple[int, int]]] = [deque() for _ in range(n)]  # (step, rid): KV streamed in
        self.waiting: list[deque[int]] = [deque() for _ in range(n)]        # prefilled, no decode slot yet
        self.pieces: list[tuple[tuple[int, float], ...]] = [()] * n
        self.num_steps = [0] * n
        self.state, self.version = [IDLE] * n, [0] * n
        self.run_start, self.run_from, self.run_steps = [0.0] * n, [0] * n, [0] * n
        self.run_step_s = [step_s] * n          # the step time of the decode run under way
        self.num_in_flight, self.num_loading = [0] * n, [0] * n
        self.dirty: set[int] = set(range(n))
        self.prefill_wait_s = self.wait_s = 0.0
        self.max_prefill_queue = self.max_queue = 0
        self.finished: Event = _nothing
        self.decoding_now = [False] * n         # the step under way advances decodes
        self.num_decoding_now = 0
        self.decoding_changed: Callable[[float, float], None] | None = None

    @property
    def num_queued(self) -> int:
        """Requests waiting for a decode slot."""
        return sum(len(w) for w in self.waiting)

    @property
    def num_prefill_queued(self) -> int:
        return sum(len(q) for q in self.queue)

    def routed(self, instance: int) -> None:
        self.num_in_flight[instance] += 1
        self.dirty.add(instance)

    def view(self, instance: int) -> WorkerView:
        running = len(self.prefilling[instance]) + len(self.decoding[instance])
        waiting = len(self.queue[instance]) + len(self.waiting[instance]) + self.num_loading[instance]
        return WorkerView(f"both-{instance}", True, role="both", cluster="local", generates=True, prefills=True,
                          receives_kv=True, num_in_flight=self.num_in_flight[instance], num_running=running,
                          num_waiting=waiting)

    # Arrivals -------------------------------------------------------------------------------------

    def prefill(self, now: float, rid: int, tokens: float, load_s: float = 0.0) -> None:
        """A local-path request arrives with ``tokens`` uncached prompt tokens."""
        instance = self.dest[rid]
        self.work[rid], self.since[rid] = tokens, now
        if load_s:
            self.load[rid] = load_s
        queue = self.queue[instance]
        queue.append(rid)
        self.max_prefill_queue = max(self.max_prefill_queue, len(queue))
        self._prefill_arrived(now, instance)

    def submit(self, now: float, rid: int) -> None:
        """``rid``'s KV is complete on its decode instance (streamed from the PrfaaS cluster)."""
        instance = self.dest[rid]
        self.streamed[rid] = 1
        self._to_decode(now, instance, rid)
        if self.state[instance] == IDLE:
            self._next_step(now, instance)

    def on_loaded(self, now: float, rid: int) -> None:
        instance = self.dest[rid]
        self.num_loading[instance] -= 1
        self.queue[instance].appendleft(rid)
        self._prefill_arrived(now, instance)

    def _prefill_arrived(self, now: float, instance: int) -> None:
        self.dirty.add(instance)
        state = self.state[instance]
        if state == IDLE:
            self._next_step(now, instance)
        elif state == DECODING:
            self._cut_run(now, instance)

    def _cut_run(self, now: float, instance: int) -> int:
        """End the decode run under way at the next step boundary; the steps done there."""
        boundary = self._next_boundary(now, instance)
        if boundary < self.run_steps[instance]:
            self.run_steps[instance] = boundary
            self._schedule(self.run_start[instance] + boundary * self.run_step_s[instance], instance)
        return boundary

    def _next_boundary(self, now: float, instance: int) -> int:
        """Steps of the decode run done at the first step boundary at or after ``now``."""
        steps = math.ceil((now - self.run_start[instance]) / self.run_step_s[instance] - BOUNDARY_TOLERANCE)
        return min(steps, self.run_steps[instance])

    def _decode_step_s(self, instance: int) -> float:
        """One decode step of the batch decoding on ``instance`` now."""
        return self.step_curve(len(self.decoding[instance])) if self.step_curve is not None else self.step_s

    # Decode slots ---------------------------------------------------------------------------------

    def _to_decode(self, now: float, instance: int, rid: int) -> None:
        self.dirty.add(instance)
        if len(self.decoding[instance]) < self.max_batch_size and not self.waiting[instance]:
            self._join(now, instance, rid)
            return
        self.since[rid] = now
        waiting = self.waiting[instance]
        waiting.append(rid)
        self.max_queue = max(self.max_queue, len(waiting))

    def _join(self, now: float, instance: int, rid: int) -> None:
        """``rid`` decodes from the next step on. KV streamed in: that step makes its first token and
        ``output_tokens - 1`` more follow; a local prefill made its first token (now), ``output_tokens - 1``
        steps make the rest."""
        first = self.num_steps[instance]
        state = self.state[instance]
        if state == MIXED:
            first += 1
        elif state == DECODING:             # with a step curve the batch's new size ends the run
            boundary = self._cut_run(now, instance) if self.step_curve is not None else \
                self._next_boundary(now, instance)
            first = self.run_from[instance] + boundary
        decoding = self.decoding[instance]
        last = first + self.output_tokens - (0 if self.streamed[rid] else 1)
        index = len(decoding)
        while index and decoding[index - 1][0] > last:      # kept in order of last step
            index -= 1
        decoding.insert(index, (last, rid))
        if self.streamed[rid]:
            self.first_pending[instance].append((first, rid))
        else:
            self.first_token(now, rid)

    # Steps ----------------------------------------------------------------------------------------

    def on_step(self, now: float, key: int) -> None:
        instance = key % self.num_instances
        if key // self.num_instances != self.version[instance]:
            return                               # a decode run cut short by prefill work
        run = self.state[instance] == DECODING
        if run:
            self.num_steps[instance] = self.run_from[instance] + self.run_steps[instance]
        else:
            self.num_steps[instance] += 1
        self.state[instance] = IDLE
        self.dirty.add(instance)
        decoding, step = self.decoding[instance], self.num_steps[instance]
        pending = self.first_pending[instance]
        while pending and pending[0][0] < step:     # streamed-in requests whose first step just ended
            first, rid = pending.popleft()
            at = self.run_start[instance] + (first - self.run_from[instance] + 1) * self.run_step_s[instance] \
                if run else now
            self.first_token(at, rid)
        while decoding and decoding[0][0] <= step:
            self.num_in_flight[instance] -= 1
            self.finished(now, decoding.popleft()[1])
        for rid, end in self.pieces[instance]:
            self.done[rid] = end
            if end >= self.work[rid]:
                self.prefilling[instance].popleft()
                self._to_decode(now, instance, rid)
        self.pieces[instance] = ()
        waiting = self.waiting[instance]
        while waiting and len(decoding) < self.max_batch_size:
            rid = waiting.popleft()
            self.wait_s += now - self.since[rid]
            self._join(now, instance, rid)
        self._next_step(now, instance)

    def _next_step(self, now: float, instance: int) -> None:
        pieces, cost = self._prefill_pieces(now, instance)
        decoding = self.decoding[instance]
        if pieces:
            self.pieces[instance] = pieces
            self.state[instance] = MIXED
            self._schedule(now + cost + (self._decode_step_s(instance) if decoding else 0.0), instance)
        elif decoding:
            self.state[instance] = DECODING
            self.run_start[instance], self.run_from[instance] = now, self.num_steps[instance]
            self.run_steps[instance] = decoding[0][0] - self.num_steps[instance]
            self.run_step_s[instance] = self._decode_step_s(instance)
            self._schedule(now + self.run_steps[instance] * self.run_step_s[instance], instance)
        decoding_now = self.state[instance] != IDLE and bool(decoding)
        if decoding_now != self.decoding_now[instance]:
            self.decoding_now[instance] = decoding_now
            self.num_decoding_now += 1 if decoding_now else -1
            if self.decoding_changed is not None:
                self.decoding_changed(now, self.num_decoding_now / self.num_instances)

    def _prefill_pieces(self, now: float, instance: int) -> tuple[tuple[tuple[int, float], ...], float]:
        """This step's prefill pieces: started prefills first, then queued ones while budget is left."""
        budget = float(self.chunk_tokens) if self.chunk_tokens else math.inf
        pieces, cost = [], 0.0
        prefilling = self.prefilling[instance]
        for rid in prefilling:
            if budget <= 0:
                break
            end, budget = self._piece(rid, budget)
            cost += self._cost(rid, end)
            pieces.append((rid, end))
        while budget > 0 and not (pieces and not self.chunk_tokens):
            rid = self._take(now, instance)
            if rid < 0:
                break
            prefilling.append(rid)
            end, budget = self._piece(rid, budget)
            cost += self._cost(rid, end)
            pieces.append((rid, end))
        return tuple(pieces), cost

    def _take(self, now: float, instance: int) -> int:
        queue = self.queue[instance]
        while queue:
            rid = queue.popleft()
            if self.load[rid]:
                heapq.heappush(self.heap, (now + self.load[rid], self.loaded_kind, rid))
                self.load[rid] = 0.0
                self.num_loading[instance] += 1
                continue
            self.prefill_wait_s += now - self.since[rid]
            return rid
        return -1

    def _piece(self, rid: int, budget: float) -> tuple[float, float]:
        return step_piece(self.work[rid], self.done[rid], budget)

    def _cost(self, rid: int, end: float) -> float:
        latency, start = self.latency, self.done[rid]
        if latency is None:
            raise ValueError("a colocated worker got a local prefill, but the deployment has no local prefill profile")
        return latency(end) - latency(start) if start else latency(end)

    def _schedule(self, at: float, instance: int) -> None:
        self.version[instance] += 1
        heapq.heappush(self.heap, (at, self.kind, self.version[instance] * self.num_instances + instance))


def _nothing(now: float, rid: int) -> None:
    return None
