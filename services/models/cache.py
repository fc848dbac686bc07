"""Where prepared checkpoints live: ``$PRFAAS_CACHE_DIR`` or ``~/.cache/prfaas``."""
from __future__ import annotations

import logging
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

logger = logging.getLogger(__name__)

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


def prepare_generated(name: str, seed: int, target: Path | None, generate: Callable[[int, Path], None]) -> Path:
    """The directory of a generated checkpoint ``name`` for ``seed``: made by ``generate(seed, dir)``
    in a staging directory on first use, then renamed into place (safe against concurrent callers)."""
    target = target or models_dir() / f"{name}-seed{seed}"
    if is_complete(target):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=target.parent))
    staging.chmod(0o755)
    try:
        generate(seed, staging)
        mark_complete(staging)
        if not is_complete(target):
            shutil.rmtree(target, ignore_errors=True)
            staging.rename(target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    logger.info("generated %s (seed %d) at %s", name, seed, target)
    return target
