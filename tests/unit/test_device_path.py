"""The device data path on CPU: the pinned ring's slot accounting, the layer saver's sender thread
and the block loader's completion accounting, with events that complete only when a test says so
(a CUDA copy still running)."""
from __future__ import annotations

import threading

import pytest
import torch

from services.kv_connector.device.consumer import BlockLoader
from services.kv_connector.device.producer import LayerSaver
from services.kv_connector.device.ring import HostRing
from services.kv_connector.device.streams import Device

CPU = Device("cpu")


class PendingEvent:
    """An event of a copy still running, until ``complete``."""

    def __init__(self) -> None:
        self.done = False

    def record(self, stream=None) -> None:
        pass

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        pass

    def complete(self) -> None:
        self.done = True


def test_a_slot_is_not_handed_out_before_its_done_event():
    ring = HostRing(CPU, 64, 1)
    slot, copy = ring.acquire(), PendingEvent()
    ring.release(slot, copy)
    got: list = []
    taker = threading.Thread(target=lambda: got.append(ring.acquire()))
    taker.start()
    taker.join(0.05)
    assert got == [] and taker.is_alive()
    copy.complete()
    taker.join(5.0)
    assert got == [slot] and ring.num_waits == 1


def test_a_full_ring_waits_counts_the_wait_and_never_allocates():
    ring = HostRing(CPU, 64, 2)
    held = [ring.acquire(), ring.acquire()]
    assert ring.num_waits == 0 and ring.num_free == 0
    threading.Timer(0.05, ring.release, (held[0],)).start()
    assert ring.acquire() is held[0]
    assert ring.num_waits == 1 and ring.num_bytes == 128


def test_a_failed_gather_gives_its_slot_back():
    ring = HostRing(CPU, 1024, 1)
    saver = LayerSaver(CPU, ring)
    cache = torch.zeros(4, 2, 4, 8)
    with pytest.raises(IndexError):
        saver.save(cache, 0, [99], lambda *args: None)
    assert ring.num_free == 1


def test_a_failed_delivery_gives_its_slot_back_and_is_counted():
    ring = HostRing(CPU, 1024, 1)
    saver = LayerSaver(CPU, ring, threaded=True)

    def broken(first, count, payload, release):
        raise OSError("peer gone")
    saver.save(torch.zeros(4, 2, 4, 8), 0, [1], broken)
    saver.flush()
    assert (saver.num_failed, ring.num_free) == (1, 1)
    saver.close()


def test_the_sender_thread_delivers_slot_sized_chunks_in_order_then_runs_what_follows():
    cache = torch.randn(32, 2, 4, 8)
    block_bytes = cache[0].numel() * cache.element_size()
    ring = HostRing(CPU, 3 * block_bytes, 2)  # three blocks a slot, two slots: the saver waits for the sender
    saver = LayerSaver(CPU, ring, threaded=True)
    got: list = []

    def deliver(first, count, payload, release):
        got.append((first, count, bytes(payload)))
        release()
        release()  # a second call is harmless
    ids = [5, 1, 9, 30, 2, 7, 11, 0]
    saver.save(cache, 0, ids, deliver)
    saver.then(lambda: got.append("end"))
    saver.flush()
    assert [g[:2] for g in got[:-1]] == [(0, 3), (3, 3), (6, 2)] and got[-1] == "end"
    sent = b"".join(g[2] for g in got[:-1])
    assert sent == cache.index_select(0, torch.tensor(ids)).numpy().tobytes()
    assert ring.num_free == 2
    saver.close()


def test_bytes_cut_out_of_the_cache_go_in_slot_sized_runs_of_blocks():
    """The sends to a consumer of another TP size: the saver runs the cut (a head slice of each
    block, pieces back to back) on its side stream, per run of blocks that fits a slot."""
    cache = torch.randn(16, 4, 2, 8)  # [blocks, heads, ...]

    def heads(ids):  # two head ranges of the blocks, one after the other, as tp_routes pieces are sent
        index = torch.tensor(list(ids))
        return torch.cat([cache[:, 0:1].index_select(0, index).reshape(-1),
                          cache[:, 3:4].index_select(0, index).reshape(-1)])

    block_bytes = 2 * cache[0, 0].numel() * cache.element_size()
    ring = HostRing(CPU, 2 * block_bytes + 3, 2)
    saver = LayerSaver(CPU, ring, threaded=True)
    got: list = []

    def deliver(first, count, payload, release):
        got.append((first, count, bytes(payload)))
        release()
    ids = [3, 8, 1, 12, 5]
    saver.save_made(heads, block_bytes, ids, deliver)
    saver.flush()
    assert [g[:2] for g in got] == [(0, 2), (2, 2), (4, 1)]
    for first, count, payload in got:
        assert payload == heads(ids[first:first + count]).view(torch.uint8).numpy().tobytes()
    assert ring.num_free == 2
    got.clear()
    saver.save_made(heads, block_bytes, ids, deliver, max_run_bytes=block_bytes + 1)  # one frame's worth
    saver.flush()
    assert [g[:2] for g in got] == [(i, 1) for i in range(len(ids))]
    with pytest.raises(ValueError, match="does not fit"):
        saver.save_made(heads, ring.slot_bytes + 1, ids, deliver)
    saver.close()


