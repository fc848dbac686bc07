"""Link signals: successive telemetry of the PrfaaS prefill workers' KV links, differenced into the
:class:`~services.scheduling.congestion.LinkSample` the threshold controller observes.

Pure: the caller (``services.router.threshold_control``) supplies the clock and each worker's latest
telemetry, read through the :class:`WorkerTelemetry` protocol (the router's ``WorkerStats``).
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from services.scheduling.congestion import LinkSample

SEGMENT_BYTES = 1448
# A prefill worker's connector publishes its link telemetry every 0.25 s while it changes
# (services/kv_connector/stats_file.py), so nothing new while its links idle: figures older than
# this describe no current traffic.
STALE_S = 3.0


class LinkTelemetry(Protocol):
    """Cumulative figures of one KV link a worker sends on."""

    @property
    def peer(self) -> str: ...

    @property
    def bytes_sent(self) -> int: ...

    @property
    def retransmits(self) -> int: ...

    @property
    def transfers_failed(self) -> int: ...

    @property
    def rtt_ms(self) -> float: ...


class WorkerTelemetry(Protocol):
    """What link signals read of one prefill worker's stats."""

    @property
    def kv_links(self) -> Sequence[LinkTelemetry]: ...

    @property
    def num_waiting_requests(self) -> int: ...



@dataclass(frozen=True, slots=True)
class _Totals:
    bytes_sent: int
    retransmits: int
    transfers_failed: int


@dataclass(frozen=True, slots=True)
class _Reading:
    """One worker's link between its last two distinct telemetry snapshots, seen at ``at_s``."""

    totals: _Totals
    at_s: float
    num_bytes: int = 0
    num_retransmits: int = 0
    elapsed_s: float = 0.0
    rtt_increase_ms: float = 0.0


class LinkSignals:
    """Differences the PrfaaS prefill workers' successive telemetry into link samples. Rates come
    from distinct snapshots (a poll that finds the same snapshot again repeats the previous figures,
    up to ``STALE_S``, then reads as an idle link), so a poll interval shorter than the snapshot
    interval does not alias into 0/2x rates, and a stale RTT does not read as congestion. A worker
    is usable when it is healthy and none of its transfers failed since the previous poll."""

    def __init__(self) -> None:
        self._previous: dict[str, _Totals] = {}
        self._readings: dict[str, _Reading] = {}
        self._min_rtt_ms: dict[tuple[str, str], float] = {}

    def sample(self, now_s: float, workers: Sequence[tuple[str, bool, WorkerTelemetry]],
               waiting_elsewhere: Mapping[str, int] | None = None) -> LinkSample:
        """``waiting_elsewhere``: per worker, its requests queued before they reach it (the router's
        hand-off waits); they count in the PrfaaS queue with the worker's own waiting requests."""
        waiting_elsewhere = waiting_elsewhere or {}
        num_bytes = num_retransmits = num_queued = num_usable = 0
        egress_bps = rtt_increase = 0.0
        for name, healthy, stats in workers:
            totals = _totals(stats)
            previous = self._previous.get(name, totals)
            self._previous[name] = totals
            reading = self._read(name, now_s, totals, stats)
            if now_s - reading.at_s <= STALE_S and reading.elapsed_s > 0:
                num_bytes += reading.num_bytes
                num_retransmits += reading.num_retransmits
                egress_bps += reading.num_bytes * 8 / reading.elapsed_s
                rtt_increase = max(rtt_increase, reading.rtt_increase_ms)
            if healthy:
                num_queued += stats.num_waiting_requests + waiting_elsewhere.get(name, 0)
                num_usable += totals.transfers_failed <= previous.transfers_failed
        return LinkSample(
            now_s=now_s,
            egress_gbps=egress_bps / 1e9,
            retransmit_ratio=num_retransmits / max(num_bytes / SEGMENT_BYTES, 1.0),
            rtt_increase_ms=rtt_increase,
            num_queued=num_queued,
            num_usable_workers=num_usable,
        )

    def _read(self, worker: str, now_s: float, totals: _Totals, stats: WorkerTelemetry) -> _Reading:
        last = self._readings.get(worker)
        if last is not None and totals == last.totals:
            return last
        rtt_increase = self._rtt_increase(worker, stats)
        reading = _Reading(totals, now_s)
        if last is not None:
            reading = _Reading(totals, now_s, num_bytes=max(totals.bytes_sent - last.totals.bytes_sent, 0),
                               num_retransmits=max(totals.retransmits - last.totals.retransmits, 0),
                               elapsed_s=min(now_s - last.at_s, STALE_S), rtt_increase_ms=rtt_increase)
        self._readings[worker] = reading
        return reading

    def _rtt_increase(self, worker: str, stats: WorkerTelemetry) -> float:
        increase = 0.0
        for link in stats.kv_links:
            if link.rtt_ms <= 0:
                continue
            key = (worker, link.peer)
            lowest = min(self._min_rtt_ms.get(key, link.rtt_ms), link.rtt_ms)
            self._min_rtt_ms[key] = lowest
            increase = max(increase, link.rtt_ms - lowest)
        return increase


def _totals(stats: WorkerTelemetry) -> _Totals:
    return _Totals(bytes_sent=sum(link.bytes_sent for link in stats.kv_links),
                   retransmits=sum(link.retransmits for link in stats.kv_links),
                   transfers_failed=sum(link.transfers_failed for link in stats.kv_links))
