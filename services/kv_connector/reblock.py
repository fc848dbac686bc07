"""The consumer's half of a transfer between engines whose block sizes differ (issue 19).

A producer announces its layout once per transfer, in the LAYOUT frame: its fingerprint (equal on
identical layouts, whose pages are copied as they are) and its ``LayoutSpec``. Where the fingerprints
differ, the consumer plans a map from the two specs; when the data path carries it
(``layout_map.data_path_problem``: equal TP sizes, both caches as vLLM's CPU kernels lay them out), a ``Reblocker``
writes each attention frame, blocks of the producer's size, token by token into the request's blocks
of this engine's size, and each state page component by component (a state page's padding follows
the attention page, so its size may differ). Plans are cached by the announcement's bytes.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

import torch

from services.kv_connector.layout import KVLayout, LayerInfo
from services.kv_connector.layout_apply import (
    attention_view,
    conv_state_view,
    from_payload,
    state_page,
    temporal_state_view,
    write_attention,
)
from services.kv_connector.layout_map import Piece, Unmappable, data_path_problem, plan_mapping
from services.kv_connector.layout_spec import CPU_K_TRANSPOSED, DTYPE_BYTES, AttentionLayer, LayoutSpec, LinearLayer

SEPARATOR = b"\n"
MAX_PLANS = 64


def announcement(fingerprint: str, spec: LayoutSpec | None) -> bytes:
    """A LAYOUT frame's payload: the fingerprint, then the spec where this side can describe itself."""
    return fingerprint.encode() + (SEPARATOR + spec.to_bytes() if spec is not None else b"")


def fingerprint_of(payload: bytes) -> str:
    return payload.split(SEPARATOR, 1)[0].decode(errors="replace")


class Reblocker:
    """Writes frames of a producer whose block sizes differ from this engine's (same TP size)."""

    def __init__(self, src: LayoutSpec, dst: LayoutSpec, layout: KVLayout) -> None:
        self.src, self.dst, self._layout = src, dst, layout
        self._src_layers = {layer.name: layer for layer in src.layers}
        self._dst_layers = {layer.name: layer for layer in dst.layers}

    def attention_payload_bytes(self, layer: LayerInfo, num_blocks: int) -> int:
        spec = self._src_layers[layer.name]
        assert isinstance(spec, AttentionLayer)
        return (num_blocks * spec.kv.num_local_units * self.src.block_sizes[spec.group] * 2 * spec.head_size
                * DTYPE_BYTES[self.src.dtype])

    def src_block_size(self, layer: LayerInfo) -> int:
        return self.src.block_sizes[self._src_layers[layer.name].group]

    def write_attention(self, layer: LayerInfo, block_ids: Sequence[int | None], first_block: int,
                        num_blocks: int, payload: memoryview) -> None:
        """Producer blocks ``[first_block, first_block + num_blocks)`` of the request into its
        consumer blocks ``block_ids`` (None: skipped, as cached or null)."""
        src, dst = self._src_layers[layer.name], self._dst_layers[layer.name]
        assert isinstance(src, AttentionLayer) and isinstance(dst, AttentionLayer)
        src_block_size = self.src.block_sizes[src.group]
        source = from_payload(payload, self.src.dtype,
                              (num_blocks, src.kv.num_local_units, 2, src_block_size, src.head_size))
        view = attention_view(self._layout.caches[layer.name], dst, self.dst.block_sizes[dst.group])
        heads = Piece(0, dst.kv.name, 0, dst.kv.num_local_units, 0, 0, 0, 0)
        write_attention(view, block_ids, source, heads, first_block, src_block_size)

    def fits_state_page(self, layer: LayerInfo, num_bytes: int) -> bool:
        """Whether ``num_bytes`` can be one of the producer's state pages: its conv and temporal
        states, and at most the padding up to its page size (vLLM registers a state layer's pages
        with or without it)."""
        spec = self._src_layers[layer.name]
        assert isinstance(spec, LinearLayer)
        return spec.conv_bytes + spec.temporal_bytes <= num_bytes <= spec.page_bytes

    def write_state(self, layer: LayerInfo, block_id: int, payload: memoryview) -> None:
        """A producer's state page into page ``block_id``, conv and temporal state each on its own."""
        src, dst = self._src_layers[layer.name], self._dst_layers[layer.name]
        assert isinstance(src, LinearLayer) and isinstance(dst, LinearLayer)
        source = torch.frombuffer(payload, dtype=torch.uint8)
        target = state_page(self._layout.caches[layer.name], block_id)
        conv_state_view(target, dst).copy_(conv_state_view(source, src))
        temporal_state_view(target, dst).copy_(temporal_state_view(source, src))


class ReblockPlans:
    """What this engine does with each producer announcement it meets: copy pages as they are (None),
    re-block (a ``Reblocker``), or refuse (the reason)."""

    def __init__(self, layout: KVLayout, spec: LayoutSpec | None) -> None:
        self._layout, self._spec = layout, spec
        self._plans: OrderedDict[bytes, Reblocker | str | None] = OrderedDict()

    def plan(self, payload: bytes) -> Reblocker | str | None:
        plan = self._plans.get(payload)
        if plan is None and payload not in self._plans:
            plan = self._plan(payload)
            self._plans[payload] = plan
            while len(self._plans) > MAX_PLANS:
                self._plans.popitem(last=False)
        return plan

    def _plan(self, payload: bytes) -> Reblocker | str | None:
        theirs = fingerprint_of(payload)
        if theirs == self._layout.fingerprint:
            return None
        mismatch = f"KV layout mismatch ({theirs} != {self._layout.fingerprint})"
        _, _, encoded = payload.partition(SEPARATOR)
        if not encoded or self._spec is None:
            return f"{mismatch}; {'the producer' if not encoded else 'this engine'} announced no layout spec"
        try:
            src = LayoutSpec.from_bytes(encoded)
        except ValueError as error:
            return f"{mismatch}; the producer's layout spec is unreadable: {error}"
        dst = self._spec
        result = plan_mapping([src.for_rank(r) for r in range(src.tp_size)],
                              [dst.for_rank(r) for r in range(dst.tp_size)])
        if isinstance(result, Unmappable):
            return f"{mismatch}: {result.reason}"
        if problem := data_path_problem(result, src, dst):
            return f"{mismatch}: {problem}"
        if not src.cache_layout == dst.cache_layout == CPU_K_TRANSPOSED:
            return f"{mismatch}: re-blocking reads the cache layout of vLLM's CPU kernels only"
        if src.tp_rank != dst.tp_rank:
            return f"{mismatch}: producer TP rank {src.tp_rank} sent to consumer TP rank {dst.tp_rank}"
        return Reblocker(src, dst, self._layout)
