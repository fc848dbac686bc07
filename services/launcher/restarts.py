"""When `prfaas up` restarts a service that exited: a pure policy over exit times (no processes, no clock)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from services.config import SupervisorConfig


@dataclass(frozen=True, slots=True)
class Decision:
    """``restart`` after ``delay_s``; ``crash_loop``: it exited again after ``crash_loop_restarts``
    restarts within the window; ``stop``: the policy does not restart this exit."""

    kind: Literal["restart", "crash_loop", "stop"]
    delay_s: float = 0.0


@dataclass(slots=True)
class Restarts:
    """One service's restart history, asked once per unexpected exit."""

    config: SupervisorConfig
    times_s: list[float] = field(default_factory=list)  # when each restart was decided

    @property
    def num_restarts(self) -> int:
        return len(self.times_s)

    def after_exit(self, returncode: int, now_s: float) -> Decision:
        """What to do about an exit with ``returncode`` (negative: killed by that signal) at ``now_s``."""
        if not self._restarts(returncode):
            return Decision("stop")
        recent = [t for t in self.times_s if now_s - t < self.config.crash_loop_window_s]
        if len(recent) >= self.config.crash_loop_restarts:
            return Decision("crash_loop")
        self.times_s.append(now_s)
        delay = self.config.restart_backoff_s * 2 ** len(recent)
        return Decision("restart", min(delay, self.config.max_restart_backoff_s))

    def _restarts(self, returncode: int) -> bool:
        if self.config.restart == "always":
            return True
        return self.config.restart == "on-failure" and returncode != 0


def describe_exit(returncode: int) -> str:
    if returncode < 0:
        import signal

        try:
            return f"killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"killed by signal {-returncode}"
    return f"exit status {returncode}"
