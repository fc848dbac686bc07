"""Where prepared checkpoints live: ``$PRFAAS_CACHE_DIR`` or ``~/.cache/prfaas``."""
from __future__ import annotations

import os
from pathlib import Path

COMPLETE_MARKER = ".prfaas-complete"


def cache_dir() -> Path:
    root = os.environ.get("PRFAAS_CACHE_DIR") or Path.home() / ".cache" / "prfaas"
    return Path(root).expanduser()


def models_dir() -> Path:
    return cache_dir() / "models"


def is_complete(path: Path) -> bool:
    return (path / COMPLETE_MARKER).exists()


def mark_complete(path: Path) -> None:
    (path / COMPLETE_MARKER).write_text("ok\n")
