"""Layout specs (issue 19): the handshake payload, the producer → consumer map, its refusals and cost."""
from __future__ import annotations

import json
from collections import Counter
from dataclasses import replace

import pytest
from hypothesis import given
from hypothesis import strategies as st
from support.layouts import attention, gdn, gdn_model, mamba_model, ranks

from services.kv_connector.layouts.mapping import (LayoutMap, Unmappable, chunk_size, plan_mapping, token_chunks,
                                              wire_cost)
from services.kv_connector.layouts.spec import AttentionLayer, LayoutSpec, Sharded


def plan(src: LayoutSpec, dst: LayoutSpec) -> LayoutMap:
    result = plan_mapping(ranks(src), ranks(dst))
    assert isinstance(result, LayoutMap), result
    return result


# The spec and its bytes ----------------------------------------------------------------------

@pytest.mark.parametrize("spec", [gdn_model(1), gdn_model(2).for_rank(1), mamba_model(4, 256).for_rank(3)])
def test_spec_round_trips_through_bytes(spec):
    assert LayoutSpec.from_bytes(spec.to_bytes()) == spec


def _edited(edit) -> bytes:
    data = json.loads(gdn_model(2).to_bytes())
    edit(data)
    return json.dumps(data).encode()


@pytest.mark.parametrize("payload, message", [
    (b"\xff not json", "not JSON"),
    (b"[1, 2]", "not a JSON object"),
    (_edited(lambda d: d.update(version=99)), "version 99"),
    (_edited(lambda d: d.pop("dtype")), "missing field(s) ['dtype']"),
    (_edited(lambda d: d.update(colour="red")), "unknown field(s) ['colour']"),
    (_edited(lambda d: d.update(tp_size="2")), "LayoutSpec.tp_size: '2' is not int"),
    (_edited(lambda d: d.update(block_sizes=[16, "x", 16, 16])), "not a list of integers"),
    (_edited(lambda d: d.update(dtype="float64")), "dtype 'float64' is not one of"),
    (_edited(lambda d: d.update(tp_rank=2)), "TP rank 2 is not in [0, 2)"),
    (_edited(lambda d: d["layers"][0].update(kind="conv")), "layer kind 'conv'"),
    (_edited(lambda d: d["layers"][3]["kv"].update(num_local_units=3)), "cannot hold 3 of 2 units"),
    (_edited(lambda d: d["layers"][3]["kv"].update(unit_size=True)), "Sharded.unit_size: True is not int"),
    (_edited(lambda d: d["layers"][3].update(group=7)), "group 7 has no block size"),
    (_edited(lambda d: d["layers"][0].update(conv_layout="XY")), "conv_layout 'XY'"),
    (_edited(lambda d: d["layers"][0].update(page_bytes=10)), "cannot hold conv"),
    (_edited(lambda d: d["layers"][0].update(temporal_head_shape=[4, 5])), "does not hold 16 elements"),
    (_edited(lambda d: d["layers"][1].update(name="layers.0")), "layer names repeat"),
])
def test_bad_spec_bytes_raise_a_clear_value_error(payload, message):
    with pytest.raises(ValueError) as error:
        LayoutSpec.from_bytes(payload)
    assert message in str(error.value)


def test_gdn_conv_offsets_are_per_component():
    layer = gdn("g", 0, tp=2)
    assert layer.conv_offsets == {"query_key": 0, "key": 4, "value": 8}
    assert layer.conv_dim == 16


# Refusals --------------------------------------------------------------------------------------

TP1 = ranks(gdn_model(1))


def _gdn_with(**changes) -> LayoutSpec:
    return replace(gdn_model(2), **changes)


def _layer_replaced(spec: LayoutSpec, index: int, layer) -> LayoutSpec:
    layers = list(spec.layers)
    layers[index] = layer
    return replace(spec, layers=tuple(layers))


