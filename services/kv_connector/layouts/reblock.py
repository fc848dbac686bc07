"""The consumer's half of a transfer between engines whose layouts differ (issue 19): other block
sizes, another TP size, or both.

A producer rank announces its layout once per transfer, in the LAYOUT frame: its fingerprint (equal
on identical layouts, whose pages are copied as they are) and its ``LayoutSpec``. Where the
fingerprints differ, the consumer plans a map from the two specs; when the data path carries it
(``layout_map.data_path_problem``), a ``Reblocker`` writes each attention frame (the producer's
blocks; with another TP size, only the heads this rank owns) token by token into the request's
blocks of this engine's size and cache layout (an amx kernel's and a vec kernel's convert), and each
state page component by component (with another TP size, each conv component's and the temporal
state's share of this rank on its own; a state page's padding follows the attention page, so its
size may differ). Plans are cached by the announcement's bytes.
"""
from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Sequence

import torch

from services.kv_connector.device.streams import Device
from services.kv_connector.layouts.apply import (
    TORCH_DTYPES,
    attention_view,
    conv_state_view,
    from_payload,
    state_page,
    temporal_state_view,
    write_attention,
    write_state,
)
from services.kv_connector.layouts.mapping import (
    LayoutMap,
    Piece,
    Unmappable,
    data_path_problem,
    layout_problem,
    plan_mapping,
    sources_of,
)
from services.kv_connector.layouts.physical import mismatch
from services.kv_connector.layouts.pages import KVLayout, LayerInfo
from services.kv_connector.layouts.spec import DTYPE_BYTES, AttentionLayer, LayoutSpec, LinearLayer

SEPARATOR = b"\n"
MAX_PLANS = 64


def announcement(fingerprint: str, spec: LayoutSpec | None) -> bytes:
    """A LAYOUT frame's payload: the fingerprint, then the spec where this side can describe itself."""
    return fingerprint.encode() + (SEPARATOR + spec.to_bytes() if spec is not None else b"")


def fingerprint_of(payload: bytes) -> str:
    return payload.split(SEPARATOR, 1)[0].decode(errors="replace")


class Reblocker:
    """Writes the frames of one stream whose layout differs from this rank's: block sizes (re-blocked
    token by token), TP size (each frame holds the ``pieces`` of the layer the producer rank sent the
    receiving rank, in the map's order: ``tp_routes`` sends them so; this rank writes those in
    ``written``), or both. ``sources``: every stream this rank waits for (``layout_map.sources_of``);
    ``replicas``: the ranks this one passes the stream on to."""

    def __init__(self, src: LayoutSpec, dst: LayoutSpec, layout: KVLayout, pieces: Sequence[Piece],
                 written: Sequence[Piece], sources: tuple[tuple[int, int | None], ...],
                 replicas: tuple[int, ...] = (), device: Device | None = None) -> None:
        self.src, self.dst, self._layout = src, dst, layout
        self._device = device
        self.sources, self.replicas = sources, replicas
        self.sliced = src.tp_size != dst.tp_size  # frames hold pieces, not the producer's whole pages
        self._src_layers = {layer.name: layer for layer in src.layers}
        self._dst_layers = {layer.name: layer for layer in dst.layers}
        self._pieces: dict[str, list[tuple[Piece, bool]]] = {}
        for piece in pieces:
            self._pieces.setdefault(src.layers[piece.layer].name, []).append((piece, piece in written))

    def attention_payload_bytes(self, layer: LayerInfo, num_blocks: int) -> int:
        spec = self._src_layers[layer.name]
        assert isinstance(spec, AttentionLayer)
        units = sum(piece.num_units for piece, _ in self._pieces.get(layer.name, ()))
        return num_blocks * units * self.src.block_sizes[spec.group] * 2 * spec.head_size * DTYPE_BYTES[self.src.dtype]

    def src_block_size(self, layer: LayerInfo) -> int:
        return self.src.block_sizes[self._src_layers[layer.name].group]

    def write_attention(self, layer: LayerInfo, block_ids: Sequence[int | None], first_block: int,
                        num_blocks: int, payload: memoryview) -> None:
        """Producer blocks ``[first_block, first_block + num_blocks)`` of the request, this rank's
        heads of them, into its consumer blocks ``block_ids`` (None: skipped, as cached or null)."""
        src, dst = self._src_layers[layer.name], self._dst_layers[layer.name]
        assert isinstance(src, AttentionLayer) and isinstance(dst, AttentionLayer)
        src_block_size = self.src.block_sizes[src.group]
        view = attention_view(self._layout.caches[layer.name], dst, self.dst.block_sizes[dst.group],
                              self.dst.cache_layout)
        if not self.sliced:  # the producer's whole pages, as its cache holds them
            page = from_payload(payload, self.src.dtype,
                                (num_blocks, src.kv.num_local_units, src_block_size, 2 * src.head_size))
            pages = attention_view(page, src, src_block_size, self.src.cache_layout)
        offset = 0
        for piece, mine in self._pieces.get(layer.name, ()):
            shape = (num_blocks, piece.num_units, 2, src_block_size, src.head_size)
            size = math.prod(shape) * DTYPE_BYTES[self.src.dtype]
            if mine:
                source = from_payload(payload[offset:offset + size], self.src.dtype, shape) if self.sliced else \
                    pages[:, piece.src_start:piece.src_start + piece.num_units]
                write_attention(view, block_ids, source, piece, first_block, src_block_size, self.dst.cache_layout,
                                self.src.cache_layout, self._device)
            offset += size

    def fits_state_page(self, layer: LayerInfo, num_bytes: int) -> bool:
        """Whether ``num_bytes`` can be what the producer sends of a state page: this rank's pieces of
        it (sliced), or its whole page: conv and temporal states, and at most the padding up to its page
        size (vLLM registers a state layer's pages with or without it)."""
        spec = self._src_layers[layer.name]
        assert isinstance(spec, LinearLayer)
        if self.sliced:
            return num_bytes == sum(self._piece_bytes(spec, piece) for piece, _ in self._pieces.get(layer.name, ()))
        return spec.conv_bytes + spec.temporal_bytes <= num_bytes <= spec.page_bytes

    def write_state(self, layer: LayerInfo, block_id: int, payload: memoryview) -> None:
        """A producer's state page (or this rank's pieces of it) into page ``block_id``, conv and
        temporal state each on its own, and with TP slicing each conv component on its own."""
        src, dst = self._src_layers[layer.name], self._dst_layers[layer.name]
        assert isinstance(src, LinearLayer) and isinstance(dst, LinearLayer)
        cache = self._layout.caches[layer.name]
        source = (self._device or Device(cache.device)).upload(torch.frombuffer(payload, dtype=torch.uint8))
        target = state_page(cache, block_id)
        if not self.sliced:
            conv_state_view(target, dst).copy_(conv_state_view(source, src))
            temporal_state_view(target, dst).copy_(temporal_state_view(source, src))
            return
        offset = 0
        for piece, mine in self._pieces.get(layer.name, ()):
            size = self._piece_bytes(src, piece)
            if mine:
                dtype = src.temporal_dtype if piece.part == src.temporal.name else src.conv_dtype
                write_state(target, dst, piece, source[offset:offset + size].view(TORCH_DTYPES[dtype]))
            offset += size

    @staticmethod
    def _piece_bytes(layer: LinearLayer, piece: Piece) -> int:
        if piece.part == layer.temporal.name:
            return piece.num_units * layer.temporal.unit_size * DTYPE_BYTES[layer.temporal_dtype]
        unit_size = next(part.unit_size for part in layer.conv if part.name == piece.part)
        return piece.num_units * unit_size * layer.conv_state_len * DTYPE_BYTES[layer.conv_dtype]


