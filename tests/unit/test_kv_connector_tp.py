"""Head slicing between TP sizes (issue 19): producer ranks of one TP size stream a request's KV to
the consumer ranks of another, through the connector's worker layer on both sides. Each consumer
rank ends up with exactly the KV heads, the linear-attention heads and each conv component's share
it owns, whichever producer ranks held them; block sizes may differ at the same time.

The transport is a list of (address, frame) per producer rank (this tests the worker layer alone);
real engines are covered by tests/e2e/test_hetero_tp.py.
"""
from __future__ import annotations

import random
from dataclasses import replace
from functools import partial
from types import SimpleNamespace

import pytest
import torch

from services.kv_connector.layouts.pages import KVLayout
from services.kv_connector.layouts.apply import (attention_view, conv_state_view, read_tokens, state_page,
                                                temporal_state_view)
from services.kv_connector.layouts.spec import CPU_AMX, CPU_K_TRANSPOSED, TOKEN_ROWS
from services.kv_connector.layouts.from_vllm import spec_from_vllm
from services.kv_connector.metadata import PrfaasConnectorMetadata, RecvSpec, SendSpec
from services.kv_connector.consumer import ReceiveSettings
from services.kv_connector.producer import SendSettings
from services.kv_connector.device.streams import Device
from services.kv_connector.worker import PrfaasConnectorWorker, WorkerSettings
from services.kv_connector.codecs import encode
from services.kv_transport import Frame, TransferDone, TransferFailed, codecs, protocol
from support.sync_recorder import mark_caches, recording_syncs
from support.wire import FRAME_BYTES, parts_on_the_wire

NUM_BLOCKS, HEADS, HEAD_SIZE = 24, 2, 8
K_HEADS, K_DIM, V_HEADS, V_DIM, STATE_LEN = 4, 4, 4, 4, 3  # at TP 4 the 2 KV heads are replicated, these not
NUM_TOKENS = 100
PEER = "127.0.0.1:7000"


class _Wire:
    """Stands in for one rank's KVTransport: sends are recorded with their address; ``poll`` hands
    out what the test delivered."""

    def __init__(self, port: int, frame_bytes: int = 0) -> None:
        self.sent: list[tuple[str, object]] = []
        self.pending: list = []
        self.listen_host, self.port = "127.0.0.1", port
        self.receive_frame_bytes = frame_bytes  # what its receiver would announce
        self.allocate = None  # on CUDA: where frames are read into (the loader's receive ring, or not)

    def frame_bytes(self, peer: str) -> int:
        return FRAME_BYTES

    def receive_into(self, allocate) -> None:
        self.allocate = allocate

    def send_layout(self, peer: str, transfer_id: str, payload: bytes) -> None:
        self.sent.append((peer, Frame(transfer_id, 0, 0, 0, 0, memoryview(bytes(payload)), protocol.LAYOUT)))

    codec = codecs.NONE  # what the handshake agreed on (tests/unit/test_wire_codecs.py sets fp8)

    def send(self, peer, transfer_id, layer, group, block_start, num_blocks, payload, on_sent=None,
             coding=None, divisible=False) -> None:
        for start, count, part in parts_on_the_wire(block_start, num_blocks, payload, divisible):
            frame = Frame(transfer_id, layer, group, start, count, memoryview(bytes(part)))
            if coding is not None and self.codec != codecs.NONE:  # coded as the transport codes it
                coded = memoryview(bytes(encode(self.codec, part, *coding)))
                frame = Frame(transfer_id, layer, group, start, count, coded, protocol.DATA, self.codec, coding[1])
            self.sent.append((peer, frame))
        if on_sent is not None:  # the payload was copied: its memory may be reused
            on_sent()

    def finish(self, peer: str, transfer_id: str) -> None:
        self.sent.append((peer, TransferDone(transfer_id)))

    def poll(self, wait_s: float) -> list:
        events, self.pending = self.pending, []
        return [self._received(event) for event in events]

    def _received(self, event):
        """A data frame read into the memory ``allocate`` gives, as the transport reads it."""
        if self.allocate is None or not isinstance(event, Frame) or event.kind != protocol.DATA:
            return event
        memory = self.allocate(len(event.payload))
        memory[:] = event.payload
        return replace(event, payload=memory)

    def forget(self, transfer_id: str) -> None:
        pass

    def abort(self, peer: str, transfer_id: str, reason: str) -> None:
        self.sent.append((peer, TransferFailed(transfer_id, reason)))

    def snapshot(self) -> str:
        return "telemetry"

    def close(self) -> None:
        pass


