"""Which KV layouts a pool holds blocks of, per model name.

Engines key their blocks by model and layout (``types.layout_key``); the router knows only the
model's name. A lookup under a bare name is answered for the layouts stored under that name, so the
router's estimate and its cross-cluster copies find the engines' blocks, while engines, which always
name their layout, only ever match their own.
"""
from __future__ import annotations

from services.cache_pool_client.types import has_layout, model_name


class LayoutNames:
    def __init__(self) -> None:
        self._layouts: dict[str, set[str]] = {}

    def record(self, model: str) -> None:
        if has_layout(model):
            self._layouts.setdefault(model_name(model), set()).add(model)

    def candidates(self, model: str) -> list[str]:
        """The keys a lookup under ``model`` reads: itself when it names a layout or none is stored
        under its name, else every layout stored under its name (in a stable order)."""
        if has_layout(model) or model not in self._layouts:
            return [model]
        return sorted(self._layouts[model])
