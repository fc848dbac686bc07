"""KV bytes per token for each KV-cache group of an engine, from vLLM's KV cache config.

Full-attention (and MLA) groups grow with the prompt: a page holds ``block_size`` tokens of one
layer, so a token costs ``page / block_size`` bytes per layer. Sliding-window groups grow the same
way up to their window. Linear-attention (Mamba-style) groups hold a fixed state per request: one
page per layer, whatever the length. Specs are read by attribute, so any object with vLLM's field
names works.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

MIB = 1 << 20


@dataclass(frozen=True, slots=True)
class KvGroup:
    kind: str                 # full_attention | sliding_window | linear_attention
    num_layers: int
    block_size_tokens: int
    page_bytes: int           # per layer
    bytes_per_token: float    # all layers of the group; 0 for linear attention
    state_bytes_per_request: int  # all layers; linear attention only (padded page, what moves)
    sliding_window_tokens: int | None = None

    def bytes_for(self, tokens: int) -> int:
        """Bytes of this group for a prompt of ``tokens``: whole pages, as the transport sends them."""
        if self.kind == "linear_attention":
            return self.state_bytes_per_request
        if self.sliding_window_tokens:
            tokens = min(tokens, self.sliding_window_tokens + self.block_size_tokens)
        return math.ceil(tokens / self.block_size_tokens) * self.page_bytes * self.num_layers

    def as_dict(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if v is not None}


def kv_groups(kv_cache_config: Any) -> list[KvGroup]:
    return [_group(group.kv_cache_spec, len(group.layer_names)) for group in kv_cache_config.kv_cache_groups]


def kv_bytes(groups: list[KvGroup], tokens: int) -> int:
    return sum(group.bytes_for(tokens) for group in groups)


def _group(spec: Any, num_layers: int) -> KvGroup:
    page = int(spec.page_size_bytes)
    block = int(spec.block_size)
    if hasattr(spec, "shapes"):  # MambaSpec: a fixed state per request
        return KvGroup("linear_attention", num_layers, block, page, 0.0, page * num_layers)
    window = getattr(spec, "sliding_window", None)
    kind = "sliding_window" if window else "full_attention"
    return KvGroup(kind, num_layers, block, page, page * num_layers / block, 0, int(window) if window else None)
