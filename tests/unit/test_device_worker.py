"""The connector's worker on the device data path, on CPU: a layer split over several ring slots,
delivered by the saver's sender thread, arrives whole and before its transfer's end."""
from __future__ import annotations

import random
import threading
from types import SimpleNamespace

import torch

from services.kv_connector.consumer import ReceiveSettings
from services.kv_connector.device.producer import LayerSaver
from services.kv_connector.layouts.pages import KVLayout
from services.kv_connector.metadata import PrfaasConnectorMetadata, RecvSpec, SendSpec
from services.kv_connector.worker import PrfaasConnectorWorker, WorkerSettings
from services.kv_transport import Frame, TransferDone, protocol
from support.wire import FRAME_BYTES

BLOCKS, HEADS, TOKENS, HEAD = 64, 2, 16, 8
NUM_TOKENS = 300


class _Wire:
    """Stands in for KVTransport: records frames; a payload is copied, then released, as the real
    transport does once it is in the sockets."""

    def __init__(self, frame_bytes: int = 0) -> None:
        self.frames: list = []
        self.threads: set[str] = set()
        self.receive_frame_bytes = frame_bytes  # what its receiver would announce

    def frame_bytes(self, peer: str) -> int:
        return FRAME_BYTES

    def send_layout(self, peer, transfer_id, payload) -> None:
        self.frames.append(Frame(transfer_id, 0, 0, 0, 0, memoryview(bytes(payload)), protocol.LAYOUT))

    def send(self, peer, transfer_id, layer, group, block_start, num_blocks, payload, on_sent=None,
             coding=None, divisible=False) -> None:
        self.threads.add(threading.current_thread().name)
        self.frames.append(Frame(transfer_id, layer, group, block_start, num_blocks, memoryview(bytes(payload))))
        if on_sent is not None:
            on_sent()

    def finish(self, peer, transfer_id) -> None:
        self.frames.append(TransferDone(transfer_id))

    def poll(self, wait_s: float) -> list:
        events, self.frames = self.frames, []
        return events

    def forget(self, transfer_id: str) -> None:
        pass

    def close(self) -> None:
        pass


def _worker(fill: bool, slot_bytes: int) -> PrfaasConnectorWorker:
    spec = SimpleNamespace(block_size=TOKENS, num_kv_heads=HEADS, head_size=HEAD, dtype=torch.bfloat16)
    config = SimpleNamespace(num_blocks=BLOCKS, kv_cache_groups=[
        SimpleNamespace(layer_names=["a", "b"], kv_cache_spec=spec)])
    caches = {name: (torch.randn(BLOCKS, HEADS, TOKENS, 2 * HEAD) if fill else torch.zeros(BLOCKS, HEADS, TOKENS,
                                                                                           2 * HEAD)).bfloat16()
              for name in ("a", "b")}
    worker = PrfaasConnectorWorker(_Wire, WorkerSettings(ReceiveSettings(10.0, 1 << 24), host_ring_bytes=4 * slot_bytes,
                                                         host_ring_slot_bytes=slot_bytes))
    worker.register_kv_caches(KVLayout(config, caches))
    return worker


def test_a_layer_split_over_ring_slots_arrives_whole_and_before_the_end():
    block_bytes = HEADS * TOKENS * 2 * HEAD * 2
    producer, consumer = _worker(True, 3 * block_bytes), _worker(False, 3 * block_bytes)
    producer.producer.saver = LayerSaver(producer.producer.saver.device, producer.producer.saver.ring,
                                         threaded=True)  # the CUDA threading
    src, dst = random.Random(1).sample(range(1, BLOCKS), 19), random.Random(2).sample(range(1, BLOCKS), 19)
    producer.on_metadata(PrfaasConnectorMetadata(sends=[SendSpec("r", "t", "peer", (tuple(src),), 0, NUM_TOKENS,
                                                                 NUM_TOKENS)]))
    for layer in ("a", "b"):
        producer.save_kv_layer(layer)
    producer.wait_for_save()  # queues the end; waits for no copy
    producer.flush()
    frames = producer.streams.frames
    assert producer.streams.threads == {"prfaas-kv-save"}
    assert frames[0].kind == protocol.LAYOUT and isinstance(frames[-1], TransferDone)
    assert sorted(f.num_blocks for f in frames[1:-1]) == [1, 1] + [3] * 12  # 19 blocks a layer, 3 a slot
    consumer.on_metadata(PrfaasConnectorMetadata(recvs=[RecvSpec("r", "t", (tuple(dst),), 0, NUM_TOKENS)]))
    consumer.streams.frames = frames
    assert consumer.get_transfer_results().finished_recving == {"r"}
    for name in ("a", "b"):
        assert torch.equal(consumer.layout.caches[name][dst], producer.layout.caches[name][src])
    assert producer.producer.saver.ring.num_free == 4
    producer.shutdown()
    consumer.shutdown()


class _AbortingWire(_Wire):
    def abort(self, peer, transfer_id, reason) -> None:
        self.frames.append(("abort", transfer_id, reason))


def test_a_send_aborted_mid_prompt_ends_on_the_wire_after_its_queued_copies():
    from services.kv_connector.metadata import SendAbort

    block_bytes = HEADS * TOKENS * 2 * HEAD * 2
    producer = _worker(True, 3 * block_bytes)
    producer.producer.streams = producer.streams = _AbortingWire()
    producer.producer.saver = LayerSaver(producer.producer.saver.device, producer.producer.saver.ring, threaded=True)
    blocks = (tuple(range(1, 20)),)
    producer.on_metadata(PrfaasConnectorMetadata(sends=[SendSpec("r", "t", "peer", blocks, 0, 128, NUM_TOKENS)]))
    for layer in ("a", "b"):
        producer.save_kv_layer(layer)
    producer.wait_for_save()  # a first chunk only: no end queued
    producer.on_metadata(PrfaasConnectorMetadata(aborted_sends=[SendAbort("r", "t", "peer"),
                                                                SendAbort("q", "never-sent", "peer", started=False)]))
    producer.flush()
    frames = producer.streams.frames
    assert frames[-2][:2] == ("abort", "t") and isinstance(frames[-1], TransferDone)
    assert all(isinstance(f, Frame) for f in frames[:-2])  # the copies queued before went first
    assert not any("never-sent" in str(f) for f in frames)
