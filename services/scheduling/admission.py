"""Admission control: admit a request, or reject it early with a reason (paper, section 3.4.3).

Pure functions of a snapshot (no I/O, no clock; :class:`PrefillQueue` takes the time from its
caller), shared by the router and the simulator. A QoS class may use the capacity left after the
reservations of all higher-priority classes, so as load grows the lowest classes are refused first
and reserved capacity stays free for the classes above. A request is also refused when its
predicted time to first token (queued prefill tokens on its path plus its own, over the path's
prefill rate) exceeds its class's SLO, and (when the snapshot carries the decode workers' loads)
when no decode worker could hold its KV at its completion (:mod:`services.scheduling.decode_load`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from services.scheduling.decode_load import DecodeLoad, decode_overload

RejectReason = Literal["no_worker", "capacity", "ttft_slo", "decode_load"]
MAX_RETRY_AFTER_S = 60


@dataclass(frozen=True, slots=True)
class QosClass:
    name: str
    priority: int = 0
    reserved_fraction: float = 0.0
    ttft_slo_s: float = 0.0


@dataclass(frozen=True, slots=True)
class AdmissionSnapshot:
    """The deployment as one request sees it at arrival (``queued``/``rate``: on the path it would take;
    ``decode_workers``: their loads when the decode-load check is on, else None)."""

    can_serve: bool
    capacity: int
    num_in_flight: int
    num_queued_prefill_tokens: int = 0
    prefill_tokens_per_s: float | None = None
    decode_workers: tuple[DecodeLoad, ...] | None = None
    decode_kv_limit: float = 1.0


@dataclass(frozen=True, slots=True)
class Rejection:
    reason: RejectReason
    retry_after_s: int
    detail: str

    @property
    def status(self) -> int:
        return 503 if self.reason == "no_worker" else 429


def class_limit(qos: QosClass, classes: tuple[QosClass, ...], capacity: int) -> float:
    """How many requests may be in flight when a request of ``qos`` is admitted."""
    reserved_above = sum(c.reserved_fraction for c in classes if c.priority > qos.priority)
    return capacity * max(1.0 - reserved_above, 0.0)


def predicted_ttft_s(num_prompt_tokens: int, snapshot: AdmissionSnapshot) -> float | None:
    """None when the path's prefill rate is unknown (neither configured nor measured yet)."""
    rate = snapshot.prefill_tokens_per_s
    if not rate or rate <= 0:
        return None
    return (snapshot.num_queued_prefill_tokens + num_prompt_tokens) / rate


def admit(qos: QosClass, classes: tuple[QosClass, ...], num_prompt_tokens: int, snapshot: AdmissionSnapshot,
          retry_after_s: int = 1, num_output_tokens: int = 0) -> Rejection | None:
    """None to admit; otherwise why not and when to retry. ``num_output_tokens``: the request's
    ``max_tokens`` (its KV growth until completion)."""
    if not snapshot.can_serve:
        return Rejection("no_worker", retry_after_s, "no worker can serve this request")
    limit = class_limit(qos, classes, snapshot.capacity)
    if snapshot.num_in_flight + 1 > limit:
        return Rejection("capacity", retry_after_s,
                         f"{snapshot.num_in_flight} requests in flight; class '{qos.name}' may use {limit:g}")
    ttft = predicted_ttft_s(num_prompt_tokens, snapshot)
    if qos.ttft_slo_s > 0 and ttft is not None and ttft > qos.ttft_slo_s:
        wait = min(max(math.ceil(ttft - qos.ttft_slo_s), retry_after_s), MAX_RETRY_AFTER_S)
        return Rejection("ttft_slo", wait, f"predicted time to first token {ttft:.2f} s exceeds the "
                         f"{qos.ttft_slo_s:.2f} s SLO of class '{qos.name}'")
    if snapshot.decode_workers is not None:
        overload = decode_overload(snapshot.decode_workers, num_prompt_tokens + num_output_tokens,
                                   snapshot.decode_kv_limit)
        if overload is not None:
            return Rejection("decode_load", retry_after_s, overload)
    return None


class PrefillQueue:
    """Prompt tokens admitted to one prefill path and not prefilled yet, and the path's prefill rate
    measured over its busy time (time with at least one prefill pending), over a sliding window.
    ``num_tokens_prefilled``: prompt tokens of all prefills that finished on the path since start."""

    def __init__(self, configured_tokens_per_s: float | None = None, window_s: float = 30.0) -> None:
        self.configured_tokens_per_s = configured_tokens_per_s
        self.window_s = window_s
        self.num_queued = 0
        self.num_queued_tokens = 0
        self._busy_since_s: float | None = None
        self._busy_s = 0.0
        self._num_prefilled_tokens = 0.0
        self.num_tokens_prefilled = 0

    @property
    def tokens_per_s(self) -> float | None:
        """Measured once a prefill finished on the path; the configured rate until then."""
        if self._num_prefilled_tokens > 0 and self._busy_s > 0:
            return self._num_prefilled_tokens / self._busy_s
        return self.configured_tokens_per_s

    def enqueue(self, num_tokens: int, now_s: float) -> None:
        if self.num_queued == 0:
            self._busy_since_s = now_s
        self.num_queued += 1
        self.num_queued_tokens += num_tokens

    def dequeue(self, num_tokens: int, now_s: float, prefilled: bool) -> None:
        """``prefilled``: the first token came (a rate sample); False for failed or cancelled requests."""
        self._account_busy(now_s)
        self.num_queued -= 1
        self.num_queued_tokens -= num_tokens
        if prefilled:
            self._num_prefilled_tokens += num_tokens
            self.num_tokens_prefilled += num_tokens
        if self.num_queued == 0:
            self._busy_since_s = None
        if self._busy_s > self.window_s:
            scale = self.window_s / self._busy_s
            self._busy_s *= scale
            self._num_prefilled_tokens *= scale

    def _account_busy(self, now_s: float) -> None:
        if self._busy_since_s is not None:
            self._busy_s += max(now_s - self._busy_since_s, 0.0)
            self._busy_since_s = now_s
