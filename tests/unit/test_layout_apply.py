"""Applying a layout map to tensors (issue 19): a model's KV and state, split over producer ranks as
vLLM splits them, moved through bytes into consumer ranks with another TP and block size, must equal
the consumer's own split exactly."""
from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from support.layouts import gdn, gdn_model, mamba_model, ranks

from services.kv_connector.layouts.apply import (attention_view, conv_state_view, from_payload, slice_attention,
                                                slice_state, temporal_state_view, token_view, write_attention,
                                                write_state)
from services.kv_connector.layouts.mapping import LayoutMap, Piece, plan_mapping
from services.kv_connector.layouts.spec import AttentionLayer, LayoutSpec, LinearLayer, Sharded

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


def _kernel_cache(keys: torch.Tensor, values: torch.Tensor, block_ids: list[int], block_size: int) -> torch.Tensor:
    """A cache of ``[blocks, heads, block_size, 2 * head_size]`` holding ``keys``/``values``
    ([tokens, heads, head_size]) in ``block_ids``, written by vLLM's own CPU kernel."""
    from vllm import _custom_ops as ops
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    tokens, heads, head_size = keys.shape
    cache = torch.zeros(max(block_ids) + 1, heads, block_size, 2 * head_size, dtype=keys.dtype)
    key_cache, value_cache = cache.view(cache.shape[0], heads, 2 * block_size, head_size).chunk(2, dim=2)
    slots = torch.tensor([block_ids[t // block_size] * block_size + t % block_size for t in range(tokens)])
    ops.cpu_attn_reshape_and_cache(keys, values, key_cache, value_cache, slots,
                                   _get_attn_isa(keys.dtype, block_size, head_size))
    return cache


@pytest.mark.parametrize("block_size", [16, 32, 128])
def test_token_view_reads_k_and_v_where_vllms_cpu_kernel_writes_them(block_size):
    layer = KERNEL_LAYER
    keys, values = (torch.randn(2 * block_size, 2, 64).to(torch.bfloat16) for _ in range(2))
    view = attention_view(_kernel_cache(keys, values, [3, 1], block_size), layer, block_size)
    for half, expected in ((0, keys), (1, values)):
        found = token_view(view, half)[[3, 1]].permute(0, 2, 1, 3).flatten(0, 1)  # [tokens, heads, head]
        assert torch.equal(found, expected)


@pytest.mark.parametrize("src_size, dst_size", [(64, 128), (128, 32), (32, 48)])
def test_re_blocked_kv_is_what_vllms_kernel_writes_with_the_consumers_block_size(src_size, dst_size):
    layer = KERNEL_LAYER
    tokens = 3 * 128
    keys, values = (torch.randn(tokens, 2, 64).to(torch.bfloat16) for _ in range(2))
    src_ids = list(range(1, tokens // src_size + 1))
    dst_ids = list(range(2, 2 + -(-tokens // dst_size)))
    source = attention_view(_kernel_cache(keys, values, src_ids, src_size), layer, src_size)
    expected = attention_view(_kernel_cache(keys, values, dst_ids, dst_size), layer, dst_size)
    target = torch.zeros_like(expected)
    piece = Piece(3, "kv_heads", 0, 2, 0, 0, 0, 0)
    write_attention(target, dst_ids, slice_attention(source, src_ids, piece), piece, 0, src_size)
    assert torch.equal(target[2:2 + tokens // dst_size], expected[2:2 + tokens // dst_size])
