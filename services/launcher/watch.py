"""`prfaas up`'s supervision: a service that exits without being asked to is restarted with backoff
(``supervisor:`` in the config) while the others keep serving; a crash loop ends the deployment.

Every restart is logged on `prfaas up`'s output and counted in a small JSON file in the log directory
(``launcher-stats.json``, written whole and renamed into place), which the router reads at each scrape
of its ``/metrics`` (``prfaas_launcher_restarts_total{service}``, services/router/launcher_stats.py):
the router's port, its authentication and its bounds serve the counter, and no other listener is opened."""
from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path

from services.config import SupervisorConfig
from services.launcher.restarts import Restarts, describe_exit
from services.launcher.supervisor import GROUP_EXIT_S, ROUTER_STAGE, Child

STATS_FILE = "launcher-stats.json"


class Watch:
    """Called every few hundred milliseconds by `prfaas up` while it serves; never blocks."""

    def __init__(self, children: list[Child], config: SupervisorConfig, stats_path: Path,
                 say: Callable[[str], None] = print) -> None:
        self.children = children
        self.config = config
        self.stats_path = stats_path
        self._say = say
        self._restarts = {c.name: Restarts(config) for c in children}
        self._restart_at: dict[str, float] = {}  # services waiting for their restart
        self._kill_at: dict[str, float] = {}     # ... whose leftover processes get SIGKILL then
        self._retired: set[str] = set()          # routers stopped on purpose while others serve on
        self._write_stats()

    def poll(self, now_s: float | None = None) -> str | None:
        """Restart what is due; returns why the deployment must stop (a crash loop, or an exit the
        policy does not restart), or None while it serves."""
        now_s = time.monotonic() if now_s is None else now_s
        for child in self.children:
            if child.name in self._restart_at:
                self._restart_when_due(child, now_s)
            elif child.exited and child.name not in self._retired:
                if reason := self._exited(child, now_s):
                    return reason
        return None

    def _router_retired(self, child: Child) -> bool:
        """One of several routers stopped cleanly (SIGTERM: it drained, exit status 0) while another
        still serves: the deployment goes on without it (`prfaas up --routers N`)."""
        others = [c for c in self.children if c.stage == ROUTER_STAGE and c is not child and not c.exited]
        if child.stage != ROUTER_STAGE or child.process.returncode != 0 or not others:
            return False
        self._retired.add(child.name)
        self._say(f"prfaas: {child.name} stopped (drained, exit status 0); still serving: "
                  f"{', '.join(c.name for c in others)}")
        return True

    def _exited(self, child: Child, now_s: float) -> str | None:
        how = describe_exit(child.process.returncode)
        restarts = self._restarts[child.name]
        decision = restarts.after_exit(child.process.returncode, now_s)
        if decision.kind == "crash_loop":
            return (f"prfaas: {child.name} exited ({how}) after {restarts.num_restarts} restarts in "
                    f"{self.config.crash_loop_window_s:.0f} s: a crash loop (supervisor.crash_loop_restarts); "
                    f"stopping the deployment. Its last log lines:\n{child.log_tail()}")
        if decision.kind == "stop" and self._router_retired(child):
            return None
        if decision.kind == "stop":
            return (f"prfaas: {child.name} exited ({how}; supervisor.restart: {self.config.restart}); stopping "
                    f"the deployment. Its last log lines:\n{child.log_tail()}")
        self._say(f"prfaas: {child.name} exited unexpectedly ({how}); restart {restarts.num_restarts} in "
                  f"{decision.delay_s:.1f} s; last log lines:\n{child.log_tail(5)}")
        child.signal_group(signal.SIGTERM)  # what is left of it (an engine core) stops before the restart
        self._restart_at[child.name] = now_s + decision.delay_s
        self._kill_at[child.name] = now_s + GROUP_EXIT_S
        self._write_stats()
        return None

    def _restart_when_due(self, child: Child, now_s: float) -> None:
        if child.group_alive:
            if now_s >= self._kill_at[child.name]:
                child.signal_group(signal.SIGKILL)
            return
        if now_s < self._restart_at[child.name]:
            return
        del self._restart_at[child.name], self._kill_at[child.name]
        child.start()
        self._say(f"started {child.name} (pid {child.process.pid}), log: {child.log_path} "
                  f"(restart {self._restarts[child.name].num_restarts})")

    def _write_stats(self) -> None:
        counts = {name: restarts.num_restarts for name, restarts in self._restarts.items()}
        partial = self.stats_path.with_suffix(".tmp")
        partial.write_text(json.dumps({"restarts": counts}))
        os.replace(partial, self.stats_path)
