"""The embedded models by name, for ``model.path: builtin:<name>``."""
from __future__ import annotations

from pathlib import Path

from services.models import smollm2, tiny_dense, tiny_hybrid

PREPARERS = {
    smollm2.NAME: smollm2.prepare,
    tiny_hybrid.NAME: tiny_hybrid.prepare,
    tiny_dense.NAME: tiny_dense.prepare,
    tiny_dense.MQA_NAME: tiny_dense.prepare_mqa,
}


def prepare(name: str) -> Path:
    try:
        preparer = PREPARERS[name]
    except KeyError:
        raise ValueError(
            f"model.path: unknown builtin model {name!r} (known: {', '.join(sorted(PREPARERS))})"
        ) from None
    return preparer()
