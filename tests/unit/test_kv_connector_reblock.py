"""Re-blocking on the consumer (issue 19): a producer engine with one block size streams a request's
KV to a consumer with another, through the connector's worker layer on both sides, and every token's
K and V, and the linear-attention state, land where the consumer's engine reads them.

The transport between the two workers is a list of frames (this tests the worker layer alone); real
engines with different block sizes are covered by tests/e2e/test_hetero_block_sizes.py.
"""
from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch

from services.kv_connector.layouts.pages import KVLayout
from services.kv_connector.layouts.apply import (attention_view, conv_state_view, state_page, temporal_state_view,
                                                token_view)
from services.kv_connector.layouts.spec import CPU_K_TRANSPOSED
from services.kv_connector.layouts.from_vllm import spec_from_vllm
from services.kv_connector.metadata import PrfaasConnectorMetadata, RecvSpec, SendSpec
from services.kv_connector.consumer import ReceiveSettings
from services.kv_connector.worker import PrfaasConnectorWorker, WorkerSettings
from services.kv_transport import Frame, TransferDone, protocol
from support.wire import FRAME_BYTES, parts_on_the_wire

NUM_BLOCKS, HEADS, HEAD_SIZE = 24, 2, 8
K_HEADS, K_DIM, V_HEADS, V_DIM, STATE_LEN = 2, 4, 2, 4, 3
CONV_DIM = 2 * K_HEADS * K_DIM + V_HEADS * V_DIM
NUM_TOKENS = 100


class _Wire:
    """Stands in for KVTransport on both sides: the producer's sends become frames, which the
    consumer's ``poll`` hands out."""

    def __init__(self, frame_bytes: int = 0) -> None:
        self.frames: list = []
        self.pending: list = []
        self.receive_frame_bytes = frame_bytes  # what its receiver would announce

    def frame_bytes(self, peer: str) -> int:
        return FRAME_BYTES

    def send_layout(self, peer: str, transfer_id: str, payload: bytes) -> None:
        self.frames.append(Frame(transfer_id, 0, 0, 0, 0, memoryview(bytes(payload)), protocol.LAYOUT))

    def send(self, peer, transfer_id, layer, group, block_start, num_blocks, payload, on_sent=None,
             coding=None, divisible=False) -> None:
        for start, count, part in parts_on_the_wire(block_start, num_blocks, payload, divisible):
            self.frames.append(Frame(transfer_id, layer, group, start, count, memoryview(bytes(part))))
        if on_sent is not None:  # the payload was copied: its memory may be reused
            on_sent()

    def finish(self, peer: str, transfer_id: str) -> None:
        self.frames.append(TransferDone(transfer_id))

    def poll(self, wait_s: float) -> list:
        events, self.pending = self.pending, []
        return events

    def forget(self, transfer_id: str) -> None:
        pass


def _engine(block_size: int, page_bytes: int, fill: bool, cache_layout: str = CPU_K_TRANSPOSED):
    """A tiny hybrid engine: a Gated-DeltaNet layer (group 0) and a full-attention layer (group 1),
    caches in vLLM's CPU layout; returns its KVLayout and LayoutSpec."""
    state = SimpleNamespace(block_size=block_size, shapes=((STATE_LEN, CONV_DIM), (V_HEADS, V_DIM, K_DIM)),
                            mamba_type="gdn_attn", dtypes=(torch.bfloat16, torch.bfloat16), page_size_bytes=page_bytes)
    attention = SimpleNamespace(block_size=block_size, num_kv_heads=HEADS, head_size=HEAD_SIZE, dtype=torch.bfloat16)
    config = SimpleNamespace(num_blocks=NUM_BLOCKS, kv_cache_groups=[
        SimpleNamespace(layer_names=["l0"], kv_cache_spec=state),
        SimpleNamespace(layer_names=["l1"], kv_cache_spec=attention)])
    generator = torch.Generator().manual_seed(block_size)
    attention_cache = torch.randn(NUM_BLOCKS, HEADS, block_size, 2 * HEAD_SIZE, generator=generator)
    state_cache = torch.randint(0, 255, (NUM_BLOCKS, page_bytes), generator=generator, dtype=torch.uint8)
    caches = {"l0": state_cache if fill else torch.zeros_like(state_cache),
              "l1": (attention_cache if fill else torch.zeros_like(attention_cache)).to(torch.bfloat16)}
    spec = spec_from_vllm("tiny", config, ["l0", "l1"], 0, 1, HEADS, cache_layout=cache_layout)
    return KVLayout(config, caches), spec