def test_a_slot_is_reused_only_once_the_transport_released_it():
    ring = HostRing(CPU, 4096, 1)
    saver = LayerSaver(CPU, ring)
    releases: list = []
    saver.save(torch.zeros(4, 2, 4, 8), 0, [1], lambda first, count, payload, release: releases.append(release))
    assert ring.num_free == 0
    releases[0]()
    assert ring.num_free == 1


def test_received_blocks_land_where_the_request_wants_them():
    source = torch.randn(8, 2, 4, 8)
    payload = memoryview(source[[1, 2, 3]].numpy().tobytes())
    cache = torch.zeros(16, 2, 4, 8)
    loader = BlockLoader(CPU, 1024)
    loader.write("r", cache, 0, payload, [0, 2], [10, 12])  # the middle block is not wanted
    assert torch.equal(cache[10], source[1]) and torch.equal(cache[12], source[3])
    assert cache[11].abs().sum() == 0
    assert not loader.busy("r")


def test_a_request_is_received_only_once_all_its_copies_completed():
    loader = BlockLoader(CPU, 1024)
    copies = [PendingEvent(), PendingEvent()]
    loader._pending["r"] = [(copies[0], None), (copies[1], None)]  # two copies in flight on the side stream
    assert loader.poll() == set() and loader.busy("r")
    copies[0].complete()
    assert loader.poll() == set() and loader.busy("r")
    copies[1].complete()
    assert loader.poll() == {"r"} and not loader.busy("r")
    assert loader.poll() == set()


def test_a_leased_frame_gives_its_slot_back_once_nothing_references_it():
    ring = HostRing(CPU, 64, 1)
    frame = ring.lease(48)
    assert frame is not None and len(frame) == 48 and ring.num_free == 0
    assert ring.lease(8) is None and ring.lease(65) is None  # none free; too big: the caller uses ordinary memory
    assert ring.holds(torch.frombuffer(frame, dtype=torch.uint8).data_ptr())
    part = frame[8:16]
    del frame
    assert ring.num_free == 0  # a view of it still reads the slot
    del part
    assert ring.num_free == 1


def test_the_transport_reads_frames_into_the_loaders_memory():
    loader = BlockLoader(CPU, 1024, HostRing(CPU, 256, 2))
    pinned, too_big = loader.allocate(200), loader.allocate(300)
    assert loader.receive_ring.holds(torch.frombuffer(pinned, dtype=torch.uint8).data_ptr())
    assert not loader.receive_ring.holds(torch.frombuffer(too_big, dtype=torch.uint8).data_ptr())


def test_frames_received_into_the_ring_are_copied_in_by_layer_in_batches():
    layers = [torch.randn(16, 2, 4, 8) for _ in range(2)]
    targets = [torch.zeros_like(layer) for layer in layers]
    block_bytes = layers[0][0].numel() * 4
    loader = BlockLoader(CPU, 3 * block_bytes, HostRing(CPU, 2 * block_bytes, 8))
    frames = []
    for first in range(0, 8, 2):  # two blocks a frame, layers interleaved as connections deliver them
        for layer, source in enumerate(layers):
            frame = loader.allocate(2 * block_bytes)
            frame[:] = source[first:first + 2].numpy().tobytes()
            frames.append((layer, first, frame))
    destination = [15, 3, 9, 1, 12, 7, 5, 10]
    for layer, first, frame in frames:
        loader.write("r", targets[layer], 0, frame, [0, 1], destination[first:first + 2])
    assert loader.busy("r")  # gathered, not copied yet
    del frames, frame
    assert loader.poll() == {"r"} and not loader.busy("r")
    for source, target in zip(layers, targets):
        assert torch.equal(target[destination], source[:8])
    assert loader.receive_ring.num_free == 8  # every frame's slot came back once copied
