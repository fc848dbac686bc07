"""The connector's worker core: one engine rank's KV sends, receives and cache-pool traffic, driven by
plain calls (``connector.PrfaasConnector`` translates vLLM's hooks into them; a benchmark or a test
drives the same calls). It imports no vLLM.

Every method runs on the engine thread and none waits for the GPU. ``register_kv_caches`` sets up
the device path once: this rank's transport, whose receiver asks producers for its device's frame
size (``device.receive_frame_bytes``), the saver's pinned ring, on CUDA a ring of frame-sized slots
the transport receives into, and the ``producer`` / ``consumer`` halves over them; the
``pool`` half (``pool.worker.PoolWorker``) when the engine has a cache pool. The order of a step
(vLLM's Model Runner V2): ``on_metadata``, ``save_kv_layer`` after each attention layer, then
``wait_for_save`` and ``get_transfer_results``.
"""
from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

from services.kv_connector.consumer import IDLE_WAIT_S, Consumer, ReceiveSettings, TransferResults
from services.kv_connector.device import DEFAULT_SLOT_BYTES, receive_frame_bytes, receive_ring_bytes, save_ring_bytes
from services.kv_connector.device.consumer import BlockLoader
from services.kv_connector.device.producer import LayerSaver
from services.kv_connector.device.ring import HostRing
from services.kv_connector.device.streams import Device
from services.kv_connector.layouts.pages import KVLayout
from services.kv_connector.layouts.reblock import ReblockPlans
from services.kv_connector.layouts.spec import LayoutSpec
from services.kv_connector.metadata import PrfaasConnectorMetadata
from services.kv_connector.pool.worker import PoolWorker
from services.kv_connector.producer import Producer, SendSettings
from services.kv_connector.snapshot import ConnectorSnapshot, PoolCounters

logger = logging.getLogger(__name__)

__all__ = ["PrfaasConnectorWorker", "TransferResults", "WorkerSettings"]


@dataclass(frozen=True, slots=True)
class WorkerSettings:
    """``host_ring_bytes``: pinned host memory per direction (None: the device's defaults,
    ``device.save_ring_bytes`` / ``receive_ring_bytes``); ``host_ring_slot_bytes``: the saver's
    slots (at least one block or state page of any layer is used)."""
    receive: ReceiveSettings = field(default_factory=ReceiveSettings)
    send: SendSettings = field(default_factory=SendSettings)
    host_ring_bytes: int | None = None
    host_ring_slot_bytes: int = DEFAULT_SLOT_BYTES


class PrfaasConnectorWorker:
    def __init__(self, open_streams: Callable[[int], object], settings: WorkerSettings = WorkerSettings(),
                 pool: PoolWorker | None = None, device_of: Callable[[object], Device] = Device) -> None:
        """``open_streams(frame_bytes)``: this rank's transport (``KVTransport``), opened at
        ``register_kv_caches``, whose receiver asks producers for frames of ``frame_bytes`` (the
        device's default) unless ``transport.frame_bytes`` says otherwise; ``device_of``: the device
        facade of the cache's device (a test passes a recording one)."""
        self._open_streams = open_streams
        self._settings = settings
        self._device_of = device_of
        self.pool = pool
        self.layout: KVLayout | None = None
        self.streams = None
        self.producer: Producer | None = None
        self.consumer: Consumer | None = None
        self._rings: list[HostRing] = []
        self._idle_step = False

    def register_kv_caches(self, layout: KVLayout, spec: LayoutSpec | None = None) -> None:
        """``spec``: this rank's layout as ``layouts.spec`` describes it (None: this engine can receive
        only from identical layouts). The saver's slots hold at least one block or state page of any
        layer; on CUDA received frames land in a ring of frame-sized slots (a frame that misses it is
        staged through PyTorch's pinned allocator: ``device.consumer``)."""
        self.layout = layout
        caches = list(layout.caches.values())
        device = self._device_of(caches[0].device if caches else "cpu")
        self.streams = self._open_streams(receive_frame_bytes(device.is_cuda))
        largest = max((layout.payload_bytes(layer, 1) for layer in layout.layers.values()), default=0)
        slot_bytes = max(self._settings.host_ring_slot_bytes, largest)
        num_slots = max(2, save_ring_bytes(self._settings.host_ring_bytes, device.is_cuda) // slot_bytes)
        save_ring = HostRing(device, slot_bytes, num_slots)
        self._rings = [save_ring]
        receive_ring = None
        if device.is_cuda:
            announced = self.streams.receive_frame_bytes or receive_frame_bytes(device.is_cuda)  # None: sends only
            frame_bytes = min(max(announced, largest), slot_bytes)
            receive_ring = HostRing(device, frame_bytes, max(2, receive_ring_bytes(self._settings.host_ring_bytes)
                                                             // frame_bytes))
            self._rings.append(receive_ring)
        loader = BlockLoader(device, slot_bytes, receive_ring)
        if receive_ring is not None:
            self.streams.receive_into(loader.allocate)
        self.producer = Producer(self.streams, layout, spec, LayerSaver(device, save_ring), self._settings.send)
        self.consumer = Consumer(self.streams, layout, ReblockPlans(layout, spec, device), loader,
                                 self._settings.receive, spec.tp_rank if spec is not None else 0)
        if self.pool is not None:
            self.pool.register_kv_caches(layout, device, self._settings.host_ring_slot_bytes)

    def on_metadata(self, meta: PrfaasConnectorMetadata) -> None:
        """This step's sends, receives and pool work (before the forward)."""
        self.consumer.on_metadata(meta)
        self.producer.on_metadata(meta)
        if self.pool is not None:
            self.pool.on_metadata(meta)
        self._idle_step = meta.idle

    def save_kv_layer(self, layer_name: str) -> None:
        """After an attention layer was enqueued on the compute stream."""
        self.producer.save_kv_layer(layer_name)

    def wait_for_save(self) -> None:
        """At the step's end: the sends' state pages and ends, the pool's stores; waits for no copy."""
        self.producer.wait_for_save()
        if self.pool is not None:
            self.pool.store()

    def get_transfer_results(self) -> TransferResults:
        """Received KV applied; the requests whose receives or pool loads finished or failed. An idle
        step (the engine only waits for KV) may block a few milliseconds for it."""
        results = self.consumer.get_transfer_results(IDLE_WAIT_S if self.consumer.waits_for_kv else 0.0)
        if self.pool is None:
            return results
        if self._idle_step:
            self.pool.wait_for_loads(IDLE_WAIT_S)
        loaded, failed = self.pool.finished_loads()
        return TransferResults(results.finished_recving | loaded, results.failed_recving | failed)

    def flush(self) -> None:
        """Wait until every queued copy was handed to the transport (host wait; not on a step's path)."""
        self.producer.flush()

    @property
    def num_receiving(self) -> int:
        return self.consumer.num_receiving if self.consumer is not None else 0

    def snapshot(self) -> ConnectorSnapshot:
        pool = self.pool.counters() if self.pool is not None else PoolCounters()
        return ConnectorSnapshot(self.streams.snapshot(), pool)

    def shutdown(self) -> None:
        """Waits for the copies in flight before the pinned memory they use is given back."""
        if self.producer is not None:
            self.producer.close()
        if self.consumer is not None:
            self.consumer.close()
        if self.streams is not None:
            self.streams.close()
        if self.pool is not None:
            self.pool.close()
        for ring in self._rings:
            ring.close()
