"""Moves the pieces of a ``LayoutMap`` out of a producer rank's KV cache and into a consumer rank's.

Pure functions over tensors (no I/O). Attention KV travels as the producer's pages, ``[blocks,
heads, 2 (K, V), block_size x head_size]`` in its block size (a head's K and V as its kernel stores
them), and is re-blocked token by token (or by 16-token group) on the consumer, converted there to the
consumer's cache layout where the two differ; a conv-state piece as
``[conv_state_len, channels]`` of one component; a temporal-state piece as ``[heads, *head_shape]``.
A consumer rank applies a piece it received, then the same payload on each of the piece's replicas.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from services.kv_connector.device.streams import Device
from services.kv_connector.layouts.mapping import Piece, chunk_size, token_chunks
from services.kv_connector.layouts.spec import (CPU_K_TRANSPOSED, DTYPE_BYTES, TILE_TOKENS, TILED_LAYOUTS, TOKEN_ROWS,
                                                AttentionLayer, LinearLayer)

TORCH_DTYPES = {name: getattr(torch, name) for name in DTYPE_BYTES}


def attention_view(cache: torch.Tensor, layer: AttentionLayer, block_size: int,
                   cache_layout: str = CPU_K_TRANSPOSED) -> torch.Tensor:
    """An attention layer's cache as ``[blocks, heads, 2, block_size, head_size]``: each (block, head)
    holds its K area, then its V area (no copy). vLLM's CPU cache ``[blocks, heads, block_size, 2 *
    head_size]`` splits each (block, head) so (``cpu_attn.py``): the registered shape's last two dims
    are not (token, K|V), and which element of an area is which token is the kernels' business (see
    ``token_view``). A GPU backend's (``TOKEN_ROWS``) has the same logical shape with each token's K
    then V in its last dim: a strided view of it, whatever its strides."""
    if cache_layout == TOKEN_ROWS:
        return cache.unflatten(3, (2, layer.head_size)).permute(0, 1, 3, 2, 4)
    return cache.view(cache.shape[0], layer.kv.num_local_units, 2, block_size, layer.head_size)


def token_view(view: torch.Tensor, half: int, cache_layout: str = CPU_K_TRANSPOSED) -> torch.Tensor:
    """K (``half`` 0) or V (1) of an ``attention_view``, or of a payload shaped like one, as
    ``[blocks, heads, block_size, head_size]`` over the same memory. vLLM's CPU ``vec`` and ``vec16``
    kernels (``cpu_attn_reshape_and_cache``) store a head's K transposed, ``[head_size, block_size]``
    with a token's values ``block_size`` apart, and its V as ``[block_size, head_size]``; checked
    against the kernel in tests/unit/test_layout_apply.py. ``TOKEN_ROWS`` keeps both in token order.
    ``CPU_AMX`` is no strided view of that shape: use ``tile_view`` (or ``read_tokens`` for a copy)."""
    if cache_layout in TILED_LAYOUTS:
        raise ValueError(f"{cache_layout} is not a strided [block, head] view: read it with tile_view")
    blocks, heads, _, block_size, head_size = view.shape
    area = view[:, :, half]
    if half == 1 or cache_layout == TOKEN_ROWS:
        return area
    return area.flatten(2).unflatten(2, (head_size, block_size)).transpose(2, 3)


def tile_view(view: torch.Tensor, half: int, cache_layout: str = CPU_K_TRANSPOSED) -> torch.Tensor:
    """K (``half`` 0) or V (1) of an ``attention_view`` in any ``SLICEABLE_LAYOUTS``, as ``[blocks,
    heads, block_size / 16, 8, 2, head_size / 16, 8, 2]`` over the same memory: token ``t = 16 a + 2 b
    + c`` and channel ``d = 16 e + 2 f + g`` at ``[.., a, b, c, e, f, g]``. Every layout has this view
    (block and head sizes multiples of 16), ``CPU_AMX`` only this one. The amx kernel packs K as
    ``[block_size / 16, head_size / 2, 16, 2]`` (token group, channel pair, token, channel in the pair)
    and V as ``[head_size / 16, block_size / 2, 16, 2]`` (channel group, token pair, channel, token in
    the pair); checked against vLLM's kernel in tests/unit/test_layout_apply.py."""
    blocks, heads, _, block_size, head_size = view.shape
    groups, channel_groups = block_size // TILE_TOKENS, head_size // TILE_TOKENS
    if cache_layout not in TILED_LAYOUTS:
        return token_view(view, half, cache_layout).unflatten(3, (channel_groups, 8, 2)).unflatten(2, (groups, 8, 2))
    area = view[:, :, half].flatten(2)
    if half == 0:  # K: [a, (e, f), (b, c), g]
        return area.unflatten(2, (groups, channel_groups, 8, 8, 2, 2)).permute(0, 1, 2, 5, 6, 3, 4, 7)
    # V: [e, (a, b), (f, g), c]
    return area.unflatten(2, (channel_groups, groups, 8, 8, 2, 2)).permute(0, 1, 3, 4, 7, 2, 5, 6)


def read_tokens(view: torch.Tensor, half: int, cache_layout: str = CPU_K_TRANSPOSED) -> torch.Tensor:
    """``token_view``'s ``[blocks, heads, block_size, head_size]`` in any sliceable layout: a view
    where the layout allows one, else a copy (``CPU_AMX``)."""
    if cache_layout not in TILED_LAYOUTS:
        return token_view(view, half, cache_layout)
    blocks, heads, _, block_size, head_size = view.shape
    return tile_view(view, half, cache_layout).reshape(blocks, heads, block_size, head_size)


