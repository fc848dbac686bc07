"""How a producer cluster's TP ranks fill a consumer cluster's TP ranks (issue 19): planned once per
pair of layouts at the handshake, then used for every transfer.

Pure: no torch, no I/O. Every unit (a KV head, a linear-attention head, a conv component's head or
group) crosses the link once: to one consumer rank that holds it, from one producer rank that holds
it. Where the consumer replicates a unit on several ranks, the others are ``replicas`` of the piece
and are filled on the receiving side. Conv components are mapped each on its own, never as a
contiguous slice of the concatenated conv dim.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from services.kv_connector.layouts.spec import (
    DTYPE_BYTES,
    SLICEABLE_LAYOUTS,
    TILE_TOKENS,
    TILED_LAYOUTS,
    AttentionLayer,
    Layer,
    LayoutSpec,
    LinearLayer,
    Sharded,
    describe_layout,
)


@dataclass(frozen=True, slots=True)
class Unmappable:
    """Why two layouts cannot be mapped; refused at the handshake, with this text logged and shown."""
    reason: str


@dataclass(frozen=True, slots=True)
class Piece:
    """Units ``[first_unit, first_unit + num_units)`` (global numbering) of part ``part`` of layer
    ``layer``: at local unit ``src_start`` on producer rank ``src_rank``, written at local unit
    ``dst_start`` on consumer rank ``dst_rank`` and, by that rank, on each of ``replicas`` (which
    hold them at the same local offset)."""
    layer: int
    part: str
    first_unit: int
    num_units: int
    src_rank: int
    src_start: int
    dst_rank: int
    dst_start: int
    replicas: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class LayerMap:
    index: int
    src: Layer
    dst: Layer
    src_block_size: int
    dst_block_size: int
    pieces: tuple[Piece, ...]

    @property
    def is_attention(self) -> bool:
        return isinstance(self.dst, AttentionLayer)


@dataclass(frozen=True, slots=True)
class LayoutMap:
    producer_tp: int
    consumer_tp: int
    kv_dtype: str
    layers: tuple[LayerMap, ...]

    def pieces_from(self, src_rank: int) -> list[Piece]:
        """What producer rank ``src_rank`` sends (to several consumer ranks)."""
        return [piece for layer in self.layers for piece in layer.pieces if piece.src_rank == src_rank]

    def pieces_to(self, dst_rank: int) -> list[Piece]:
        """What consumer rank ``dst_rank`` receives over the link (its replicas come from a peer)."""
        return [piece for layer in self.layers for piece in layer.pieces if piece.dst_rank == dst_rank]

    @property
    def is_identity(self) -> bool:
        """Equal TP and block sizes: whole pages can travel as they are."""
        return self.producer_tp == self.consumer_tp and all(
            layer.src_block_size == layer.dst_block_size or not layer.is_attention for layer in self.layers)


def plan_mapping(producers: Sequence[LayoutSpec], consumers: Sequence[LayoutSpec]) -> LayoutMap | Unmappable:
    """The map from a producer cluster (one spec per TP rank) to a consumer cluster, or why none exists."""
    problem = _cluster_problem("producer", producers) or _cluster_problem("consumer", consumers)
    if problem:
        return Unmappable(problem)
    src, dst = producers[0], consumers[0]
    problem = _pair_problem(src, dst)
    if problem:
        return Unmappable(problem)
    layers = tuple(_layer_map(i, a, b, src, dst) for i, (a, b) in enumerate(zip(src.layers, dst.layers)))
    return LayoutMap(src.tp_size, dst.tp_size, src.dtype, layers)


def _cluster_problem(side: str, specs: Sequence[LayoutSpec]) -> str | None:
    if not specs:
        return f"the {side} announced no ranks"
    tp_size = specs[0].tp_size
    if sorted(spec.tp_rank for spec in specs) != list(range(tp_size)) or len(specs) != tp_size:
        return f"the {side} announced ranks {[spec.tp_rank for spec in specs]}, not each of TP {tp_size} once"
    first = specs[0].for_rank(0)
    if any(spec.for_rank(0) != first for spec in specs):
        return f"the {side}'s TP ranks announce different layouts"
    for layer in first.layers:
        for part in layer.parts:
            if problem := part.split_problem(tp_size):
                return f"{side} layer {layer.name}: {problem}"
    return None


def _pair_problem(src: LayoutSpec, dst: LayoutSpec) -> str | None:
    if src.model != dst.model:
        return f"different models: producer {src.model!r}, consumer {dst.model!r}"
    if src.dtype != dst.dtype:
        return f"different KV dtypes: producer {src.dtype}, consumer {dst.dtype}"
    if len(src.layers) != len(dst.layers):
        return f"different layer counts: producer {len(src.layers)}, consumer {len(dst.layers)}"
    for a, b in zip(src.layers, dst.layers):
        if problem := _layer_problem(a, b):
            return f"layer {a.name}: {problem}"
    return None


def _layer_problem(a: Layer, b: Layer) -> str | None:
    if a.name != b.name or a.kind != b.kind:
        return f"producer has {a.kind} layer {a.name}, consumer {b.kind} layer {b.name}"
    if isinstance(a, AttentionLayer) and isinstance(b, AttentionLayer):
        if a.head_size != b.head_size:
            return f"different head sizes: producer {a.head_size}, consumer {b.head_size}"
        if a.kv.num_units != b.kv.num_units:
            return f"different KV head counts: producer {a.kv.num_units}, consumer {b.kv.num_units}"
        if a.sliding_window != b.sliding_window:
            return f"different sliding windows: producer {a.sliding_window}, consumer {b.sliding_window}"
        return None
    assert isinstance(a, LinearLayer) and isinstance(b, LinearLayer)
    return _linear_problem(a, b)


def _linear_problem(a: LinearLayer, b: LinearLayer) -> str | None:
    if (a.conv_dtype, a.temporal_dtype) != (b.conv_dtype, b.temporal_dtype):
        return (f"different state dtypes: producer {a.conv_dtype}/{a.temporal_dtype}, "
                f"consumer {b.conv_dtype}/{b.temporal_dtype}")
    if a.conv_state_len != b.conv_state_len:
        return f"different conv state lengths: producer {a.conv_state_len}, consumer {b.conv_state_len}"
    if len(a.conv) != len(b.conv) or not all(x.same_shape(y) for x, y in zip(a.conv, b.conv)):
        return f"different conv components: producer {_describe(a.conv)}, consumer {_describe(b.conv)}"
    if not a.temporal.same_shape(b.temporal) or a.temporal_head_shape != b.temporal_head_shape:
        return (f"different temporal states: producer {a.temporal.num_units} x {a.temporal_head_shape}, "
                f"consumer {b.temporal.num_units} x {b.temporal_head_shape}")
    return None


def _describe(parts: tuple[Sharded, ...]) -> str:
    return "[" + ", ".join(f"{part.name} {part.num_units}x{part.unit_size}" for part in parts) + "]"


def _layer_map(index: int, a: Layer, b: Layer, src: LayoutSpec, dst: LayoutSpec) -> LayerMap:
    pieces = tuple(piece for x, y in zip(a.parts, b.parts)
                   for piece in _part_pieces(index, x, src.tp_size, y, dst.tp_size))
    return LayerMap(index, a, b, src.block_sizes[a.group], dst.block_sizes[b.group], pieces)


def _part_pieces(layer: int, src: Sharded, src_tp: int, dst: Sharded, dst_tp: int) -> list[Piece]:
    """One piece per run of units with the same ranks; holders alternate by layer to spread load."""
    pieces: list[Piece] = []
    for unit in range(src.num_units):
        senders, receivers = src.holders(unit, src_tp), dst.holders(unit, dst_tp)
        src_rank, dst_rank = senders[layer % len(senders)], receivers[layer % len(receivers)]
        piece = Piece(layer, src.name, unit, 1, src_rank, unit - src.first_unit(src_rank, src_tp),
                      dst_rank, unit - dst.first_unit(dst_rank, dst_tp),
                      tuple(rank for rank in receivers if rank != dst_rank))
        if pieces and _continues(pieces[-1], piece):
            last = pieces.pop()
            piece = Piece(layer, src.name, last.first_unit, last.num_units + 1, last.src_rank, last.src_start,
                          last.dst_rank, last.dst_start, last.replicas)
        pieces.append(piece)
    return pieces


def _continues(last: Piece, piece: Piece) -> bool:
    return ((last.src_rank, last.dst_rank, last.replicas) == (piece.src_rank, piece.dst_rank, piece.replicas)
            and last.src_start + last.num_units == piece.src_start
            and last.dst_start + last.num_units == piece.dst_start)


def data_path_problem(layout_map: LayoutMap, src: LayoutSpec, dst: LayoutSpec) -> str | None:
    """Why the KV data path cannot carry a ``LayoutMap``, or None. Identical layouts travel as whole
    pages (and so do layouts that are alike but where a side did not say its cache layout: the
    per-transfer fingerprint check is the backstop there). Otherwise each producer rank sends each
    consumer rank its pieces (a consumer rank passes on the pieces its replicas hold) and the consumer
    re-blocks them and converts them to its cache layout (``layout_problem``)."""
    same_layout = src.cache_layout == dst.cache_layout
    if layout_map.is_identity and (same_layout or not src.cache_layout or not dst.cache_layout):
        return None
    problem = layout_problem(src, dst)
    if problem is None:
        return None
    if layout_map.producer_tp != layout_map.consumer_tp:
        what = f"TP {layout_map.producer_tp} -> {layout_map.consumer_tp} needs head slicing"
    elif not layout_map.is_identity:
        what = f"block sizes {list(src.block_sizes)} -> {list(dst.block_sizes)} need re-blocking"
    else:
        what = "the attention caches' layouts differ and need converting"
    return f"{what}, which {problem}"


def layout_problem(src: LayoutSpec, dst: LayoutSpec) -> str | None:
    """Why a consumer cannot write a producer's attention KV into its own cache layout token by token
    (``apply.write_attention``), or None: both layouts must be ones ``apply`` reads
    (``SLICEABLE_LAYOUTS``), and where either packs tokens in groups (``TILED_LAYOUTS``), each pair
    of block sizes must move whole groups and head sizes split into 16-channel groups."""
    layouts = f"(announced: {describe_layout(src.cache_layout)} -> {describe_layout(dst.cache_layout)})"
    if src.cache_layout not in SLICEABLE_LAYOUTS or dst.cache_layout not in SLICEABLE_LAYOUTS:
        return f"needs both attention caches in layouts this connector maps {layouts}"
    if src.cache_layout not in TILED_LAYOUTS and dst.cache_layout not in TILED_LAYOUTS:
        return None
    heads = {layer.head_size for layer in (*src.layers, *dst.layers) if isinstance(layer, AttentionLayer)}
    groups = {(src.block_sizes[layer.group], dst.block_sizes[layer.group]) for layer in src.layers
              if isinstance(layer, AttentionLayer) and layer.group < len(dst.block_sizes)}
    if bad := sorted(size for size in heads if size % TILE_TOKENS):
        return f"needs head sizes in groups of {TILE_TOKENS} channels, not {bad} {layouts}"
    if bad := sorted(pair for pair in groups if chunk_size(*pair) % TILE_TOKENS):
        return f"needs block sizes that move whole groups of {TILE_TOKENS} tokens, not {bad} {layouts}"
    return None


def sources_of(layout_map: LayoutMap, dst_rank: int) -> tuple[tuple[int, int | None], ...]:
    """Where consumer rank ``dst_rank``'s pieces come from: ``(producer rank, None)`` over the link,
    ``(producer rank, consumer rank)`` passed on by the consumer rank that received them (replicas)."""
    sources = {(piece.src_rank, None) for piece in layout_map.pieces_to(dst_rank)}
    sources |= {(piece.src_rank, piece.dst_rank) for layer in layout_map.layers for piece in layer.pieces
                if dst_rank in piece.replicas}
    return tuple(sorted(sources, key=lambda source: (source[0], -1 if source[1] is None else source[1])))


# Re-blocking ---------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Chunk:
    """``size`` tokens: slot ``src_slot`` of the piece's block ``src_block`` (counted from the piece's
    first block) go to slot ``dst_slot`` of the request's consumer block ``dst_block``."""
    src_block: int
    src_slot: int
    dst_block: int
    dst_slot: int


