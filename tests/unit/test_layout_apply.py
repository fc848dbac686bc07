"""Applying a layout map to tensors (issue 19): a model's KV and state, split over producer ranks as
vLLM splits them, moved through bytes into consumer ranks with another TP and block size, must equal
the consumer's own split exactly."""
from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from support.layouts import gdn, gdn_model, mamba_model, ranks

from services.kv_connector.layouts.apply import (attention_view, conv_state_view, from_payload,
                                                slice_attention, slice_state, temporal_state_view, tile_view,
                                                token_view, write_attention, write_state)
from services.kv_connector.layouts.apply import read_tokens as tokens_in
from services.kv_connector.layouts.from_vllm import KERNEL_LAYOUTS
from services.kv_connector.layouts.mapping import LayoutMap, Piece, plan_mapping
from services.kv_connector.layouts.spec import (CPU_AMX, CPU_K_TRANSPOSED, AttentionLayer, LayoutSpec, LinearLayer,
                                                Sharded)

NUM_TOKENS = 300
FRAME_BLOCKS = 2  # producer blocks per frame, as the worker streams a layer chunk by chunk


def vllm_shard(full: torch.Tensor, part: Sharded, rank: int, tp: int, dim: int) -> torch.Tensor:
    """A rank's share as vLLM's weight loaders cut it: equal chunks, or one whole replicated unit."""
    if tp <= part.num_units:
        return full.chunk(tp, dim)[rank]
    return full.chunk(part.num_units, dim)[rank // (tp // part.num_units)]


def conv_shard(full: torch.Tensor, layer: LinearLayer, rank: int, tp: int) -> torch.Tensor:
    components = full.split([part.size for part in layer.conv], dim=1)
    return torch.cat([vllm_shard(c, part, rank, tp, 1) for c, part in zip(components, layer.conv)], dim=1)


@dataclass
class Rank:
    """One engine rank's caches for one request: per attention layer a CPU cache tensor and the
    request's block ids, per linear layer one state page."""
    spec: LayoutSpec
    caches: dict[int, torch.Tensor]
    block_ids: dict[int, list[int]]
    pages: dict[int, torch.Tensor]


def model_data(spec: LayoutSpec) -> dict[int, tuple[torch.Tensor, ...]]:
    """The full (TP1) KV per token and the full states, per layer."""
    data: dict[int, tuple[torch.Tensor, ...]] = {}
    for i, layer in enumerate(spec.layers):
        if isinstance(layer, AttentionLayer):
            data[i] = (torch.randn(NUM_TOKENS, layer.kv.num_units, 2, layer.head_size).to(torch.bfloat16),)
        else:
            conv = torch.randn(layer.conv_state_len, sum(part.size for part in layer.conv)).to(torch.bfloat16)
            data[i] = (conv, torch.randn(layer.temporal.num_units, *layer.temporal_head_shape).to(torch.bfloat16))
    return data


def build_rank(spec: LayoutSpec, data, fill: bool, generator: torch.Generator) -> Rank:
    caches, block_ids, pages = {}, {}, {}
    for i, layer in enumerate(spec.layers):
        if isinstance(layer, AttentionLayer):
            block_size = spec.block_sizes[layer.group]
            num_blocks = -(-NUM_TOKENS // block_size)
            caches[i] = torch.randn(num_blocks + 4, layer.kv.num_local_units, block_size,
                                    2 * layer.head_size).to(torch.bfloat16)
            block_ids[i] = (torch.randperm(num_blocks + 3, generator=generator)[:num_blocks] + 1).tolist()
            if fill:
                write_tokens(caches[i], block_ids[i], layer, block_size,
                             vllm_shard(data[i][0], layer.kv, spec.tp_rank, spec.tp_size, 1))
        else:
            pages[i] = torch.randint(0, 256, (layer.page_bytes,), dtype=torch.uint8, generator=generator)
            if fill:
                conv_state_view(pages[i], layer).copy_(conv_shard(data[i][0], layer, spec.tp_rank, spec.tp_size))
                temporal_state_view(pages[i], layer).copy_(
                    vllm_shard(data[i][1], layer.temporal, spec.tp_rank, spec.tp_size, 0))
    return Rank(spec, caches, block_ids, pages)


def read_tokens(cache: torch.Tensor, block_ids: list[int], layer, block_size: int) -> torch.Tensor:
    """A request's KV as [tokens, heads, 2, head_size]."""
    view = attention_view(cache, layer, block_size)
    blocks = torch.stack([token_view(view, half)[block_ids] for half in (0, 1)], dim=2)  # [blocks, heads, 2, ...]
    return blocks.permute(0, 3, 1, 2, 4).flatten(0, 1)[:NUM_TOKENS]


def write_tokens(cache: torch.Tensor, block_ids: list[int], layer, block_size: int, tokens: torch.Tensor) -> None:
    padded = torch.zeros(len(block_ids) * block_size, *tokens.shape[1:], dtype=tokens.dtype)
    padded[:NUM_TOKENS] = tokens
    blocks = padded.unflatten(0, (-1, block_size)).permute(0, 2, 3, 1, 4)  # [blocks, heads, 2, block, head]
    view = attention_view(cache, layer, block_size)
    for half in (0, 1):
        token_view(view, half)[block_ids] = blocks[:, :, half]


def wire(tensor: torch.Tensor) -> bytearray:
    return bytearray(tensor.contiguous().view(-1).view(torch.uint8).numpy().tobytes())


def transfer(layout_map: LayoutMap, producers: list[Rank], consumers: list[Rank]) -> None:
    """Every piece leaves its producer rank as bytes and lands on its consumer rank and replicas."""
    for producer in producers:
        for piece in layout_map.pieces_from(producer.spec.tp_rank):
            layer_map = layout_map.layers[piece.layer]
            for rank in (piece.dst_rank, *piece.replicas):
                if layer_map.is_attention:
                    send_attention(layer_map, piece, producer, consumers[rank])
                else:
                    payload = slice_state(producer.pages[piece.layer], layer_map.src, piece)
                    received = from_payload(wire(payload), layer_map.src.temporal_dtype, payload.shape)
                    write_state(consumers[rank].pages[piece.layer], layer_map.dst, piece, received)


def send_attention(layer_map, piece: Piece, producer: Rank, consumer: Rank) -> None:
    i = piece.layer
    source = attention_view(producer.caches[i], layer_map.src, layer_map.src_block_size)
    target = attention_view(consumer.caches[i], layer_map.dst, layer_map.dst_block_size)
    ids = producer.block_ids[i]
    for first in range(0, len(ids), FRAME_BLOCKS):
        payload = slice_attention(source, ids[first:first + FRAME_BLOCKS], piece)
        received = from_payload(wire(payload), "bfloat16", payload.shape)
        write_attention(target, consumer.block_ids[i], received, piece, first, layer_map.src_block_size)


def check_consumer(consumer: Rank, data) -> None:
    spec = consumer.spec
    for i, layer in enumerate(spec.layers):
        if isinstance(layer, AttentionLayer):
            found = read_tokens(consumer.caches[i], consumer.block_ids[i], layer, spec.block_sizes[layer.group])
            expected = vllm_shard(data[i][0], layer.kv, spec.tp_rank, spec.tp_size, 1)
            assert torch.equal(found, expected), f"rank {spec.tp_rank} layer {layer.name}"
        else:
            conv = conv_state_view(consumer.pages[i], layer)
            assert torch.equal(conv, conv_shard(data[i][0], layer, spec.tp_rank, spec.tp_size)), layer.name
            temporal = vllm_shard(data[i][1], layer.temporal, spec.tp_rank, spec.tp_size, 0)
            assert torch.equal(temporal_state_view(consumer.pages[i], layer), temporal), layer.name


def run_pairing(src: LayoutSpec, dst: LayoutSpec) -> None:
    generator = torch.Generator().manual_seed(src.tp_size * 10 + dst.tp_size)
    torch.manual_seed(0)
    data = model_data(src)
    producers = [build_rank(spec, data, True, generator) for spec in ranks(src)]
    consumers = [build_rank(spec, data, False, generator) for spec in ranks(dst)]
    layout_map = plan_mapping([p.spec for p in producers], [c.spec for c in consumers])
    assert isinstance(layout_map, LayoutMap), layout_map
    transfer(layout_map, producers, consumers)
    for consumer in consumers:
        check_consumer(consumer, data)


@pytest.mark.parametrize("src_tp, dst_tp", [(1, 2), (2, 1), (2, 2), (1, 1)])
def test_gdn_model_maps_exactly_between_tp_sizes(src_tp, dst_tp):
    run_pairing(gdn_model(src_tp), gdn_model(dst_tp))


@pytest.mark.parametrize("src_tp, dst_tp", [(1, 4), (4, 1), (2, 4), (4, 2)])
def test_replicated_heads_and_groups_map_exactly(src_tp, dst_tp):
    run_pairing(mamba_model(src_tp), mamba_model(dst_tp))


@pytest.mark.parametrize("src_bs, dst_bs", [(16, 32), (32, 16), (128, 256), (256, 128), (32, 48)])
@pytest.mark.parametrize("src_tp, dst_tp", [(1, 1), (1, 2), (2, 1)])
def test_block_size_mismatch_round_trips_exactly(src_bs, dst_bs, src_tp, dst_tp):
    run_pairing(gdn_model(src_tp, block_size=src_bs), gdn_model(dst_tp, block_size=dst_bs))
    run_pairing(gdn_model(dst_tp, block_size=dst_bs), gdn_model(src_tp, block_size=src_bs))


def test_a_contiguous_slice_of_the_conv_dim_is_not_a_rank_shard():
    layer = gdn("g", 0, tp=2)
    full = torch.randn(3, sum(part.size for part in layer.conv))
    for rank in range(2):
        assert not torch.equal(full.chunk(2, dim=1)[rank], conv_shard(full, layer, rank, 2))


def test_conv_state_in_ds_layout_reads_as_sd():
    layer = gdn("g", 0, tp=1)
    ds = LinearLayer(layer.name, 0, layer.conv, layer.conv_state_len, layer.temporal, layer.temporal_head_shape,
                     "bfloat16", "bfloat16", layer.page_bytes, "DS")
    page = torch.zeros(layer.page_bytes, dtype=torch.uint8)
    values = torch.arange(ds.conv_dim * 3, dtype=torch.bfloat16).view(ds.conv_dim, 3)
    page[:ds.conv_bytes].view(torch.bfloat16).copy_(values.flatten())
    assert torch.equal(conv_state_view(page, ds), values.t())


def test_consumer_blocks_marked_none_are_left_alone():
    spec = gdn_model(1)
    layer = spec.layers[3]
    source = attention_view(torch.randn(3, 2, 16, 16).to(torch.bfloat16), layer, 16)
    target = attention_view(torch.zeros(4, 2, 32, 16, dtype=torch.bfloat16), layer, 32)
    piece = Piece(3, "kv_heads", 0, 2, 0, 0, 0, 0)
    write_attention(target, [None, 3], slice_attention(source, [1, 2, 0], piece), piece, 0, 16)
    assert not target[:3].any()
    for half in (0, 1):
        assert torch.equal(token_view(target, half)[3, :, :16], token_view(source, half)[0])


KERNEL_LAYER = AttentionLayer("layers.0", 0, Sharded("kv_heads", 2, 64, 2))  # head sizes the kernel supports
ISA_LAYOUTS = {"vec": CPU_K_TRANSPOSED, "vec16": CPU_K_TRANSPOSED, "amx": CPU_AMX}
# vLLM's AVX2 build of its CPU ops has no amx kernel ("Unsupported CPU attention configuration"): there
# the layout is checked against ``_reference_cache`` alone, written from the kernel's source
KERNEL_MISSING = "Unsupported CPU attention configuration"


def _offsets(isa: str, token: torch.Tensor, channel: torch.Tensor, block_size: int,
             head_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Where vLLM's ``cpu_attn_reshape_and_cache`` puts K and V of (token in block, channel) within a
    (block, head)'s K area and V area, read from its source at v0.32.0 (csrc/cpu/cpu_attn_vec.hpp,
    cpu_attn_vec16.hpp: K transposed, V as it is; cpu_attn_amx.hpp: K packed as 16-token groups of
    channel pairs, V as 16-channel groups of token pairs)."""
    if isa in ("vec", "vec16"):
        return channel * block_size + token, token * head_size + channel
    k = (token // 16) * 16 * head_size + (channel // 2) * 32 + (token % 16) * 2 + channel % 2
    v = (channel // 16) * 16 * block_size + (token // 2) * 32 + (channel % 16) * 2 + token % 2
    return k, v


def _reference_cache(keys: torch.Tensor, values: torch.Tensor, block_ids: list[int], block_size: int,
                     isa: str) -> torch.Tensor:
    """What ``_kernel_cache`` holds, placed element by element at ``_offsets``."""
    tokens, heads, head_size = keys.shape
    cache = torch.zeros(max(block_ids) + 1, heads, block_size, 2 * head_size, dtype=keys.dtype)
    areas = cache.view(cache.shape[0], heads, 2, block_size * head_size)
    token = torch.arange(tokens)
    blocks = torch.tensor(block_ids)[token // block_size][:, None]
    k, v = _offsets(isa, (token % block_size)[:, None], torch.arange(head_size)[None, :], block_size, head_size)
    for head in range(heads):
        areas[:, head, 0][blocks, k] = keys[:, head]
        areas[:, head, 1][blocks, v] = values[:, head]
    return cache


def _kernel_cache(keys: torch.Tensor, values: torch.Tensor, block_ids: list[int], block_size: int,
                  isa: str | None = None) -> torch.Tensor | None:
    """A cache of ``[blocks, heads, block_size, 2 * head_size]`` holding ``keys``/``values``
    ([tokens, heads, head_size]) in ``block_ids``, written by vLLM's own CPU kernel for ``isa`` (by
    default the one vLLM picks on this host); None where this host's build of the op lacks it."""
    from vllm import _custom_ops as ops
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    tokens, heads, head_size = keys.shape
    cache = torch.zeros(max(block_ids) + 1, heads, block_size, 2 * head_size, dtype=keys.dtype)
    key_cache, value_cache = cache.view(cache.shape[0], heads, 2 * block_size, head_size).chunk(2, dim=2)
    slots = torch.tensor([block_ids[t // block_size] * block_size + t % block_size for t in range(tokens)])
    try:
        ops.cpu_attn_reshape_and_cache(keys, values, key_cache, value_cache, slots,
                                       isa or _get_attn_isa(keys.dtype, block_size, head_size))
    except RuntimeError as error:
        assert KERNEL_MISSING in str(error) and isa == "amx" and not torch.cpu._is_avx512_supported(), error
        return None
    return cache


def _cache(keys, values, block_ids, block_size, isa: str) -> torch.Tensor:
    """The kernel's cache where this host's build has the kernel, else the reference's."""
    cache = _kernel_cache(keys, values, block_ids, block_size, isa)
    return _reference_cache(keys, values, block_ids, block_size, isa) if cache is None else cache


def _kv(tokens: int, heads: int = 2, head_size: int = 64, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(tokens, heads, head_size, generator=generator).to(torch.bfloat16) for _ in range(2))


def _found(cache: torch.Tensor, block_ids: list[int], block_size: int, layout: str, tokens: int) -> torch.Tensor:
    """K and V of the first ``tokens`` tokens of ``block_ids``, [2, tokens, heads, head_size]."""
    layer = AttentionLayer("layers.0", 0, Sharded("kv_heads", cache.shape[1], cache.shape[3] // 2, cache.shape[1]))
    view = attention_view(cache, layer, block_size)
    return torch.stack([tokens_in(view, half, layout)[block_ids].permute(0, 2, 1, 3).flatten(0, 1)[:tokens]
                        for half in (0, 1)])


KERNEL_SHAPES = [("vec", 32, 64), ("vec", 128, 64), ("vec16", 16, 64), ("vec16", 48, 64), ("vec16", 32, 80),
                 ("amx", 32, 64), ("amx", 64, 64), ("amx", 128, 64), ("amx", 32, 128), ("amx", 128, 128)]


def test_every_kernel_layout_is_checked_here():
    assert ISA_LAYOUTS == KERNEL_LAYOUTS and {isa for isa, _, _ in KERNEL_SHAPES} == set(KERNEL_LAYOUTS)


@pytest.mark.parametrize("isa, block_size, head_size", KERNEL_SHAPES)
def test_the_reference_layouts_are_what_vllms_kernels_write(isa, block_size, head_size):
    keys, values = _kv(2 * block_size, head_size=head_size)
    kernel = _kernel_cache(keys, values, [3, 1], block_size, isa)
    reference = _reference_cache(keys, values, [3, 1], block_size, isa)
    assert kernel is None or torch.equal(kernel, reference)
    assert reference[[3, 1]].count_nonzero() > 0.99 * reference[[3, 1]].numel()  # every element placed


@pytest.mark.parametrize("isa, block_size, head_size", KERNEL_SHAPES)
def test_token_views_read_k_and_v_where_vllms_kernels_write_them(isa, block_size, head_size):
    layout = KERNEL_LAYOUTS[isa]
    keys, values = _kv(2 * block_size, head_size=head_size)
    cache = _cache(keys, values, [3, 1], block_size, isa)
    assert torch.equal(_found(cache, [3, 1], block_size, layout, 2 * block_size), torch.stack([keys, values]))
    view = attention_view(cache, KERNEL_LAYER, block_size) if head_size == 64 else None
    if layout == CPU_AMX:
        with pytest.raises(ValueError, match="tile_view"):
            token_view(view, 0, layout)
    elif head_size % 16 == 0 and block_size % 16 == 0 and view is not None:  # the tiled view reads the same
        for half in (0, 1):
            tiles = tile_view(view, half, layout)
            assert torch.equal(tiles.flatten(5, 7).flatten(2, 4), token_view(view, half, layout))


@pytest.mark.parametrize("isa", ["vec", "amx"])
@pytest.mark.parametrize("dst_isa", ["vec", "amx"])
def test_tp_slicing_writes_what_vllms_kernel_writes_on_each_rank(isa, dst_isa):
    """TP 1 -> 2 (each consumer rank one head of the producer's two) and 2 -> 1 (each producer rank's
    head into its place), from a cache the kernel of ``isa`` wrote to one ``dst_isa``'s would write."""
    block_size, tokens, ids = 64, 3 * 64 - 5, [2, 5, 1]
    keys, values = _kv(tokens, seed=1)
    layout, dst_layout = KERNEL_LAYOUTS[isa], KERNEL_LAYOUTS[dst_isa]
    one_head = AttentionLayer("layers.0", 0, Sharded("kv_heads", 2, 64, 1))
    whole = attention_view(_cache(keys, values, ids, block_size, isa), KERNEL_LAYER, block_size)
    for rank in range(2):  # 1 -> 2
        expected = _cache(keys[:, rank:rank + 1], values[:, rank:rank + 1], ids, block_size, dst_isa)
        target = torch.zeros_like(expected)
        piece = Piece(0, "kv_heads", rank, 1, 0, rank, rank, 0)
        write_attention(attention_view(target, one_head, block_size), ids, slice_attention(whole, ids, piece), piece,
                        0, block_size, dst_layout, layout)
        assert torch.equal(_found(target, ids, block_size, dst_layout, tokens),
                           _found(expected, ids, block_size, dst_layout, tokens))
    expected = _cache(keys, values, ids, block_size, dst_isa)
    target = torch.zeros_like(expected)
    for rank in range(2):  # 2 -> 1
        source = attention_view(_cache(keys[:, rank:rank + 1], values[:, rank:rank + 1], ids, block_size, isa),
                                one_head, block_size)
        piece = Piece(0, "kv_heads", rank, 1, rank, 0, 0, rank)
        write_attention(attention_view(target, KERNEL_LAYER, block_size), ids, slice_attention(source, ids, piece),
                        piece, 0, block_size, dst_layout, layout)
    assert torch.equal(_found(target, ids, block_size, dst_layout, tokens),
                       _found(expected, ids, block_size, dst_layout, tokens))


@pytest.mark.parametrize("isa, src_size, dst_isa, dst_size", [
    ("vec", 64, "vec", 128), ("vec", 128, "vec", 32), ("vec16", 32, "vec16", 48), ("amx", 64, "amx", 128),
    ("amx", 128, "amx", 32), ("amx", 64, "vec", 128), ("vec", 64, "amx", 128), ("amx", 32, "vec16", 16),
    ("vec16", 16, "amx", 64), ("amx", 64, "amx", 64), ("amx", 64, "vec", 64)])
def test_re_blocked_kv_is_what_vllms_kernel_writes_with_the_consumers_block_size(isa, src_size, dst_isa, dst_size):
    tokens = 3 * 128
    keys, values = _kv(tokens, seed=2)
    src_ids = list(range(1, tokens // src_size + 1))
    dst_ids = list(range(2, 2 + -(-tokens // dst_size)))
    source = attention_view(_cache(keys, values, src_ids, src_size, isa), KERNEL_LAYER, src_size)
    expected = _cache(keys, values, dst_ids, dst_size, dst_isa)
    target = torch.zeros_like(expected)
    piece = Piece(3, "kv_heads", 0, 2, 0, 0, 0, 0)
    write_attention(attention_view(target, KERNEL_LAYER, dst_size), dst_ids, slice_attention(source, src_ids, piece),
                    piece, 0, src_size, KERNEL_LAYOUTS[dst_isa], KERNEL_LAYOUTS[isa])
    assert torch.equal(target, expected)


# e4m3: half a step of the top binade (16/448 of a row's absmax) plus bfloat16's roundings; int8: half
# a step (1/254) plus bfloat16's rounding of the result (tests/unit/test_wire_codecs.py)
CODEC_BOUNDS = {"fp8": 0.045, "int8": 1 / 254 + 1 / 256 + 1e-4}


@pytest.mark.parametrize("codec", ["fp8", "int8"])
@pytest.mark.parametrize("isa, dst_isa", [("vec", "vec"), ("amx", "amx"), ("amx", "vec"), ("vec", "amx")])
def test_codec_rows_lie_in_one_area_of_every_layout(codec, isa, dst_isa):
    """A coded row (``codecs.coding_of``: ``max(block_size, head_size)`` values) lies inside one
    (block, head, K or V) area in every kernel layout, so its scale stays with its head and half; the
    decoded payload re-blocks and converts like a raw one. In the vec layout a row is one channel of
    K over the block's tokens; in the amx layout a run of K's 16-token groups of channel pairs, or of
    V's token pairs of one 16-channel group."""
    from services.kv_connector.codecs import coding_of, decode, encode
    from services.kv_transport import codecs

    number = {"fp8": codecs.FP8, "int8": codecs.INT8}[codec]
    block_size, tokens = 64, 4 * 64
    keys, values = _kv(tokens, seed=3)
    keys[:, 0] *= 100  # a head far larger than the other: a row across heads would flatten the small one
    ids = [4, 1, 3, 2]
    cache = _cache(keys, values, ids, block_size, isa)
    dtype, row_elems = coding_of(cache)
    assert row_elems == max(block_size, 64) and (block_size * 64) % row_elems == 0
    piece = Piece(0, "kv_heads", 0, 2, 0, 0, 0, 0)
    payload = slice_attention(attention_view(cache, KERNEL_LAYER, block_size), ids, piece)
    coded = encode(number, memoryview(payload.contiguous().view(-1).view(torch.uint8).numpy()), dtype, row_elems)
    decoded = from_payload(bytearray(decode(number, coded, row_elems, torch.bfloat16)), "bfloat16", payload.shape)
    target = torch.zeros(6, 2, 128, 128, dtype=torch.bfloat16)
    write_attention(attention_view(target, KERNEL_LAYER, 128), [5, 1], decoded, piece, 0, block_size,
                    KERNEL_LAYOUTS[dst_isa], KERNEL_LAYOUTS[isa])
    found = _found(target, [5, 1], 128, KERNEL_LAYOUTS[dst_isa], tokens).float()
    sent = torch.stack([keys, values]).float()
    error, absmax = (found - sent).abs().amax(dim=(1, 3)), sent.abs().amax(dim=(1, 3))  # per (K or V, head)
    assert (error <= CODEC_BOUNDS[codec] * absmax).all() and not torch.equal(found, sent)
