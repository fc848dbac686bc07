"""A one-line progress bar on stderr (redrawn in place on a terminal, printed once at the end otherwise)."""
from __future__ import annotations

import sys
import time

WIDTH = 30
REDRAW_INTERVAL_S = 0.1


class Progress:
    def __init__(self, total: int | None, duration_s: float | None, stream=None, enabled: bool = True) -> None:
        self.total = total
        self.duration_s = duration_s
        self.stream = stream or sys.stderr
        self.enabled = enabled
        self.live = enabled and self.stream.isatty()
        self.num_sent = self.num_ok = self.num_rejected = self.num_failed = 0
        self.started = time.monotonic()
        self._drawn = 0.0

    def start(self) -> None:
        self.started = time.monotonic()

    def sent(self) -> None:
        self.num_sent += 1
        self._draw()

    def done(self, ok: bool, rejected: bool) -> None:
        if ok:
            self.num_ok += 1
        elif rejected:
            self.num_rejected += 1
        else:
            self.num_failed += 1
        self._draw()

    def close(self) -> None:
        if self.enabled:
            self.stream.write(("\r" if self.live else "") + self.line() + "\n")
            self.stream.flush()

    def line(self) -> str:
        elapsed = time.monotonic() - self.started
        finished = self.num_ok + self.num_rejected + self.num_failed
        if self.total:
            fraction = finished / self.total
        elif self.duration_s:
            fraction = elapsed / self.duration_s
        else:
            fraction = 0.0
        filled = int(WIDTH * min(1.0, fraction))
        target = f"/{self.total}" if self.total else ""
        return (f"[{'#' * filled}{'.' * (WIDTH - filled)}] {finished}{target} done, {self.num_sent - finished} "
                f"in flight, {self.num_rejected} rejected, {self.num_failed} failed, {elapsed:.1f}s")

    def _draw(self) -> None:
        now = time.monotonic()
        if self.live and now - self._drawn >= REDRAW_INTERVAL_S:
            self._drawn = now
            self.stream.write("\r" + self.line())
            self.stream.flush()