def chunk_size(src_block_size: int, dst_block_size: int) -> int:
    return math.gcd(src_block_size, dst_block_size)


def token_chunks(first_block: int, num_blocks: int, src_block_size: int, dst_block_size: int) -> list[Chunk]:
    """Where producer blocks ``[first_block, first_block + num_blocks)`` of a request land in the
    request's consumer blocks, in chunks of ``chunk_size`` tokens (attention layers only: state pages
    are per request, not per token)."""
    size = chunk_size(src_block_size, dst_block_size)
    src_slots, dst_slots = src_block_size // size, dst_block_size // size
    chunks = []
    for block in range(num_blocks):
        for slot in range(src_slots):
            position = ((first_block + block) * src_block_size + slot * size) // size
            chunks.append(Chunk(block, slot, position // dst_slots, position % dst_slots))
    return chunks


# Wire cost -----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class WireCost:
    """Bytes a map sends per token (attention KV) and per request (state pages), against what the
    consumer cluster needs: each distinct unit once. Replicas are filled locally, not sent."""
    wire_bytes_per_token: int
    kv_bytes_per_token: int
    state_wire_bytes: int
    state_bytes: int
    replica_bytes_per_token: int

    @property
    def ratio(self) -> float:
        needed = self.kv_bytes_per_token + self.state_bytes
        return (self.wire_bytes_per_token + self.state_wire_bytes) / needed if needed else 1.0


def wire_cost(layout_map: LayoutMap) -> WireCost:
    wire = kv = state_wire = state = replicas = 0
    for layer in layout_map.layers:
        sizes = _unit_bytes(layer.dst, layout_map.kv_dtype)
        for piece in layer.pieces:
            sent = piece.num_units * sizes[piece.part]
            if layer.is_attention:
                wire += sent
                replicas += sent * len(piece.replicas)
            else:
                state_wire += sent
        needed = sum(part.num_units * sizes[part.name] for part in layer.dst.parts)
        kv, state = (kv + needed, state) if layer.is_attention else (kv, state + needed)
    return WireCost(wire, kv, state_wire, state, replicas)


def _unit_bytes(layer: Layer, kv_dtype: str) -> dict[str, int]:
    """Bytes of one unit of each part: per token for KV (K and V), per request for state."""
    if isinstance(layer, AttentionLayer):
        return {layer.kv.name: 2 * layer.head_size * DTYPE_BYTES[kv_dtype]}
    conv = {part.name: part.unit_size * layer.conv_state_len * DTYPE_BYTES[layer.conv_dtype] for part in layer.conv}
    return {**conv, layer.temporal.name: layer.temporal.unit_size * DTYPE_BYTES[layer.temporal_dtype]}