class ReblockPlans:
    """What this engine does with each producer announcement it meets, on a stream from the producer
    (``via`` None) or passed on by consumer rank ``via``: copy pages as they are (None), re-block (a
    ``Reblocker``), or refuse (the reason)."""

    def __init__(self, layout: KVLayout, spec: LayoutSpec | None, device: Device | None = None) -> None:
        """``device``: the cache's facade, which every ``Reblocker``'s writes enqueue through."""
        self._layout, self._spec, self._device = layout, spec, device
        self._plans: OrderedDict[tuple[bytes, int | None], Reblocker | str | None] = OrderedDict()

    def plan(self, payload: bytes, via: int | None = None) -> Reblocker | str | None:
        key = (payload, via)
        plan = self._plans.get(key)
        if plan is None and key not in self._plans:
            plan = self._plan(payload, via)
            self._plans[key] = plan
            while len(self._plans) > MAX_PLANS:
                self._plans.popitem(last=False)
        return plan

    def _plan(self, payload: bytes, via: int | None) -> Reblocker | str | None:
        theirs = fingerprint_of(payload)
        _, _, encoded = payload.partition(SEPARATOR)
        if theirs == self._layout.fingerprint and not self._other_tp_size(encoded):
            return None
        mismatch = (_mismatch(theirs, self._layout.fingerprint) if theirs != self._layout.fingerprint
                    else "KV layout of another TP size")
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
        if problem := layout_problem(src, dst):
            return f"{mismatch}: writing the producer's attention KV here {problem}"
        if src.tp_size == dst.tp_size:  # whole pages from the rank of the same number, every head written
            if via is not None or src.tp_rank != dst.tp_rank:
                return f"{mismatch}: producer TP rank {src.tp_rank} sent to consumer TP rank {dst.tp_rank}"
            pieces = _whole_pages(result, dst.tp_rank)
            return Reblocker(src, dst, self._layout, pieces, pieces, ((src.tp_rank, None),), device=self._device)
        receiver = dst.tp_rank if via is None else via
        pieces = [piece for piece in result.pieces_to(receiver) if piece.src_rank == src.tp_rank]
        written = [piece for piece in pieces if via is None or dst.tp_rank in piece.replicas]
        if not written:
            return f"{mismatch}: producer TP rank {src.tp_rank} holds nothing for consumer TP rank {dst.tp_rank}"
        replicas = tuple(sorted({rank for piece in pieces for rank in piece.replicas})) if via is None else ()
        return Reblocker(src, dst, self._layout, pieces, written, sources_of(result, dst.tp_rank), replicas,
                         self._device)

    def _other_tp_size(self, encoded: bytes) -> bool:
        """The producer announced another TP size than this engine's. Ranks' pages can then be alike
        (every KV head replicated, as with one KV head) and yet hold their units for other ranks: the
        producer sends each unit to one holder, which passes it on to the others."""
        if not encoded or self._spec is None:
            return False
        try:
            return LayoutSpec.from_bytes(encoded).tp_size != self._spec.tp_size
        except ValueError:
            return False


def _whole_pages(layout_map: LayoutMap, rank: int) -> list[Piece]:
    """Every part of every layer as one piece of all the rank's units: a page as it is."""
    return [Piece(layer.index, part.name, 0, part.num_local_units, rank, 0, rank, 0)
            for layer in layout_map.layers for part in layer.src.parts]


def _mismatch(theirs: str, ours: str) -> str:
    """A fingerprint mismatch in words: the digests, and how the physical layouts differ if they do."""
    their_digest, _, their_tags = theirs.partition("@")
    our_digest, _, our_tags = ours.partition("@")
    physical = mismatch(their_tags, our_tags)
    return f"KV layout mismatch ({their_digest} != {our_digest})" + (f"; {physical}" if physical else "")
