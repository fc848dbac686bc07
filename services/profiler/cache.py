"""Measured points kept on disk, so an interrupted profile resumes where it stopped.

A point's file lives under a directory named by the hash of everything that changes what the
engine measures (the model and its checkpoint, the engine settings, the worker's environment, vLLM's
version, the device, the measuring procedure); its name is the point's. Files are written whole
(a temporary file renamed), so an interrupted write leaves nothing half-read.
"""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any


def fingerprint(identity: dict[str, Any]) -> str:
    """A stable hash of a JSON-ready mapping."""
    return hashlib.sha256(json.dumps(identity, sort_keys=True, default=str).encode()).hexdigest()


class PointCache:
    """``get``/``put`` measured results by point name for one fingerprint; ``directory`` None disables it."""

    def __init__(self, directory: Path | None, identity: dict[str, Any]) -> None:
        self.identity = identity
        self.key = fingerprint(identity)
        self.directory = directory / self.key[:20] if directory is not None else None

    def get(self, name: str) -> dict[str, Any] | None:
        if self.directory is None:
            return None
        try:
            entry = json.loads((self.directory / f"{name}.json").read_text())
        except (OSError, ValueError):
            return None
        return entry.get("result") if entry.get("key") == self.key else None

    def put(self, name: str, result: dict[str, Any]) -> None:
        if self.directory is None:
            return
        self.directory.mkdir(parents=True, exist_ok=True)
        (self.directory / "identity.json").write_text(json.dumps(self.identity, indent=2, default=str) + "\n")
        path = self.directory / f"{name}.json"
        temporary = path.with_suffix(f".tmp{os.getpid()}")
        temporary.write_text(json.dumps({"key": self.key, "point": name, "result": result}) + "\n")
        temporary.replace(path)

    def __contains__(self, name: str) -> bool:
        return self.get(name) is not None
