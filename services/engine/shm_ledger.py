"""Shared-memory segments that a killed worker leaves behind, found and removed by its next start.

vLLM's engine processes share POSIX shared-memory segments (``/dev/shm/psm_*``: the message queues
between the engine core and its workers, 160-240 MiB each here, and ``sem.*`` semaphores). A clean
stop unlinks them. SIGKILL of the worker's process group also kills the resource tracker that would
have unlinked them, and the files stay, holding tmpfs memory until the host reboots: measured, 25
of them after a day of tests and chaos runs that kill workers.

So a worker writes down the segments its processes map once its engine is up, in a ledger under
``<cache dir>/run/`` named after the worker and its address, with its pid. At its next start it
removes the segments of a ledger whose process is gone, unless a live process still maps them. The
ledger lists only files that this worker's own processes mapped, so nothing else on the host is
touched.
"""
from __future__ import annotations

import json
import logging
import os
import re
from pathlib import Path

from services.models.cache import cache_dir
from services.procs import process_alive

logger = logging.getLogger(__name__)

SHM_DIR = "/dev/shm/"
OWN_PREFIXES = ("prfaas-arena-",)  # the cache pool's arena has its own sweep


def ledger_path(name: str, host: str, port: int) -> Path:
    safe = re.sub(r"[^A-Za-z0-9_.-]", "_", f"{name}-{host}-{port}")
    return cache_dir() / "run" / f"{safe}.shm.json"


def descendants(pid: int) -> set[int]:
    """``pid`` and every process below it."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                ppid = int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    found, pending = set(), [pid]
    while pending:
        current = pending.pop()
        if current not in found:
            found.add(current)
            pending += children.get(current, [])
    return found


def mapped_segments(pids) -> set[str]:
    """Shared-memory files (absolute paths) that these processes map."""
    segments = set()
    for pid in pids:
        try:
            maps = Path(f"/proc/{pid}/maps").read_text()
        except OSError:
            continue
        for line in maps.splitlines():
            parts = line.split(maxsplit=5)
            path = parts[5].strip().removesuffix(" (deleted)") if len(parts) == 6 else ""
            if _in_shm_dir(path) and not Path(path).name.startswith(OWN_PREFIXES):
                segments.add(path)
    return segments


def record(ledger: Path, pid: int | None = None) -> int:
    """Write down what this process and its children map now; returns how many segments."""
    pid = pid or os.getpid()
    segments = sorted(mapped_segments(descendants(pid)))
    ledger.parent.mkdir(parents=True, exist_ok=True)
    partial = ledger.with_suffix(f".{pid}.tmp")
    partial.write_text(json.dumps({"pid": pid, "segments": segments}))
    partial.replace(ledger)
    return len(segments)


def sweep(ledger: Path) -> list[str]:
    """Remove what a dead previous owner of ``ledger`` left; returns the files removed."""
    try:
        entry = json.loads(ledger.read_text())
        pid, segments = int(entry["pid"]), [str(s) for s in entry["segments"]]
    except FileNotFoundError:
        return []
    except (OSError, ValueError, KeyError, TypeError):
        logger.warning("ignoring unreadable shared-memory ledger %s", ledger)
        ledger.unlink(missing_ok=True)
        return []
    if process_alive(pid):
        return []
    still_mapped = mapped_segments(int(e) for e in os.listdir("/proc") if e.isdigit())
    removed = []
    for path in segments:
        if _in_shm_dir(path) and path not in still_mapped and os.path.isfile(path):
            try:
                os.unlink(path)
                removed.append(path)
            except OSError as exc:
                logger.warning("cannot remove %s left by a killed worker: %s", path, exc)
    ledger.unlink(missing_ok=True)
    if removed:
        logger.info("removed %d shared-memory segments that the previous process (pid %d, killed) left: %s",
                    len(removed), pid, ", ".join(Path(p).name for p in removed))
    return removed


def forget(ledger: Path) -> None:
    """A clean stop: the engine unlinked its segments itself."""
    ledger.unlink(missing_ok=True)


def _in_shm_dir(path: str) -> bool:
    """A plain file name directly in /dev/shm: no ``..``, no link out of it."""
    return (os.path.normpath(path) == path and os.path.dirname(path) == SHM_DIR.rstrip("/")
            and not os.path.islink(path))


