"""Retry back-off for workers that failed a call: exponential, capped, reset by a success.

A worker whose call failed is skipped until ``retry_at_s``; each further failure doubles the wait
(``base_s * 2**(n-1)``, at most ``max_s``). A health check alone does not end the back-off, so a
worker that answers health checks but fails requests is not retried every poll. Pure: the caller
supplies the clock.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class BackoffConfig:
    base_s: float = 1.0
    max_s: float = 30.0


@dataclass(slots=True)
class Backoff:
    config: BackoffConfig
    num_failures: int = 0
    retry_at_s: float = 0.0

    def fail(self, now_s: float) -> float:
        """Records a failure; returns the wait before the worker is tried again."""
        self.num_failures += 1
        wait: float = min(self.config.base_s * 2.0 ** min(self.num_failures - 1, 32), self.config.max_s)
        self.retry_at_s = now_s + wait
        return wait

    def succeed(self) -> None:
        self.num_failures = 0
        self.retry_at_s = 0.0

    def available(self, now_s: float) -> bool:
        return now_s >= self.retry_at_s