@pytest.mark.parametrize("producers, consumers, message", [
    (TP1, ranks(gdn_model(2, model="other")), "different models: producer 'tiny-hybrid', consumer 'other'"),
    (TP1, ranks(gdn_model(2, dtype="float16")), "different KV dtypes: producer bfloat16, consumer float16"),
    (TP1, ranks(_gdn_with(layers=gdn_model(2).layers[:3])), "different layer counts: producer 4, consumer 3"),
    (TP1, ranks(_layer_replaced(gdn_model(2), 3, attention("layers.3", 3, 2, head_size=16))),
     "layer layers.3: different head sizes: producer 8, consumer 16"),
    (TP1, ranks(_layer_replaced(gdn_model(2), 3, attention("layers.3", 3, 2, num_kv_heads=4))),
     "different KV head counts: producer 2, consumer 4"),
    (TP1, ranks(_layer_replaced(gdn_model(2), 0, attention("layers.0", 0, 2))),
     "producer has linear layer layers.0, consumer attention layer layers.0"),
    (TP1, ranks(_layer_replaced(gdn_model(2), 1, gdn("layers.1", 1, 2, v_dim=8))),
     "different conv components: producer [query_key 2x4, key 2x4, value 4x4], consumer [query_key 2x4, key 2x4, "
     "value 4x8]"),
    (TP1, ranks(_layer_replaced(gdn_model(2), 1, gdn("layers.1", 1, 2, dtype="float32"))),
     "different state dtypes: producer bfloat16/bfloat16, consumer float32/float32"),
    (TP1, ranks(gdn_model(3)), "consumer layer layers.0: TP 3 is not a multiple of the 2 query_key"),
    (TP1, ranks(gdn_model(2))[:1], "the consumer announced ranks [0], not each of TP 2 once"),
    (TP1, [], "the consumer announced no ranks"),
    ([gdn_model(2), gdn_model(2, block_size=32).for_rank(1)], TP1,
     "the producer's TP ranks announce different layouts"),
    (ranks(_layer_replaced(gdn_model(2), 3, AttentionLayer("layers.3", 3, Sharded("kv_heads", 2, 8, 2)))),
     TP1, "kv_heads: a rank announces 2 of 2 units, vLLM holds 1 at TP 2"),
])
def test_unmappable_pairs_say_why(producers, consumers, message):
    result = plan_mapping(producers, consumers)
    assert isinstance(result, Unmappable)
    assert message in result.reason


def test_non_divisible_heads_are_unmappable():
    three_heads = LayoutSpec("m", "bfloat16", 0, 2, (16,), (AttentionLayer("a", 0, Sharded("kv_heads", 3, 8, 1)),))
    result = plan_mapping(ranks(three_heads), ranks(replace(three_heads, tp_size=1)))
    assert result == Unmappable("producer layer a: 3 kv_heads units do not divide over TP 2")


# The map ---------------------------------------------------------------------------------------

PAIRINGS = [(1, 1), (1, 2), (2, 1), (2, 2), (1, 4), (4, 1), (2, 4), (4, 2), (4, 4)]


@pytest.mark.parametrize("src_tp, dst_tp", PAIRINGS)
def test_every_unit_crosses_once_and_reaches_every_holder(src_tp, dst_tp):
    layout_map = plan(mamba_model(src_tp), mamba_model(dst_tp))
    for layer in layout_map.layers:
        for src_part, dst_part in zip(layer.src.parts, layer.dst.parts):
            pieces = [p for p in layer.pieces if p.part == dst_part.name]
            sent = Counter(u for p in pieces for u in range(p.first_unit, p.first_unit + p.num_units))
            assert sent == Counter(range(dst_part.num_units))
            for piece in pieces:
                for offset in range(piece.num_units):
                    unit = piece.first_unit + offset
                    assert piece.src_rank in src_part.holders(unit, src_tp)
                    assert piece.src_start + offset == unit - src_part.first_unit(piece.src_rank, src_tp)
                    assert {piece.dst_rank, *piece.replicas} == set(dst_part.holders(unit, dst_tp))
                    for rank in (piece.dst_rank, *piece.replicas):
                        assert piece.dst_start + offset == unit - dst_part.first_unit(rank, dst_tp)


def test_tp1_to_tp2_sends_each_rank_its_share_of_each_component():
    layer = plan(gdn_model(1), gdn_model(2)).layers[0]
    shares = {(p.part, p.dst_rank): (p.first_unit, p.num_units, p.src_start, p.dst_start) for p in layer.pieces}
    assert shares == {("query_key", 0): (0, 1, 0, 0), ("query_key", 1): (1, 1, 1, 0),
                      ("key", 0): (0, 1, 0, 0), ("key", 1): (1, 1, 1, 0),
                      ("value", 0): (0, 2, 0, 0), ("value", 1): (2, 2, 2, 0),
                      ("ssm", 0): (0, 2, 0, 0), ("ssm", 1): (2, 2, 2, 0)}


