"""Progress of a profile on stderr: which point, its result, elapsed time and an estimate of what is left."""
from __future__ import annotations

import sys
import time
from typing import TextIO

DECODE_TOKEN_COST = 10  # one decode token costs about as much as this many prefill tokens (CPU, small model)


def point_cost(kind: str, tokens: int, batch_size: int = 1, steps: int = 0) -> float:
    """A point's work in prefill-token equivalents, for the time estimate."""
    return tokens * batch_size + steps * batch_size * DECODE_TOKEN_COST if kind == "decode" else float(tokens)


class Progress:
    def __init__(self, total_cost: float, num_points: int, stream: TextIO | None = None) -> None:
        self._stream = stream or sys.stderr
        self._started = time.monotonic()
        self._remaining_cost = total_cost
        self._num_points = num_points
        self._index = 0
        self._measured_cost = 0.0
        self._measured_s = 0.0

    def add_points(self, count: int, cost: float) -> None:
        self._num_points += count
        self._remaining_cost += cost

    def note(self, message: str) -> None:
        print(f"[profile {self._clock(time.monotonic() - self._started)}] {message}", file=self._stream, flush=True)

    def done(self, description: str, result: str, cost: float, seconds: float | None) -> None:
        """One point finished: ``seconds`` it took to measure, None when it came from the cache."""
        self._index += 1
        self._remaining_cost = max(self._remaining_cost - cost, 0.0)
        if seconds is not None:
            self._measured_cost += cost
            self._measured_s += seconds
        source = "cached" if seconds is None else f"{seconds:.1f} s"
        self.note(f"{self._index}/{self._num_points} {description}: {result} ({source}; ETA {self._eta()})")

    def _eta(self) -> str:
        if self._measured_cost <= 0:
            return "?"
        return self._clock(self._remaining_cost * self._measured_s / self._measured_cost)

    @staticmethod
    def _clock(seconds: float) -> str:
        minutes, rest = divmod(int(round(seconds)), 60)
        return f"{minutes}:{rest:02d}"
