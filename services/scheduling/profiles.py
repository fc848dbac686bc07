"""Workload and cluster profiles measured online, for the long-timescale re-optimisation of the
offload threshold t (paper, section 3.4.3; ``CongestionAwareThreshold.reoptimize``).

The planner's :class:`~services.scheduling.threshold.OffloadModel` needs the length distribution,
the KV size by length and the local prefill time by length. Here they come from the running
deployment instead of offline profiles:

- **lengths**: a bounded sliding sample of recent prompt lengths, which also gives the arrival rate;
- **KV bytes per prompt token**: the PrfaaS prefill workers' sent KV bytes over the prompt tokens
  prefilled on the PrfaaS path in the same period, smoothed over periods (EWMA); periods without
  offloaded tokens teach nothing and are skipped. It is what actually crossed the link (framing
  included, cached prefixes excluded), so S_kv(L) = L * bytes per token;
- **local prefill time**: L / R, with R the local prefill path's rate in tokens per second of its
  busy time (``PrefillQueue.tokens_per_s``). ``arrival_rate * E[L; L <= t] / R`` is then the share
  of time the local path would be busy, the local utilization the model compares with the link's.

Pure: no I/O and no clock; every call takes the caller's time.
"""
from __future__ import annotations

import bisect
import itertools
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

from services.scheduling.threshold import OffloadModel

MAX_SAMPLES = 4096


@dataclass(frozen=True, slots=True)
class LengthSample:
    """Prompt lengths in ascending order, with prefix sums for partial expectations."""

    lengths: tuple[int, ...]
    cumulative: tuple[int, ...]

    @classmethod
    def of(cls, lengths: Iterable[int]) -> LengthSample:
        ordered = tuple(sorted(lengths))
        return cls(ordered, (0, *itertools.accumulate(ordered)))

    @property
    def num_samples(self) -> int:
        return len(self.lengths)

    @property
    def mean(self) -> float:
        return self.cumulative[-1] / max(self.num_samples, 1)

    def mean_up_to(self, t: float) -> float:
        """E[L; L <= t] over the sample."""
        return self.cumulative[bisect.bisect_right(self.lengths, t)] / max(self.num_samples, 1)

    def mean_above(self, t: float) -> float:
        """E[L; L > t] over the sample."""
        return (self.cumulative[-1] - self.cumulative[bisect.bisect_right(self.lengths, t)]) / max(self.num_samples, 1)


class OnlineProfiles:
    """Fed by the router: :meth:`record_request` per admitted request, :meth:`record_kv_transfer` once
    per period; read by the re-optimisation through :meth:`offload_model` and :meth:`arrival_rate`."""

    def __init__(self, start_s: float, window_s: float = 300.0, max_samples: int = MAX_SAMPLES,
                 min_samples: int = 32, kv_smoothing: float = 0.5) -> None:
        if window_s <= 0 or max_samples < 1 or min_samples < 1 or not 0 < kv_smoothing <= 1:
            raise ValueError("need window_s > 0, max_samples >= 1, min_samples >= 1, 0 < kv_smoothing <= 1")
        self.window_s = window_s
        self.min_samples = min_samples
        self.kv_smoothing = kv_smoothing
        self.kv_bytes_per_token: float | None = None
        self._num_pending_tokens = 0
        self._requests: deque[tuple[float, int]] = deque(maxlen=max_samples)
        self._since_s = start_s

    def record_request(self, now_s: float, num_prompt_tokens: int) -> None:
        if len(self._requests) == self._requests.maxlen:
            self._since_s = max(self._since_s, self._requests[0][0])
        self._requests.append((now_s, num_prompt_tokens))
        self._forget(now_s)

    def record_kv_transfer(self, num_bytes: int, num_tokens: int) -> None:
        """One period: the KV bytes the PrfaaS prefill workers sent and the prompt tokens prefilled there.
        Worker telemetry lags the router's count of prefilled tokens, so bytes of a period without
        tokens (late bytes of an earlier one) are dropped, and tokens of a period without bytes wait
        for theirs in the next one."""
        self._num_pending_tokens += max(num_tokens, 0)
        if self._num_pending_tokens <= 0 or num_bytes <= 0:
            return
        measured = num_bytes / self._num_pending_tokens
        self._num_pending_tokens = 0
        previous = self.kv_bytes_per_token
        self.kv_bytes_per_token = measured if previous is None else (
            self.kv_smoothing * measured + (1 - self.kv_smoothing) * previous)

    def lengths(self, now_s: float) -> LengthSample:
        self._forget(now_s)
        return LengthSample.of(n for _, n in self._requests)

    def arrival_rate(self, now_s: float) -> float:
        """Requests per second over the time the sample covers."""
        self._forget(now_s)
        span = now_s - self._since_s
        return len(self._requests) / span if span > 0 else 0.0

    def missing(self, now_s: float) -> str | None:
        """Why no model can be built yet, or None."""
        self._forget(now_s)
        if len(self._requests) < self.min_samples:
            return f"{len(self._requests)} requests in the last {self.window_s:g} s (need {self.min_samples})"
        if self.kv_bytes_per_token is None:
            return "no KV bytes per token yet (no tokens prefilled on the PrfaaS path)"
        return None

    def offload_model(self, now_s: float, min_tokens: float, max_tokens: float,
                      local_tokens_per_s: float | None, headroom: float = 0.75) -> OffloadModel | None:
        """The planner's model over the sampled lengths; None while :meth:`missing` says why. Without
        a local prefill rate the model has no local load (the ceiling stays at ``max_tokens``)."""
        if self.missing(now_s) is not None:
            return None
        sample = self.lengths(now_s)
        bytes_per_token = self.kv_bytes_per_token
        assert bytes_per_token is not None  # missing() says so otherwise

        def offloaded_kv_bytes(t: float) -> float:
            return bytes_per_token * sample.mean_above(t)

        local_prefill_s = None
        if local_tokens_per_s is not None and local_tokens_per_s > 0:
            def local_prefill_s(t: float) -> float:
                return sample.mean_up_to(t) / local_tokens_per_s

        return OffloadModel(offloaded_kv_bytes, min_tokens=min_tokens, max_tokens=max_tokens,
                            local_prefill_s=local_prefill_s, headroom=headroom)

    def _forget(self, now_s: float) -> None:
        horizon = now_s - self.window_s
        if self._since_s < horizon:
            self._since_s = horizon
        while self._requests and self._requests[0][0] < horizon:
            self._requests.popleft()