def slice_attention(view: torch.Tensor, block_ids: Sequence[int], piece: Piece,
                    device: Device | None = None) -> torch.Tensor:
    """A contiguous copy of the piece's heads in ``block_ids`` (producer side), enqueued on the current
    stream with no host wait (``device``: the cache's facade)."""
    index = (device or Device(view.device)).index(block_ids)
    return view[:, piece.src_start:piece.src_start + piece.num_units].index_select(0, index)


def write_attention(view: torch.Tensor, block_ids: Sequence[int | None], payload: torch.Tensor, piece: Piece,
                    first_block: int, src_block_size: int, cache_layout: str = CPU_K_TRANSPOSED,
                    src_layout: str | None = None, device: Device | None = None) -> None:
    """Write ``payload`` (producer blocks from the request's block ``first_block`` on, as
    ``slice_attention`` made them, in ``src_layout``, by default the same as the consumer's) into the
    request's consumer blocks ``block_ids`` (in ``cache_layout``), token by token (``token_view``), or
    where either layout packs tokens in groups (``CPU_AMX``) group by group (``tile_view``): layouts
    convert on the way. Ids that are None, and tokens past the last consumer block, are skipped. A
    payload in host memory is copied to the cache's device first, and the index tensors built, on the
    current stream with no host wait (``device``: the cache's facade)."""
    src_layout = src_layout or cache_layout
    dst_block_size = view.shape[3]
    chunks = [chunk for chunk in token_chunks(first_block, payload.shape[0], src_block_size, dst_block_size)
              if chunk.dst_block < len(block_ids) and block_ids[chunk.dst_block] is not None]
    if not chunks:
        return
    size = chunk_size(src_block_size, dst_block_size)
    tiled = src_layout in TILED_LAYOUTS or cache_layout in TILED_LAYOUTS
    unit = TILE_TOKENS if tiled else 1
    if size % unit:
        raise ValueError(f"chunks of {size} tokens do not hold whole {unit}-token groups of {cache_layout}")
    device = device or Device(view.device)
    src_blocks, src_slots, dst_blocks, dst_slots = (
        device.index(column)
        for column in zip(*((c.src_block, c.src_slot, block_ids[c.dst_block], c.dst_slot) for c in chunks)))
    payload = device.upload(payload)
    heads = slice(piece.dst_start, piece.dst_start + piece.num_units)
    read = tile_view if tiled else token_view
    for half in (0, 1):
        source = read(payload, half, src_layout).unflatten(2, (src_block_size // size, size // unit))
        target = read(view, half, cache_layout).unflatten(2, (dst_block_size // size, size // unit))
        target[dst_blocks, heads, dst_slots] = source[src_blocks, :, src_slots]


def state_page(cache: torch.Tensor, block_id: int) -> torch.Tensor:
    """One state page of a linear-attention layer's cache (vLLM registers raw page bytes) as uint8."""
    return cache[block_id].view(-1).view(torch.uint8)


def conv_state_view(page: torch.Tensor, layer: LinearLayer) -> torch.Tensor:
    """``[conv_state_len, conv_dim]`` (a transposed view where vLLM stores it as (dim, state_len))."""
    raw = page[:layer.conv_bytes].view(TORCH_DTYPES[layer.conv_dtype])
    if layer.conv_layout == "DS":
        return raw.view(layer.conv_dim, layer.conv_state_len).t()
    return raw.view(layer.conv_state_len, layer.conv_dim)


def temporal_state_view(page: torch.Tensor, layer: LinearLayer) -> torch.Tensor:
    raw = page[layer.conv_bytes:layer.conv_bytes + layer.temporal_bytes].view(TORCH_DTYPES[layer.temporal_dtype])
    return raw.view(layer.temporal.num_local_units, *layer.temporal_head_shape)


def slice_state(page: torch.Tensor, layer: LinearLayer, piece: Piece) -> torch.Tensor:
    """A contiguous copy of the piece's part of a producer state page."""
    return _part_view(page, layer, piece.part, piece.src_start, piece.num_units).contiguous()


def state_piece_bytes(page: torch.Tensor, layer: LinearLayer, piece: Piece) -> int:
    """How many bytes ``slice_state`` makes of the piece (from views: nothing is copied)."""
    view = _part_view(page, layer, piece.part, piece.src_start, piece.num_units)
    return view.numel() * view.element_size()


def write_state(page: torch.Tensor, layer: LinearLayer, piece: Piece, payload: torch.Tensor) -> None:
    target = _part_view(page, layer, piece.part, piece.dst_start, piece.num_units)
    target.copy_(payload.reshape(target.shape))


def _part_view(page: torch.Tensor, layer: LinearLayer, part: str, start: int, num_units: int) -> torch.Tensor:
    if part == layer.temporal.name:
        return temporal_state_view(page, layer)[start:start + num_units]
    unit_size = next(component.unit_size for component in layer.conv if component.name == part)
    first = layer.conv_offsets[part] + start * unit_size
    return conv_state_view(page, layer)[:, first:first + num_units * unit_size]


def from_payload(payload: bytes | bytearray | memoryview, dtype: str, shape: Sequence[int]) -> torch.Tensor:
    """A received piece's bytes as a tensor (shares the buffer; the shape as its slice had)."""
    return torch.frombuffer(payload, dtype=torch.uint8).view(TORCH_DTYPES[dtype]).view(*shape)