def _worker(block_size: int, page_bytes: int, fill: bool, cache_layout: str = CPU_K_TRANSPOSED, announce: bool = True):
    worker = PrfaasConnectorWorker(_Wire, WorkerSettings(ReceiveSettings(10.0, 1 << 24)))
    layout, spec = _engine(block_size, page_bytes, fill, cache_layout)
    worker.register_kv_caches(layout, spec if announce else None)
    return worker


def _blocks(num_tokens: int, block_size: int, seed: int) -> list[int]:
    return random.Random(seed).sample(range(1, NUM_BLOCKS), -(-num_tokens // block_size))


def _stream(producer, src_blocks: list[int], chunks: list[tuple[int, int]]) -> list:
    """The frames of one request prefilled in ``chunks`` of tokens, layer by layer."""
    for start, end in chunks:
        send = SendSpec("r", "t", "peer", ((src_blocks[-1],), tuple(src_blocks)), start, end, NUM_TOKENS)
        producer.on_metadata(PrfaasConnectorMetadata(sends=[send]))
        for layer in ("l0", "l1"):
            producer.save_kv_layer(layer)
        producer.wait_for_save()
    return producer.streams.frames


def _receive(consumer, frames: list, dst_blocks: list[int], first_token: int = 0):
    consumer.on_metadata(PrfaasConnectorMetadata(recvs=[RecvSpec("r", "t", ((dst_blocks[-1],), tuple(dst_blocks)),
                                                                 first_token, NUM_TOKENS)]))
    consumer.streams.pending = list(frames)
    return consumer.get_transfer_results()


def _tokens(worker, blocks: list[int], block_size: int) -> torch.Tensor:
    """K and V of every token of the request, [tokens, heads, 2, head_size]."""
    spec = worker.consumer.plans._spec.layers[1]
    view = attention_view(worker.layout.caches["l1"], spec, block_size)
    k, v = token_view(view, 0), token_view(view, 1)
    return torch.stack([torch.stack([k[blocks[t // block_size], :, t % block_size],
                                     v[blocks[t // block_size], :, t % block_size]], dim=1) for t in range(NUM_TOKENS)])


def _state(worker, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    spec = worker.consumer.plans._spec.layers[0]
    page = state_page(worker.layout.caches["l0"], block)
    return conv_state_view(page, spec), temporal_state_view(page, spec)


@pytest.mark.parametrize("src_size, dst_size, src_page, dst_page", [(16, 32, 256, 512), (64, 32, 2048, 1024),
                                                                     (32, 48, 256, 256)])
def test_kv_from_a_producer_of_another_block_size_lands_token_by_token(src_size, dst_size, src_page, dst_page):
    producer = _worker(src_size, src_page, fill=True)
    consumer = _worker(dst_size, dst_page, fill=False)
    src_blocks, dst_blocks = _blocks(NUM_TOKENS, src_size, 1), _blocks(NUM_TOKENS, dst_size, 2)
    frames = _stream(producer, src_blocks, [(0, 40), (40, NUM_TOKENS)])
    assert frames[0].kind == protocol.LAYOUT  # announced before any KV
    # Frames travel on several connections: KV may overtake the layout, and is staged until it comes.
    results = _receive(consumer, frames[1:] + frames[:1], dst_blocks)
    assert results.finished_recving == {"r"} and results.failed_recving == set()
    assert torch.equal(_tokens(consumer, dst_blocks, dst_size), _tokens(producer, src_blocks, src_size))
    for ours, theirs in zip(_state(consumer, dst_blocks[-1]), _state(producer, src_blocks[-1])):
        assert torch.equal(ours, theirs)


def test_tokens_the_consumer_has_cached_are_not_written():
    producer, consumer = _worker(16, 256, fill=True), _worker(32, 512, fill=False)
    src_blocks, dst_blocks = _blocks(NUM_TOKENS, 16, 1), _blocks(NUM_TOKENS, 32, 2)
    results = _receive(consumer, _stream(producer, src_blocks, [(0, NUM_TOKENS)]), dst_blocks, first_token=64)
    assert results.finished_recving == {"r"} and results.failed_recving == set()
    received, sent = _tokens(consumer, dst_blocks, 32), _tokens(producer, src_blocks, 16)
    assert not received[:64].any() and torch.equal(received[64:], sent[64:])


def test_identical_layouts_copy_pages_as_they_are():
    producer, consumer = _worker(32, 256, fill=True), _worker(32, 256, fill=False)
    src_blocks, dst_blocks = _blocks(NUM_TOKENS, 32, 1), _blocks(NUM_TOKENS, 32, 2)
    results = _receive(consumer, _stream(producer, src_blocks, [(0, NUM_TOKENS)]), dst_blocks)
    assert results.finished_recving == {"r"} and results.failed_recving == set()
    assert consumer.consumer.plans.plan(bytes(producer.streams.frames[0].payload)) is None
    assert torch.equal(_tokens(consumer, dst_blocks, 32), _tokens(producer, src_blocks, 32))


@pytest.mark.parametrize("producer_kwargs, consumer_kwargs, reason", [
    ({"announce": False}, {}, "the producer announced no layout spec"),
    ({}, {"announce": False}, "this engine announced no layout spec"),
    ({"cache_layout": ""}, {}, "need re-blocking, which needs both attention caches in layouts this connector maps"),
])
def test_a_layout_the_consumer_cannot_re_block_fails_the_transfer_and_writes_nothing(producer_kwargs,
                                                                                      consumer_kwargs, reason, caplog):
    producer = _worker(16, 256, fill=True, **producer_kwargs)
    consumer = _worker(32, 512, fill=False, **consumer_kwargs)
    results = _receive(consumer, _stream(producer, _blocks(NUM_TOKENS, 16, 1), [(0, NUM_TOKENS)]),
                       _blocks(NUM_TOKENS, 32, 2))
    assert results.failed_recving == {"r"}
    assert "KV layout mismatch" in caplog.text and reason in caplog.text
    assert not consumer.layout.caches["l1"].any() and not consumer.layout.caches["l0"].any()


@pytest.mark.parametrize("block_start, num_blocks", [(0, 0), (NUM_TOKENS, 1)])
def test_a_frame_outside_the_request_fails_the_transfer_and_writes_nothing(block_start, num_blocks, caplog):
    """A peer's frame with no blocks, or past the request's last block, is refused with the reason
    (an empty payload would otherwise reach torch.frombuffer, which raises in the engine's step)."""
    producer, consumer = _worker(16, 256, fill=True), _worker(32, 512, fill=False)
    frames = _stream(producer, _blocks(NUM_TOKENS, 16, 1), [(0, NUM_TOKENS)])
    attention = next(f for f in frames if getattr(f, "kind", None) == protocol.DATA and f.group == 1)
    bad = Frame("t", attention.layer, 1, block_start, num_blocks,
                memoryview(bytes(len(attention.payload) // attention.num_blocks * num_blocks)))
    results = _receive(consumer, [frames[0], bad, TransferDone("t")], _blocks(NUM_TOKENS, 32, 2))
    assert results.failed_recving == {"r"} and "frame outside the request's blocks" in caplog.text
    assert not consumer.layout.caches["l1"].any()
