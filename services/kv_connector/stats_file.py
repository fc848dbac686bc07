"""Connector telemetry that does not wait for the engine to step.

vLLM's own connector-stats channel carries stats only on engine steps. A prefill engine frees a
request's blocks once the send has copied them, then idles while the KV is still on the wire, so a
link that slows down, drops packets or queues would report nothing until the next prompt: in the
chaos benchmark a 10x bandwidth cut went unseen for its whole minute. So the connector does not use
that channel: each TP rank's worker-side connector writes its snapshot (``ConnectorSnapshot.as_dict()``,
JSON) to ``connector-<rank>.json`` in the worker's private directory (``services.engine.ipc_dir``,
mode 0700) from a thread of its own, every ``PUBLISH_S`` while it changes; the worker's front end
reads and sums the ranks' files when asked for stats. A file is replaced whole (written beside it,
then renamed), so a reader never sees half of one.
"""
from __future__ import annotations

import json
import logging
import os
import threading
from collections.abc import Callable
from pathlib import Path

from services.kv_connector.snapshot import ConnectorSnapshot

logger = logging.getLogger(__name__)

PUBLISH_S = 0.25
PATTERN = "connector-*.json"


def rank_path(directory: str | Path, tp_rank: int) -> Path:
    return Path(directory) / f"connector-{tp_rank}.json"


class StatsPublisher:
    """Writes ``snapshot()`` to ``path`` every ``interval_s`` when it changed, until ``close``."""

    def __init__(self, path: Path, snapshot: Callable[[], ConnectorSnapshot], interval_s: float = PUBLISH_S) -> None:
        self._path = path
        self._snapshot = snapshot
        self._interval_s = interval_s
        self._stop = threading.Event()
        self._last: dict | None = None
        self._thread = threading.Thread(target=self._run, name="prfaas-kv-stats", daemon=True)
        self._thread.start()

    def publish(self) -> None:
        data = self._snapshot().as_dict()
        if data == self._last:
            return
        partial = self._path.with_name(self._path.name + ".part")
        partial.write_text(json.dumps(data))
        os.replace(partial, self._path)
        self._last = data

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _run(self) -> None:
        failed = False
        while not self._stop.wait(self._interval_s):
            try:
                self.publish()
                failed = False
            except OSError as exc:
                if not self._path.parent.is_dir():  # the worker removed its directory: it is stopping
                    return
                if not failed:  # the disk is full, say: said once, tried again
                    logger.warning("connector telemetry not written to %s: %s", self._path, exc)
                failed = True


def read_stats(directory: str | Path) -> ConnectorSnapshot | None:
    """The ranks' latest snapshots summed into one; None when no rank has written one yet."""
    snapshots = []
    for path in sorted(Path(directory).glob(PATTERN)):
        try:
            snapshots.append(ConnectorSnapshot.from_dict(json.loads(path.read_text())))
        except (OSError, ValueError, TypeError) as exc:  # replaced whole, so only a bug or a stray file lands here
            logger.warning("connector telemetry in %s not read: %s", path, exc)
    return ConnectorSnapshot.summed(snapshots) if snapshots else None