def test_replicated_heads_cross_once_and_name_their_replicas():
    layer = plan(mamba_model(1), mamba_model(4)).layers[1]
    assert [(p.first_unit, p.dst_rank, p.replicas) for p in layer.pieces] == [(0, 1, (0,)), (1, 3, (2,))]
    assert plan(mamba_model(1), mamba_model(4)).pieces_to(0)[0].part == "x"


def test_identity_only_for_equal_tp_and_block_sizes():
    assert plan(gdn_model(2), gdn_model(2)).is_identity
    assert not plan(gdn_model(2), gdn_model(2, block_size=32)).is_identity
    assert not plan(gdn_model(1), gdn_model(2)).is_identity


@pytest.mark.parametrize("src_tp, dst_tp", PAIRINGS)
def test_wire_bytes_equal_the_kv_the_consumer_needs(src_tp, dst_tp):
    cost = wire_cost(plan(mamba_model(src_tp), mamba_model(dst_tp)))
    assert cost.kv_bytes_per_token == 2 * (2 * 2 * 8 * 2)  # 2 layers x 2 heads x K,V x head 8 x bf16
    assert (cost.wire_bytes_per_token, cost.state_wire_bytes) == (cost.kv_bytes_per_token, cost.state_bytes)
    assert cost.ratio == 1.0
    assert cost.replica_bytes_per_token == cost.kv_bytes_per_token * (max(1, dst_tp // 2) - 1)


# Re-blocking -----------------------------------------------------------------------------------

@pytest.mark.parametrize("src_bs, dst_bs, chunks", [
    (16, 32, [(0, 0, 0, 0), (1, 0, 0, 1), (2, 0, 1, 0)]),
    (32, 16, [(0, 0, 2, 0), (0, 1, 3, 0), (1, 0, 4, 0), (1, 1, 5, 0)]),
])
def test_token_chunks_table(src_bs, dst_bs, chunks):
    first_block = 0 if src_bs == 16 else 1
    found = token_chunks(first_block, 3 if src_bs == 16 else 2, src_bs, dst_bs)
    assert [(c.src_block, c.src_slot, c.dst_block, c.dst_slot) for c in found] == chunks


@given(st.sampled_from([16, 32, 48, 64, 128, 256]), st.sampled_from([16, 32, 64, 128, 256]),
       st.integers(0, 5), st.integers(1, 6))
def test_token_chunks_place_every_token_where_the_consumer_keeps_it(src_bs, dst_bs, first_block, num_blocks):
    size = chunk_size(src_bs, dst_bs)
    chunks = token_chunks(first_block, num_blocks, src_bs, dst_bs)
    assert len(chunks) * size == num_blocks * src_bs
    for c in chunks:
        token = (first_block + c.src_block) * src_bs + c.src_slot * size
        assert (c.dst_block, c.dst_slot * size) == divmod(token, dst_bs)


def _one_layer(num_heads: int, tp: int) -> LayoutSpec:
    return LayoutSpec("m", "bfloat16", 0, tp, (16,), (attention("a", 0, tp, num_kv_heads=num_heads),))


@given(st.sampled_from([1, 2, 4, 8, 16]), st.sampled_from([1, 2, 4, 8]), st.sampled_from([1, 2, 4, 8]))
def test_any_valid_split_pair_maps_each_head_to_all_its_holders_once(num_heads, src_tp, dst_tp):
    layout_map = plan(_one_layer(num_heads, src_tp), _one_layer(num_heads, dst_tp))
    kv = _one_layer(num_heads, dst_tp).layers[0].parts[0]
    received = Counter((unit, rank) for p in layout_map.layers[0].pieces for rank in (p.dst_rank, *p.replicas)
                       for unit in range(p.first_unit, p.first_unit + p.num_units))
    assert received == Counter((unit, rank) for rank in range(dst_tp)
                               for unit in range(kv.first_unit(rank, dst_tp),
                                                 kv.first_unit(rank, dst_tp) + kv.num_local_units))
    assert wire_cost(layout_map).ratio == 1.0
