"""Admission control at the router: a request's QoS class, admit or reject (429/503 with
``Retry-After``), and the in-flight and per-path prefill-queue accounting the decision reads.
The decision itself is ``services.scheduling.admission.admit``; this module adds HTTP and metrics."""
from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from services.config import DeploymentConfig
from services.router.errors import ApiError, bad_request, overloaded, unavailable
from services.router.metrics import RouterMetrics
from services.router.workers import WorkerPool
from services.scheduling.admission import AdmissionSnapshot, PrefillQueue, QosClass, Rejection, admit
from services.scheduling.decode_load import DecodeLoad
from services.scheduling.placement import Route

logger = logging.getLogger(__name__)

QOS_HEADER = "X-PrfaaS-QoS"
PATHS = ("local", "pd", "prfaas")


class PrefillQueues:
    """One :class:`PrefillQueue` per path on the router's monotonic clock. The dispatcher calls
    :meth:`enqueue` when it routes a request and :meth:`dequeue` at its first token or failure."""

    def __init__(self, configured_tokens_per_s: dict[str, float], metrics: RouterMetrics,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._queues = {path: PrefillQueue(configured_tokens_per_s.get(path)) for path in PATHS}
        self._metrics = metrics
        self._clock = clock
        for path in PATHS:
            self._export(path)

    def queue(self, path: str) -> PrefillQueue:
        return self._queues[path]

    def enqueue(self, path: str, num_tokens: int) -> None:
        self._queues[path].enqueue(num_tokens, self._clock())

    def dequeue(self, path: str, num_tokens: int, prefilled: bool) -> None:
        self._queues[path].dequeue(num_tokens, self._clock(), prefilled)
        self._export(path)

    def _export(self, path: str) -> None:
        rate = self._queues[path].tokens_per_s
        if rate is not None:
            self._metrics.prefill_rate.labels(path).set(rate)


class AdmissionControl:
    """Called by the HTTP handler: :meth:`qos_class` before tokenizing, :meth:`admitted` around the
    generation. Never blocks."""

    def __init__(self, config: DeploymentConfig, pool: WorkerPool, queues: PrefillQueues,
                 metrics: RouterMetrics) -> None:
        scheduler = config.scheduler
        self._classes = tuple(QosClass(q.name, q.priority, q.reserved_fraction, q.ttft_slo_ms / 1000)
                              for q in scheduler.qos_classes) or (QosClass("default"),)
        self._by_name = {q.name: q for q in self._classes}
        self._by_key = {key: self._by_name[q.name] for q in scheduler.qos_classes for key in q.api_keys}
        self._default = self._by_name[scheduler.default_qos_class]
        self._max_in_flight = scheduler.max_in_flight_requests
        self._retry_after_s = scheduler.retry_after_s
        self._max_num_seqs = {w.name: config.engine_for(w).max_num_seqs for w in config.workers}
        self._decode_load = scheduler.decode_load_admission
        self._decode_kv_capacity_tokens = scheduler.decode_kv_capacity_tokens
        self._decode_kv_limit = scheduler.decode_kv_limit
        self._pool = pool
        self._queues = queues
        self._metrics = metrics
        self.num_in_flight = 0
        for qos in self._classes:
            metrics.in_flight.labels(qos.name).set(0)

    def qos_class(self, header: str | None, api_key: str | None) -> QosClass:
        """The header's class (400 if unknown; 403 above the API key's class), else the key's, else the default."""
        keyed = self._by_key.get(api_key or "")
        if header is None:
            return keyed or self._default
        qos = self._by_name.get(header.strip())
        if qos is None:
            raise bad_request(f"Unknown QoS class {header!r} in the {QOS_HEADER} header (configured: "
                              f"{', '.join(self._by_name)})", param=QOS_HEADER, code="unknown_qos_class")
        if keyed is not None and qos.priority > keyed.priority:
            raise ApiError(403, f"QoS class {qos.name!r} is above the class of this API key ({keyed.name!r})",
                           type="permission_error", param=QOS_HEADER, code="qos_class_not_allowed")
        return qos

    @contextmanager
    def admitted(self, request_id: str, qos: QosClass, route: Route | None, num_prompt_tokens: int,
                 num_output_tokens: int = 0) -> Iterator[None]:
        """Raises ApiError (429/503) to reject; otherwise counts the request in flight while inside.
        ``route``: the dispatcher's decision for this request (``Dispatcher.plan``), the one it will
        serve it on: admission reads that path's prefill queue and never routes on its own.
        ``num_output_tokens``: the request's ``max_tokens``, for the decode-load prediction."""
        rejection = admit(qos, self._classes, num_prompt_tokens, self.snapshot(route),
                          self._retry_after_s, num_output_tokens)
        if rejection is not None:
            self._metrics.rejected.labels(rejection.reason, qos.name).inc()
            logger.debug("request %s: rejected (%s, class %s): %s", request_id, rejection.reason, qos.name,
                         rejection.detail)
            raise _error(rejection)
        self._metrics.admitted.labels(qos.name).inc()
        self._metrics.in_flight.labels(qos.name).inc()
        self.num_in_flight += 1
        try:
            yield
        finally:
            self.num_in_flight -= 1
            self._metrics.in_flight.labels(qos.name).dec()

    def snapshot(self, route: Route | None) -> AdmissionSnapshot:
        if route is None:
            return AdmissionSnapshot(can_serve=False, capacity=0, num_in_flight=self.num_in_flight)
        queue = self._queues.queue(route.path)
        return AdmissionSnapshot(can_serve=True, capacity=self.capacity, num_in_flight=self.num_in_flight,
                                 num_queued_prefill_tokens=queue.num_queued_tokens,
                                 prefill_tokens_per_s=queue.tokens_per_s,
                                 decode_workers=self.decode_loads() if self._decode_load else None,
                                 decode_kv_limit=self._decode_kv_limit)

    def decode_loads(self) -> tuple[DecodeLoad, ...]:
        """The usable generating workers as the decode-load check sees them."""
        loads = []
        for handle, view in zip(self._pool.handles, self._pool.views()):
            if view.generates and view.healthy:
                loads.append(DecodeLoad(handle.name, view.load, self._max_num_seqs[handle.name], view.kv_cache_usage,
                                        handle.num_committed_tokens, self._decode_kv_capacity_tokens))
        return tuple(loads)

    @property
    def capacity(self) -> int:
        if self._max_in_flight:
            return self._max_in_flight
        return sum(self._max_num_seqs[v.name] for v in self._pool.views() if v.generates and v.healthy)


def _error(rejection: Rejection) -> ApiError:
    if rejection.status == 503:
        return unavailable("No worker is available to serve this request; try again later", rejection.retry_after_s)
    return overloaded(f"The server is overloaded: {rejection.detail}; retry after {rejection.retry_after_s} s",
                      code=rejection.reason, retry_after_s=rejection.retry_after_s)