CACHE_LAYOUTS = {"cpu": CPU_K_TRANSPOSED, "amx": CPU_AMX, "LBNHC": TOKEN_ROWS, "LBHNC": TOKEN_ROWS}


def _rank(tp_size: int, tp_rank: int, block_size: int, fill: bool, kv_heads: int = HEADS,
          code_sends: bool = False, layout: str = "cpu", head_size: int = HEAD_SIZE,
          device_of=Device) -> PrfaasConnectorWorker:
    """One rank of a tiny hybrid engine (a Gated-DeltaNet layer, group 0, and a full-attention layer
    of ``kv_heads`` KV heads, group 1) at ``tp_size``, caches random (``fill``) or zero, the attention
    cache in the layout of vLLM's CPU vec kernels (``layout`` "cpu") or its amx kernel ("amx"; its
    fingerprint says so, as the connector's does), or as its GPU backends register it, a strided
    [blocks, heads, tokens, K|V] view of a token-major ("LBNHC") or head-major ("LBHNC") buffer."""
    heads, k_heads, v_heads = max(1, kv_heads // tp_size), K_HEADS // tp_size, V_HEADS // tp_size
    conv_dim = 2 * k_heads * K_DIM + v_heads * V_DIM
    page_bytes = max(256, (conv_dim * STATE_LEN + v_heads * V_DIM * K_DIM) * 2)
    state = SimpleNamespace(block_size=block_size, shapes=((STATE_LEN, conv_dim), (v_heads, V_DIM, K_DIM)),
                            mamba_type="gdn_attn", dtypes=(torch.bfloat16, torch.bfloat16), page_size_bytes=page_bytes)
    attention = SimpleNamespace(block_size=block_size, num_kv_heads=heads, head_size=head_size, dtype=torch.bfloat16)
    config = SimpleNamespace(num_blocks=NUM_BLOCKS, kv_cache_groups=[
        SimpleNamespace(layer_names=["l0"], kv_cache_spec=state),
        SimpleNamespace(layer_names=["l1"], kv_cache_spec=attention)])
    # ranks that replicate a KV head hold the same KV for it, as vLLM's do
    generator = torch.Generator().manual_seed(100 * tp_size + tp_rank // max(1, tp_size // kv_heads))
    attention_cache = torch.randn(NUM_BLOCKS, heads, block_size, 2 * head_size, generator=generator)
    if layout == "LBNHC":
        attention_cache = attention_cache.permute(0, 2, 1, 3).contiguous().permute(0, 2, 1, 3)
    generator = torch.Generator().manual_seed(100 * tp_size + tp_rank)
    state_cache = torch.randn(NUM_BLOCKS, page_bytes // 2, generator=generator).to(torch.bfloat16).view(torch.uint8)
    caches = {"l0": state_cache if fill else torch.zeros_like(state_cache),
              "l1": (attention_cache if fill else torch.zeros_like(attention_cache)).to(torch.bfloat16)}
    kernel = CACHE_LAYOUTS[layout] if layout in ("cpu", "amx") else ""
    spec = spec_from_vllm("tiny", config, ["l0", "l1"], tp_rank, tp_size, kv_heads, cache_layout=CACHE_LAYOUTS[layout])
    worker = PrfaasConnectorWorker(partial(_Wire, 7000 + tp_rank),
                                   WorkerSettings(ReceiveSettings(10.0, 1 << 24), SendSettings(code_sends=code_sends),
                                                  host_ring_bytes=1 << 20, host_ring_slot_bytes=64 << 10),
                                   device_of=device_of)
    worker.register_kv_caches(KVLayout(config, caches, kernel), spec)
    return worker


def _blocks(block_size: int, seed: int) -> list[int]:
    return random.Random(seed).sample(range(1, NUM_BLOCKS), -(-NUM_TOKENS // block_size))


def _prefill(producers, blocks: list[int], consumer_tp: int, chunks=((0, 40), (40, NUM_TOKENS))) -> None:
    """Every producer rank runs the same steps (vLLM schedules once for all ranks)."""
    for start, end in chunks:
        send = SendSpec("r", "t", PEER, ((blocks[-1],), tuple(blocks)), start, end, NUM_TOKENS, consumer_tp)
        for producer in producers:
            producer.on_metadata(PrfaasConnectorMetadata(sends=[send]))
            for layer in ("l0", "l1"):
                producer.save_kv_layer(layer)
            producer.wait_for_save()


def _deliver(producers, consumers, blocks: list[int], shuffle_seed: int = 0):
    """Each consumer rank gets what was addressed to its port, streams interleaved (as several TCP
    connections deliver them), and runs steps; what a rank passes on to its replicas is delivered the
    same way, until nothing more moves. Returns each rank's finished and failed requests."""
    for consumer in consumers:
        consumer.on_metadata(PrfaasConnectorMetadata(recvs=[RecvSpec("r", "t", ((blocks[-1],), tuple(blocks)),
                                                                     0, NUM_TOKENS)]))
    finished = [set() for _ in consumers]
    failed = [set() for _ in consumers]
    senders, delivered = list(producers) + list(consumers), {}
    for round_ in range(4):
        for consumer in consumers:
            consumer.consumer.forwarder.wait_idle()  # what a rank passed on in the last round is on its way
        for rank, consumer in enumerate(consumers):
            address = f"127.0.0.1:{7000 + rank}"
            events = [event for sender in senders for i, (peer, event) in enumerate(sender.streams.sent)
                      if peer == address and delivered.setdefault((id(sender), i), rank) == rank
                      and (id(sender), i, "done") not in delivered]
            for sender in senders:
                for i, (peer, _) in enumerate(sender.streams.sent):
                    if peer == address:
                        delivered[(id(sender), i, "done")] = rank
            random.Random(shuffle_seed + 10 * round_ + rank).shuffle(events)
            # a stream's end is reported once all its frames are in (the receiver counts them)
            consumer.streams.pending = sorted(events, key=lambda event: isinstance(event, TransferDone))
            results = consumer.get_transfer_results()
            finished[rank] |= results.finished_recving
            failed[rank] |= results.failed_recving
    return [SimpleNamespace(finished_recving=f, failed_recving=x) for f, x in zip(finished, failed)]


def _heads(worker, blocks: list[int], block_size: int) -> torch.Tensor:
    """K and V of every token on this rank, [tokens, local heads, 2, head_size]."""
    spec = worker.consumer.plans._spec
    view = attention_view(worker.layout.caches["l1"], spec.layers[1], block_size, spec.cache_layout)
    k, v = read_tokens(view, 0, spec.cache_layout), read_tokens(view, 1, spec.cache_layout)
    return torch.stack([torch.stack([k[blocks[t // block_size], :, t % block_size],
                                     v[blocks[t // block_size], :, t % block_size]], dim=1) for t in range(NUM_TOKENS)])


def _state(worker, block: int) -> dict[str, torch.Tensor]:
    """This rank's share of each conv component ([state_len, channels]) and of the temporal state."""
    spec = worker.consumer.plans._spec.layers[0]
    page = state_page(worker.layout.caches["l0"], block)
    conv = conv_state_view(page, spec)
    parts = {part.name: conv[:, spec.conv_offsets[part.name]:spec.conv_offsets[part.name] + part.local_size]
             for part in spec.conv}
    return {**parts, "ssm": temporal_state_view(page, spec)}


def _distinct(per_rank: list, dim: int, units: int):
    """The ranks' shares side by side, each replicated share once (with more ranks than ``units``,
    vLLM gives consecutive ranks the same unit)."""
    if len(per_rank) > units:
        per_rank = per_rank[::len(per_rank) // units]
    return torch.cat(per_rank, dim=dim)


@pytest.mark.parametrize("src_tp, dst_tp, src_block, dst_block", [(1, 2, 32, 32), (2, 1, 32, 32), (1, 2, 16, 32),
                                                                   (2, 1, 64, 32), (2, 2, 16, 32), (1, 4, 32, 32),
                                                                   (2, 4, 16, 32), (4, 1, 32, 32), (4, 2, 32, 16)])
def test_each_consumer_rank_gets_exactly_the_heads_it_owns(src_tp, dst_tp, src_block, dst_block, layout="cpu",
                                                          dst_layout=None, head_size=HEAD_SIZE):
    producers = [_rank(src_tp, r, src_block, fill=True, layout=layout, head_size=head_size) for r in range(src_tp)]
    consumers = [_rank(dst_tp, r, dst_block, fill=False, layout=dst_layout or layout, head_size=head_size)
                 for r in range(dst_tp)]
    src_blocks, dst_blocks = _blocks(src_block, 1), _blocks(dst_block, 2)
    _prefill(producers, src_blocks, dst_tp)
    results = _deliver(producers, consumers, dst_blocks)
    assert all(r.finished_recving == {"r"} and r.failed_recving == set() for r in results), results

    sent_heads = _distinct([_heads(p, src_blocks, src_block) for p in producers], dim=1, units=HEADS)
    got_heads = _distinct([_heads(c, dst_blocks, dst_block) for c in consumers], dim=1, units=HEADS)
    assert torch.equal(got_heads, sent_heads)
    sent_states = [_state(p, src_blocks[-1]) for p in producers]
    got_states = [_state(c, dst_blocks[-1]) for c in consumers]
    if dst_tp > HEADS:  # every replica holds its heads, as the rank that received them does
        for rank in range(dst_tp):
            assert torch.equal(_heads(consumers[rank], dst_blocks, dst_block),
                               _heads(consumers[rank ^ 1], dst_blocks, dst_block))
    for part in ("query_key", "key", "value", "ssm"):
        dim = 0 if part == "ssm" else 1
        got, sent = (_distinct([state[part] for state in states], dim, K_HEADS) for states in (got_states, sent_states))
        assert torch.equal(got, sent), part


@pytest.mark.parametrize("layout", ["LBNHC", "LBHNC"])
@pytest.mark.parametrize("src_tp, dst_tp, src_block, dst_block", [(1, 2, 32, 32), (2, 1, 16, 32), (2, 2, 16, 32),
                                                                   (1, 4, 32, 32)])
def test_gpu_backend_layouts_slice_and_re_block_the_same_way(src_tp, dst_tp, src_block, dst_block, layout):
    """vLLM 0.32's GPU attention caches (each token's K then V, token-major or head-major strides),
    as CPU tensors of the same shapes and strides: head slicing and re-blocking read them through a
    strided view (``TOKEN_ROWS``), and every rank still gets exactly its heads."""
    test_each_consumer_rank_gets_exactly_the_heads_it_owns(src_tp, dst_tp, src_block, dst_block, layout)
    rank = _rank(1, 0, 32, fill=True, layout=layout)
    assert rank.layout.physical["l1"].name == layout and rank.consumer.plans._spec.cache_layout == TOKEN_ROWS


@pytest.mark.parametrize("src_layout, dst_layout", [("amx", "amx"), ("amx", "cpu"), ("cpu", "amx"), ("amx", "LBNHC")])
@pytest.mark.parametrize("src_tp, dst_tp, src_block, dst_block", [(1, 1, 32, 32), (1, 2, 32, 32), (2, 1, 64, 32),
                                                                   (1, 1, 32, 64), (4, 2, 32, 16)])
def test_amx_and_other_kernels_exchange_kv_through_a_conversion(src_tp, dst_tp, src_block, dst_block, src_layout,
                                                               dst_layout):
    """vLLM's amx kernel packs a block's K and V for AMX tiles in one cache shape with the vec kernel's:
    the fingerprints differ by the kernel (so pages are never copied as they are between the two, even
    at equal TP and block sizes), and the consumer converts, re-blocks and slices group by group."""
    if src_layout != dst_layout and (src_tp, dst_tp, src_block, dst_block) == (1, 1, 32, 32):
        assert _rank(1, 0, 32, True, layout=src_layout, head_size=16).layout.fingerprint != \
            _rank(1, 0, 32, True, layout=dst_layout, head_size=16).layout.fingerprint
    test_each_consumer_rank_gets_exactly_the_heads_it_owns(src_tp, dst_tp, src_block, dst_block, src_layout,
                                                          dst_layout, head_size=16)


def test_a_contiguous_slice_of_the_conv_state_is_not_what_a_rank_receives():
    """The test above can fail: at TP 1 -> 2 the first half of the whole conv dim is not rank 0's share."""
    producer = _rank(1, 0, 32, fill=True)
    blocks = _blocks(32, 1)
    conv = conv_state_view(state_page(producer.layout.caches["l0"], blocks[-1]),
                           producer.consumer.plans._spec.layers[0])
    consumers = [_rank(2, r, 32, fill=False) for r in range(2)]
    _prefill([producer], blocks, 2)
    _deliver([producer], consumers, blocks)
    received = conv_state_view(state_page(consumers[0].layout.caches["l0"], blocks[-1]),
                               consumers[0].consumer.plans._spec.layers[0])
    assert not torch.equal(received, conv[:, :conv.shape[1] // 2])


def _attention_bytes_sent(consumer_tp: int) -> dict[str, int]:
    """Attention KV bytes a TP 1 producer sends each consumer rank's address for one prompt."""
    producer = _rank(1, 0, 32, fill=True)
    _prefill([producer], _blocks(32, 1), consumer_tp)
    sizes: dict[str, int] = {}
    for peer, event in producer.streams.sent:
        if isinstance(event, Frame) and event.kind == protocol.DATA and event.group == 1:
            sizes[peer] = sizes.get(peer, 0) + len(event.payload)
    return sizes


def test_each_head_crosses_the_link_once():
    """TP 1 -> 2: the producer sends each consumer rank half the attention bytes, not all of them."""
    sizes = _attention_bytes_sent(2)
    whole = NUM_TOKENS // 32 * 32 + 32  # blocks holding the prompt's tokens
    assert sizes == {"127.0.0.1:7000": whole * HEADS // 2 * 2 * HEAD_SIZE * 2,
                     "127.0.0.1:7001": whole * HEADS // 2 * 2 * HEAD_SIZE * 2}


def test_the_transfer_completes_only_when_every_producer_rank_has_finished():
    producers = [_rank(2, r, 32, fill=True) for r in range(2)]
    consumer = _rank(1, 0, 32, fill=False)
    blocks = _blocks(32, 1)
    _prefill(producers, blocks, 1)
    consumer.on_metadata(PrfaasConnectorMetadata(recvs=[RecvSpec("r", "t", ((blocks[-1],), tuple(blocks)),
                                                                 0, NUM_TOKENS)]))
    consumer.streams.pending = [event for _, event in producers[0].streams.sent]
    assert consumer.get_transfer_results().finished_recving == set()  # rank 1's stream is still missing
    consumer.streams.pending = [event for _, event in producers[1].streams.sent]
    assert consumer.get_transfer_results().finished_recving == {"r"}


def test_routes_address_each_consumer_rank_at_its_port_and_name_each_producer_rank():
    from services.kv_connector.layouts.tp_routes import plan_routes, rank_peer, transfer_of, wire_id

    producer = _rank(2, 1, 32, fill=False).producer._spec
    routes, problem = plan_routes(producer, 1)
    assert problem is None and [route.dst_rank for route in routes] == [0]
    assert rank_peer("10.0.0.1:7000", 0) == "10.0.0.1:7000" and rank_peer("10.0.0.1:7000", 3) == "10.0.0.1:7003"
    assert wire_id("cmpl-1", producer) == "cmpl-1#p1" and transfer_of("cmpl-1#p1") == "cmpl-1"
    assert wire_id("cmpl-1", _rank(1, 0, 32, fill=False).producer._spec) == "cmpl-1"


def test_replicated_heads_cross_the_link_once():
    """TP 1 -> 4 replicates the 2 KV heads (and GDN heads): the producer sends each unit to one of its
    holders, which passes it on to the other over loopback."""
    sizes = _attention_bytes_sent(4)
    whole = NUM_TOKENS // 32 * 32 + 32
    assert sum(sizes.values()) == whole * HEADS * 2 * HEAD_SIZE * 2  # all heads, once


def _attention_only(tp_size: int, tp_rank: int, kv_heads: int):
    """The layout and announcement of one rank of an engine with one full-attention layer."""
    from services.kv_connector.layouts.reblock import announcement

    attention = SimpleNamespace(block_size=32, num_kv_heads=max(1, kv_heads // tp_size), head_size=HEAD_SIZE,
                                dtype=torch.bfloat16)
    group = SimpleNamespace(layer_names=["l"], kv_cache_spec=attention)
    config = SimpleNamespace(num_blocks=4, kv_cache_groups=[group])
    caches = {"l": torch.zeros(4, attention.num_kv_heads, 32, 2 * HEAD_SIZE, dtype=torch.bfloat16)}
    layout = KVLayout(config, caches)
    spec = spec_from_vllm("tiny", config, ["l"], tp_rank, tp_size, kv_heads, cache_layout=CPU_K_TRANSPOSED)
    return layout, spec, announcement(layout.fingerprint, spec)


def test_one_kv_head_on_every_rank_is_mapped_though_the_ranks_pages_look_alike():
    """With one KV head each rank's pages have the same shape at TP 1 and TP 2, so the fingerprints
    agree; the TP sizes do not (regression: the consumer took the producer's frames as whole pages,
    passed nothing on, and the sibling rank kept zeros for the layers it replicates)."""
    from services.kv_connector.layouts.reblock import ReblockPlans

    _, _, producer = _attention_only(1, 0, kv_heads=1)
    layout, spec, _ = _attention_only(2, 0, kv_heads=1)
    assert layout.fingerprint == _attention_only(1, 0, kv_heads=1)[0].fingerprint
    plan = ReblockPlans(layout, spec).plan(producer)
    assert plan is not None and not isinstance(plan, str), plan
    assert plan.sources == ((0, None),) and plan.replicas == (1,)  # rank 0 receives the head, passes it to 1
    assert ReblockPlans(layout, spec).plan(_attention_only(2, 0, kv_heads=1)[2]) is None  # same TP: pages as they are


def _fed_consumers(producer, blocks: list[int]):
    """TP 4 consumer ranks, with the producer's frames to rank 1 waiting in its receiver: rank 1 receives
    KV head 0 and passes it on to rank 0, which replicates it."""
    consumers = [_rank(4, r, 32, fill=False) for r in range(4)]
    for consumer in consumers:
        consumer.on_metadata(PrfaasConnectorMetadata(recvs=[RecvSpec("r", "t", ((blocks[-1],), tuple(blocks)),
                                                                     0, NUM_TOKENS)]))
    consumers[1].streams.pending = [event for peer, event in producer.streams.sent if peer == "127.0.0.1:7001"]
    return consumers


def test_a_rank_passing_kv_on_does_not_wait_for_its_siblings_in_its_step():
    """A sibling empties its receiver only in its next engine step, which vLLM starts once every rank
    finished this one: a rank that waited in its step for room at a sibling would hang the engine
    (regression: TP 1 -> 4 hung 30 s and recomputed). Its step returns while the sends wait; they go
    on, in order, once the sibling takes frames again."""
    import threading

    producer = _rank(1, 0, 32, fill=True)
    blocks = _blocks(32, 1)
    _prefill([producer], blocks, 4)
    consumers = _fed_consumers(producer, blocks)
    room = threading.Event()
    wire = consumers[1].streams
    sends = {name: getattr(wire, name) for name in ("send", "send_layout", "finish")}

    def waiting(name):
        def send(*args):
            assert room.wait(10.0), "the test never made room"
            sends[name](*args)
        return send

    for name in sends:
        setattr(wire, name, waiting(name))
    assert consumers[1].get_transfer_results().finished_recving == {"r"}  # its own share is in
    assert wire.sent == []
    room.set()
    consumers[1].consumer.forwarder.wait_idle()
    passed_on = [event for peer, event in wire.sent if peer == "127.0.0.1:7000"]
    assert passed_on[0].is_layout and isinstance(passed_on[-1], TransferDone)
    assert len(passed_on) > 2 and {event.transfer_id for event in passed_on} == {"t#f1"}


def test_a_transfer_that_fails_on_the_receiving_rank_fails_on_its_replicas_at_once():
    """The rank passing KV on aborts the streams it passes on when its own transfer fails, so its
    replicas fail it too instead of waiting idle_timeout_s for an end that never comes."""
    producer = _rank(1, 0, 32, fill=True)
    blocks = _blocks(32, 1)
    _prefill([producer], blocks, 4)
    consumers = _fed_consumers(producer, blocks)
    frames = consumers[1].streams.pending
    last_data = max(i for i, event in enumerate(frames) if isinstance(event, Frame) and not event.is_layout)
    bad = frames[last_data]
    frames[last_data] = Frame(bad.transfer_id, bad.layer, bad.group, bad.block_start, bad.num_blocks,
                              memoryview(bytes(len(bad.payload) - 2)))  # a frame of the wrong size
    assert consumers[1].get_transfer_results().failed_recving == {"r"}
    consumers[1].consumer.forwarder.wait_idle()
    consumers[0].streams.pending = [event for peer, event in consumers[1].streams.sent if peer == "127.0.0.1:7000"]
    assert isinstance(consumers[0].streams.pending[-1], TransferFailed)
    assert consumers[0].get_transfer_results().failed_recving == {"r"}


@pytest.mark.parametrize("src_tp, dst_tp, src_block, dst_block, layout, codec", [
    (1, 1, 32, 32, "LBNHC", codecs.NONE),   # same TP: whole pages, the loader's batches
    (1, 1, 32, 32, "LBHNC", codecs.FP8),    # coded frames, decoded into ordinary memory
    (1, 2, 32, 32, "LBNHC", codecs.NONE),   # sliced sends, sliced receives
    (2, 1, 32, 32, "LBHNC", codecs.INT8),
    (1, 1, 16, 32, "LBNHC", codecs.NONE),   # re-blocked receives
    (2, 2, 16, 32, "cpu", codecs.FP8),
])
def test_no_engine_thread_call_of_the_core_synchronizes_the_gpu(src_tp, dst_tp, src_block, dst_block, layout, codec,
                                                                monkeypatch):
    """Every send and receive path driven through its CUDA branches on a CPU stand-in that records
    what would make the engine thread wait for the GPU (tests/support/sync_recorder.py); the KV must
    still arrive exactly (within the codec's rounding)."""
    monkeypatch.setattr(_Wire, "codec", codec)
    with recording_syncs() as (device_of, recorder):
        producers = [_rank(src_tp, r, src_block, fill=True, layout=layout, device_of=device_of, code_sends=True)
                     for r in range(src_tp)]
        consumers = [_rank(dst_tp, r, dst_block, fill=False, layout=layout, device_of=device_of)
                     for r in range(dst_tp)]
        for rank in producers + consumers:
            mark_caches(recorder, rank.layout.caches.values())
        src_blocks, dst_blocks = _blocks(src_block, 1), _blocks(dst_block, 2)
        _prefill(producers, src_blocks, dst_tp)
        for producer in producers:
            producer.flush()  # the sender threads hand every copy on (off the engine thread)
        results = _deliver(producers, consumers, dst_blocks)
        calls = list(recorder.calls)
    assert all(r.finished_recving == {"r"} and r.failed_recving == set() for r in results), results
    assert calls == [], "\n".join(calls)
    sent = _distinct([_heads(p, src_blocks, src_block) for p in producers], dim=1, units=HEADS)
    got = _distinct([_heads(c, dst_blocks, dst_block) for c in consumers], dim=1, units=HEADS)
    if codec == codecs.NONE:
        assert torch.equal(got, sent)
    else:
        assert torch.allclose(got.float(), sent.float(), rtol=0.15, atol=0.1)
    for rank in producers + consumers:
        rank.shutdown()
