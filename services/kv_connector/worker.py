"""Worker side of the PrfaaS connector: copies KV out of and into the paged cache, per layer.

Runs in vLLM's worker process; every method is called on the engine thread. Sends copy the
blocks into a pinned host ring on a side stream (``device.producer``; vLLM may free the blocks at
once: the next step's compute waits for the copies on the GPU, ``LayerSaver.fence``) and hand the
copy to the transport, which sends in the background; a transfer's LAYOUT frame goes before its
first block. On CUDA received blocks are copied in on a side stream too (``device.consumer``), and a
request counts as received once those copies completed. Received frames are applied to
the cache here, between forwards, so nothing else ever writes into engine memory, once the
producer's LAYOUT frame says how (as they are, or re-blocked: ``reblock``); a transfer completes
when its end marker and every frame are in. A rank that receives KV heads its engine replicates on
other ranks passes those frames on to them from a thread of its own (``forwarder``).
"""
from __future__ import annotations

import logging
import time
from collections import OrderedDict
from dataclasses import dataclass, field, replace
from functools import partial

import torch

from services.kv_connector.codecs import coding_of, decode
from services.kv_connector.device.consumer import BlockLoader
from services.kv_connector.device.producer import LayerSaver
from services.kv_connector.device import DEFAULT_RING_BYTES, DEFAULT_SLOT_BYTES
from services.kv_connector.device.ring import HostRing
from services.kv_connector.device.streams import Device
from services.kv_connector.forwarder import Forwarder
from services.kv_connector.layouts.pages import NULL_BLOCK, KVLayout, LayerInfo, state_block
from services.kv_connector.layouts.apply import (attention_view, slice_attention, slice_state, state_page,
                                                 state_piece_bytes)
from services.kv_connector.layouts.spec import Layer, LayoutSpec
from services.kv_connector.metadata import PrfaasConnectorMetadata, RecvSpec, SendAbort, SendSpec
from services.kv_connector.layouts.reblock import Reblocker, ReblockPlans, announcement
from services.kv_connector.layouts.tp_routes import (
    Route,
    expected_wire_ids,
    forwarded_id,
    plan_routes,
    rank_peer,
    transfer_of,
    via_of,
    wire_id,
)
from services.kv_transport import Frame, KVTransport, TransferDone, TransferFailed
from services.kv_transport.codecs import NONE

logger = logging.getLogger(__name__)

MAX_FORGOTTEN = 4096
# While an engine only waits for streamed KV, vLLM runs empty steps back to back; blocking this long
# for the next frame keeps those steps from spinning a core that a colocated engine needs.
IDLE_WAIT_S = 0.005
# KV for a request the engine has not admitted yet (it queues behind running ones) is staged this
# long at least; only then is it taken for a transfer no request will ever claim.
STAGED_TIMEOUT_S = 120.0


@dataclass(slots=True)
class _Stream:
    """One producer rank's stream of a transfer (``tp_routes.wire_id``), or one passed on by a sibling
    rank (``tp_routes.forwarded_id``)."""
    layout_known: bool = False  # its LAYOUT frame arrived; its KV before that is staged
    reblock: Reblocker | None = None  # its layout differs from ours (block sizes, TP size)
    done: bool = False
    forward_to: list[tuple[str, str]] = field(default_factory=list)  # (sibling rank's address, stream id)
    forwards_ended: bool = False


@dataclass(slots=True)
class _Receiving:
    spec: RecvSpec | None = None
    early_frames: list[Frame] = field(default_factory=list)
    early_bytes: int = 0
    started: bool = False  # some KV (or the transfer's end) arrived
    streams: dict[str, _Stream] = field(default_factory=dict)
    expected: frozenset[str] | None = None  # the streams that complete it, from the first LAYOUT frame
    last_activity: float = field(default_factory=time.monotonic)

    @property
    def done(self) -> bool:
        return self.expected is not None and all(
            wire in self.streams and self.streams[wire].done for wire in self.expected)


@dataclass(frozen=True, slots=True)
class TransferResults:
    finished_recving: set[str]
    failed_recving: set[str]


class PrfaasConnectorWorker:
    def __init__(self, streams_factory, idle_timeout_s: float, max_early_bytes: int, layerwise: bool = True,
                 first_frame_timeout_s: float | None = None, host_ring_bytes: int = DEFAULT_RING_BYTES,
                 host_ring_slot_bytes: int = DEFAULT_SLOT_BYTES, code_sends: bool = False) -> None:
        self._streams_factory = streams_factory
        self._code_sends = code_sends
        self._ring_bytes, self._slot_bytes = host_ring_bytes, host_ring_slot_bytes
        self._rings: list[HostRing] = []
        self._saver: LayerSaver | None = None
        self._loader: BlockLoader | None = None
        self._layerwise = layerwise
        self._deferred: dict[str, list[tuple]] = {}  # send-after-prefill mode: (peer, wire id, frame) held to the end
        self._idle_timeout_s = idle_timeout_s
        self._first_frame_timeout_s = max(idle_timeout_s, first_frame_timeout_s or idle_timeout_s)
        self._max_early_bytes = max_early_bytes
        self.layout: KVLayout | None = None
        self.streams: KVTransport | None = None
        self._announcement = b""  # this engine's LAYOUT frame payload
        self._spec: LayoutSpec | None = None
        self._plans: ReblockPlans | None = None
        self._spec_layers: dict[str, Layer] = {}
        self._routes: dict[int, list[Route]] = {}  # by the consumer's TP size
        self._destinations_of: dict[str, list[tuple[str, str, Route]]] = {}  # this step's sends, by transfer
        self._sends: list[SendSpec] = []
        self._unannounced: set[str] = set()  # transfers starting this step whose LAYOUT frame is not sent
        self._idle_step = False
        self._receiving: dict[str, _Receiving] = {}
        self._released: set[str] = set()  # aborted while receiving: vLLM frees their blocks once told
        self._forgotten: OrderedDict[str, None] = OrderedDict()
        self.forwarder = Forwarder()  # sends to sibling ranks that replicate what this rank receives

    def register_kv_caches(self, layout: KVLayout, spec: LayoutSpec | None = None) -> None:
        """``spec``: this rank's layout as ``layouts.spec`` describes it (None: this engine can receive
        only from identical layouts)."""
        self.layout = layout
        self._spec = spec
        self._spec_layers = {item.name: item for item in spec.layers} if spec is not None else {}
        self._announcement = announcement(layout.fingerprint, spec)
        self._plans = ReblockPlans(layout, spec)
        self.streams = self._streams_factory()
        self._open_device_path(layout)

    def _open_device_path(self, layout: KVLayout) -> None:
        """The saver's ring (slots of at least one block or state page of any layer); on CUDA a ring
        of frame-sized slots the transport receives into, and two slots for frames that missed it."""
        caches = list(layout.caches.values())
        device = Device(caches[0].device if caches else "cpu")
        largest = max(layout.payload_bytes(layer, 1) for layer in layout.layers.values()) if layout.layers else 0
        slot_bytes = max(self._slot_bytes, largest)
        save_ring, load_ring = HostRing(device, slot_bytes, max(2, self._ring_bytes // slot_bytes)), \
            HostRing(device, slot_bytes, 2)
        self._rings = [save_ring, load_ring]
        self._saver = LayerSaver(device, save_ring)
        receive_ring = None
        if device.is_cuda and isinstance(self.streams, KVTransport):
            frame_bytes = min(max(self.streams.settings.frame_bytes, largest), slot_bytes)
            receive_ring = HostRing(device, frame_bytes, max(2, self._ring_bytes // frame_bytes))
            self._rings.append(receive_ring)
        self._loader = BlockLoader(device, load_ring, receive_ring)
        if receive_ring is not None:
            self.streams.receive_into(self._loader.allocate)

    def on_metadata(self, meta: PrfaasConnectorMetadata) -> None:
        for spec in meta.recvs:
            receiving = self._receiving.setdefault(spec.transfer_id, _Receiving())
            receiving.spec = spec
            receiving.last_activity = time.monotonic()
        for transfer_id in meta.abandoned:
            receiving = self._receiving.get(transfer_id)
            if receiving is not None and receiving.spec is not None:
                # vLLM keeps an aborted request's blocks until its receive is reported finished.
                self._released.add(receiving.spec.req_id)
            self._forget(transfer_id, "abandoned by the engine")
        for aborted in meta.aborted_sends:
            self._abort_send(aborted)
        self._sends = meta.sends
        self._destinations_of = {}
        self._unannounced = {send.transfer_id for send in meta.sends if send.start == 0}
        self._idle_step = meta.idle

    # Producer --------------------------------------------------------------------------------

    def _abort_send(self, aborted: SendAbort) -> None:
        """Ends a transfer whose request was aborted before all its KV was sent: an ABORT frame tells
        the consumer (which drops its receive at once instead of at its idle timeout), and the sender
        forgets it. Ordered after the copies already queued for it, which the sender then drops."""
        self._deferred.pop(aborted.transfer_id, None)
        if not aborted.started or self.streams is None:
            return  # nothing of it is on the wire
        destinations = self._plan_destinations(aborted)

        def abort() -> None:
            for peer, wire, _ in destinations:
                self.streams.abort(peer, wire, "the request ended before its KV was sent")
                self.streams.finish(peer, wire)  # a failed transfer's END only releases the sender's state
            logger.debug("request %s: KV send aborted", aborted.transfer_id)

        if self._saver is not None:
            self._saver.then(abort)
        else:
            abort()

    def save_kv_layer(self, layer_name: str) -> None:
        if not self._sends:
            return
        layer = self.layout.layers.get(layer_name)
        if layer is None or self.layout.is_state_group[layer.group]:
            return
        for send in self._sends:
            self._announce(send)
            self._send_attention_blocks(send, layer)

    def wait_for_save(self) -> None:
        """Queues the state pages and the end of each transfer whose last chunk ran; waits for no copy."""
        for send in self._sends:
            self._announce(send)
            if send.is_last:
                for layer in self.layout.state_layers:
                    self._send_state_page(send, layer)
                self._saver.then(partial(self._end, send, self._destinations(send)))
        if self._sends and self._saver is not None:
            self._saver.fence()
        self._sends = []

    def _end(self, send: SendSpec, destinations: list[tuple[str, str, Route]]) -> None:
        """After the transfer's last copy was handed on (the sender's thread, in order)."""
        for peer, wire, frame, coding, divisible in self._deferred.pop(send.transfer_id, ()):
            self.streams.send(peer, wire, *frame, coding=coding, divisible=divisible)
        for peer, wire, _ in destinations:
            self.streams.finish(peer, wire)
        logger.debug("request %s: all KV handed to the transport", send.transfer_id)

    def flush(self) -> None:
        """Wait until every queued copy was handed to the transport (host wait; not on a step's path)."""
        if self._saver is not None:
            self._saver.flush()

    def _destinations(self, send: SendSpec) -> list[tuple[str, str, Route]]:
        """(address, wire id, route) of each consumer rank this rank sends ``send`` to (worked out once
        per step, not per layer)."""
        destinations = self._destinations_of.get(send.transfer_id)
        if destinations is None:
            destinations = self._destinations_of[send.transfer_id] = self._plan_destinations(send)
        return destinations

    def _plan_destinations(self, send: SendSpec) -> list[tuple[str, str, Route]]:
        routes = self._routes.get(send.peer_tp_size)
        if routes is None:
            routes, problem = plan_routes(self._spec, send.peer_tp_size)
            if problem:
                logger.error("KV cannot go to a consumer of TP %d (its ranks get only this engine's layout, which "
                             "they refuse): %s", send.peer_tp_size, problem)
            self._routes[send.peer_tp_size] = routes
        wire = wire_id(send.transfer_id, self._spec)
        return [(rank_peer(send.peer, route.dst_rank), wire, route) for route in routes]

    def _announce(self, send: SendSpec) -> None:
        if send.transfer_id in self._unannounced:
            self._unannounced.discard(send.transfer_id)
            for peer, wire, _ in self._destinations(send):
                self.streams.send_layout(peer, wire, self._announcement)

    def _send_attention_blocks(self, send: SendSpec, layer: LayerInfo) -> None:
        block_size = self.layout.block_size[layer.group]
        first = send.start // block_size
        last = -(-send.end // block_size) if send.is_last else send.end // block_size
        ids = list(send.block_ids[layer.group][first:last])
        if not ids:
            return
        for peer, wire, route in self._destinations(send):
            coding = self._coding(layer)
            if route.pieces is None:
                self._saver.save(self.layout.caches[layer.name], layer.block_dim, ids,
                                 self._deliverer(send, peer, wire, layer, first, coding,
                                                 divisible=layer.block_dim == 0))
                continue
            if not (pieces := route.pieces.get(layer.name)):
                continue
            view = attention_view(self.layout.caches[layer.name], self._spec_layer(layer),
                                  self.layout.block_size[layer.group], self._spec.cache_layout)
            block_bytes = sum(view[0, p.src_start:p.src_start + p.num_units].numel() for p in pieces) \
                * view.element_size()
            # runs of at most one frame: the transport splits a payload by whole blocks, which would
            # cut across the pieces of a payload that holds several
            self._saver.save_made(partial(_sliced_blocks, view, pieces), block_bytes, ids,
                                  self._deliverer(send, peer, wire, layer, first, coding), self._frame_bytes())

    def _coding(self, layer: LayerInfo):
        """How the transport may code this attention layer's payloads (None: raw): only on an engine
        that codes what it sends (``ConnectorSettings.code_sends``), in rows of one (block, head, K or V)."""
        if not self._code_sends or layer.block_dim != 0:
            return None
        return coding_of(self.layout.caches[layer.name])

    def _deliverer(self, send: SendSpec, peer: str, wire: str, layer: LayerInfo, first: int, coding=None,
                   divisible: bool = False):
        """The saver's ``deliver`` for one layer's blocks from block ``first`` of the request on;
        ``divisible``: its payloads are whole blocks one after another (the transport may cut them)."""
        def deliver(offset: int, count: int, payload: memoryview, release) -> None:
            if self._layerwise:
                self.streams.send(peer, wire, layer.index, layer.group, first + offset, count, payload,
                                  on_sent=release, coding=coding, divisible=divisible)
                return
            frame = (layer.index, layer.group, first + offset, count, memoryview(bytes(payload)))
            release()  # held to the prefill's end: a copy, so the ring keeps moving
            self._deferred.setdefault(send.transfer_id, []).append((peer, wire, frame, coding, divisible))
        return deliver

    def _send_state_page(self, send: SendSpec, layer: LayerInfo) -> None:
        block = state_block(send.block_ids[layer.group])
        if block == NULL_BLOCK:
            return
        for peer, wire, route in self._destinations(send):
            if route.pieces is None:
                self._saver.save(self.layout.caches[layer.name], layer.block_dim, [block],
                                 self._deliverer(send, peer, wire, layer, 0))
            elif pieces := route.pieces.get(layer.name):
                page = state_page(self.layout.caches[layer.name], block)
                spec_layer = self._spec_layer(layer)
                page_bytes = sum(state_piece_bytes(page, spec_layer, piece) for piece in pieces)
                self._saver.save_made(partial(_sliced_page, page, spec_layer, pieces), page_bytes, [block],
                                      self._deliverer(send, peer, wire, layer, 0))

    def _frame_bytes(self) -> int | None:
        settings = getattr(self.streams, "settings", None)
        return min(settings.frame_bytes, settings.max_frame_bytes) if settings is not None else None

    def _spec_layer(self, layer: LayerInfo) -> Layer:
        return self._spec_layers[layer.name]

    # Consumer --------------------------------------------------------------------------------

    def get_transfer_results(self) -> TransferResults:
        """Apply what arrived since the last step; report finished and failed receives."""
        failed: dict[str, str] = {}
        wait_s = IDLE_WAIT_S if self._idle_step and self._receiving else 0.0
        for event in self.streams.poll(wait_s) if self.streams else ():
            self._on_event(event, failed)
        for transfer_id, receiving in list(self._receiving.items()):
            if receiving.spec is not None and receiving.early_frames and transfer_id not in failed:
                self._apply_early(transfer_id, receiving, failed)
            if transfer_id not in failed:
                self._end_forwards(receiving)
        self._expire_idle(failed)
        return self._collect(failed)

    def _on_event(self, event, failed: dict[str, str]) -> None:
        transfer_id = transfer_of(event.transfer_id)
        if transfer_id in self._forgotten:
            return
        receiving = self._receiving.setdefault(transfer_id, _Receiving())
        stream = receiving.streams.setdefault(event.transfer_id, _Stream())
        receiving.last_activity = time.monotonic()
        receiving.started = True
        if isinstance(event, TransferFailed):
            failed[transfer_id] = event.reason
        elif isinstance(event, TransferDone):
            stream.done = True
            if receiving.expected is None:  # ended without a LAYOUT frame: it had no KV to announce
                receiving.expected = frozenset({event.transfer_id})
        elif event.is_layout:
            if error := self._learn_layout(event, transfer_id, receiving, stream):
                failed[transfer_id] = error
        elif receiving.spec is None or not stream.layout_known:
            self._stage_early(event, transfer_id, receiving, failed)
        elif error := self._apply(event, receiving, stream):
            failed[transfer_id] = error

    def _learn_layout(self, frame: Frame, transfer_id: str, receiving: _Receiving, stream: _Stream) -> str | None:
        payload = bytes(frame.payload)
        plan = self._plans.plan(payload, via_of(frame.transfer_id))
        if isinstance(plan, str):
            return plan
        stream.reblock, stream.layout_known = plan, True
        expected = (expected_wire_ids(transfer_id, plan.src, plan.sources, frame.transfer_id)
                    if plan is not None else frozenset({frame.transfer_id}))
        if plan is not None and plan.replicas:
            forwarded = forwarded_id(frame.transfer_id, plan.dst.tp_rank)
            stream.forward_to = [(self._sibling(rank), forwarded) for rank in plan.replicas]
            for peer, wire in stream.forward_to:
                self.forwarder.put(self.streams.send_layout, peer, wire, payload)
        if receiving.expected is None:
            receiving.expected = expected
        elif receiving.expected != expected:
            return f"producer ranks announce different streams ({sorted(receiving.expected)} != {sorted(expected)})"
        return None

    def _stage_early(self, frame: Frame, transfer_id: str, receiving: _Receiving, failed: dict[str, str]) -> None:
        receiving.early_frames.append(frame)
        receiving.early_bytes += len(frame.payload)
        if receiving.early_bytes > self._max_early_bytes:
            failed[transfer_id] = "more KV arrived before the engine allocated blocks than the staging budget"

    def _apply_early(self, transfer_id: str, receiving: _Receiving, failed: dict[str, str]) -> None:
        """Apply the staged frames whose stream's layout is known; keep the others staged."""
        frames, receiving.early_frames, receiving.early_bytes = receiving.early_frames, [], 0
        for frame in frames:
            stream = receiving.streams[frame.transfer_id]
            if not stream.layout_known:
                receiving.early_frames.append(frame)
                receiving.early_bytes += len(frame.payload)
            elif error := self._apply(frame, receiving, stream):
                failed[transfer_id] = error
                return

    def _sibling(self, rank: int) -> str:
        """Where this engine's TP rank ``rank`` receives KV: this rank's port, moved by the rank gap."""
        host = self.streams.listen_host
        host = "127.0.0.1" if host in ("0.0.0.0", "::", "") else host
        return f"{host}:{self.streams.port - self._spec.tp_rank + rank}"

    def _end_forwards(self, receiving: _Receiving) -> None:
        """End the streams passed on to sibling ranks once all of their source's frames went on."""
        for wire, stream in receiving.streams.items():
            if stream.forward_to and stream.done and not stream.forwards_ended \
                    and not any(frame.transfer_id == wire for frame in receiving.early_frames):
                stream.forwards_ended = True
                for peer, forwarded in stream.forward_to:
                    self.forwarder.put(self.streams.finish, peer, forwarded)

    def _apply(self, frame: Frame, receiving: _Receiving, stream: _Stream) -> str | None:
        """Copy one frame into the request's blocks, decoded first (and pass it on, decoded, to the
        ranks that replicate its units); returns an error text instead of raising."""
        if frame.codec != NONE:
            decoded = self._decoded(frame)
            if isinstance(decoded, str):
                return decoded
            frame = decoded
        error = self._write(frame, receiving, stream)
        if error is None and stream.forward_to:
            payload = bytes(frame.payload)  # the received buffer is the receiver's to reuse
            for peer, wire in stream.forward_to:
                self.forwarder.put(self.streams.send, peer, wire, frame.layer, frame.group, frame.block_start,
                                   frame.num_blocks, payload)
        return error

    def _decoded(self, frame: Frame) -> Frame | str:
        """A coded frame (checked against its codec on arrival) in this engine's cache dtype; coded
        state pages are refused: they always travel lossless."""
        layer = self.layout.by_index.get(frame.layer)
        if layer is None or layer.group != frame.group or self.layout.is_state_group[layer.group]:
            return f"coded frame for layer {frame.layer} / group {frame.group}, which is not attention KV"
        payload = decode(frame.codec, frame.payload, frame.row_elems, self.layout.caches[layer.name].dtype)
        return replace(frame, payload=payload, codec=NONE, row_elems=0)

    def _write(self, frame: Frame, receiving: _Receiving, stream: _Stream) -> str | None:
        spec = receiving.spec
        layer = self.layout.by_index.get(frame.layer)
        if layer is None or layer.group != frame.group:
            return f"frame for unknown layer {frame.layer} / group {frame.group}"
        if stream.reblock is not None:
            return self._apply_reblocked(frame, layer, spec, stream.reblock)
        ids = self._destination(layer, frame, spec)
        if ids is None:
            return (f"frame outside the request's blocks (layer {frame.layer}, "
                    f"blocks {frame.block_start}+{frame.num_blocks})")
        if len(frame.payload) != self.layout.payload_bytes(layer, frame.num_blocks):
            return f"frame of {len(frame.payload)} bytes does not match layer {frame.layer}'s block size"
        keep = [i for i, block in enumerate(ids) if block is not None]
        if keep:
            self._loader.write(spec.transfer_id, self.layout.caches[layer.name], layer.block_dim, frame.payload,
                               keep, [ids[k] for k in keep])
        return None

    def _apply_reblocked(self, frame: Frame, layer: LayerInfo, spec: RecvSpec, reblock: Reblocker) -> str | None:
        group_ids = spec.block_ids[layer.group]
        if self.layout.is_state_group[layer.group]:
            if frame.num_blocks != 1 or not reblock.fits_state_page(layer, len(frame.payload)):
                return f"state frame of {frame.num_blocks} pages, {len(frame.payload)} bytes for layer {frame.layer}"
            if (block := state_block(group_ids)) != NULL_BLOCK:
                reblock.write_state(layer, block, frame.payload)
            return None
        block_size = self.layout.block_size[layer.group]
        if frame.num_blocks < 1 or frame.block_start * reblock.src_block_size(layer) >= len(group_ids) * block_size:
            return (f"frame outside the request's blocks (layer {frame.layer}, producer blocks "
                    f"{frame.block_start}+{frame.num_blocks})")
        if len(frame.payload) != reblock.attention_payload_bytes(layer, frame.num_blocks):
            return f"frame of {len(frame.payload)} bytes does not match layer {frame.layer}'s producer blocks"
        first_needed = spec.first_token // block_size
        ids = [b if i >= first_needed and b != NULL_BLOCK else None for i, b in enumerate(group_ids)]
        reblock.write_attention(layer, ids, frame.block_start, frame.num_blocks, frame.payload)
        return None

    def _destination(self, layer: LayerInfo, frame: Frame, spec: RecvSpec) -> list[int | None] | None:
        group_ids = spec.block_ids[layer.group]
        if self.layout.is_state_group[layer.group]:
            block = state_block(group_ids)
            return [block if block != NULL_BLOCK else None] if frame.num_blocks == 1 else None
        end = frame.block_start + frame.num_blocks
        if end > len(group_ids):
            return None
        first_needed = spec.first_token // self.layout.block_size[layer.group]
        return [b if (frame.block_start + i >= first_needed and b != NULL_BLOCK) else None
                for i, b in enumerate(group_ids[frame.block_start:end])]

    def _expire_idle(self, failed: dict[str, str]) -> None:
        now = time.monotonic()
        for transfer_id, receiving in list(self._receiving.items()):
            idle_s = now - receiving.last_activity
            if receiving.spec is None:
                if idle_s > max(self._idle_timeout_s, STAGED_TIMEOUT_S):
                    self._forget(transfer_id, "no request on this engine waits for it")
            elif not receiving.done and idle_s > (limit := self._idle_limit(receiving)):
                what = "no KV received" if receiving.started else "no KV arrived (prefill queued, slow or lost)"
                failed.setdefault(transfer_id, f"{what} for {limit:.0f} s")

    def _idle_limit(self, receiving: _Receiving) -> float:
        """Once KV flows, a pause of ``idle_timeout_s`` means the sender is gone; before the first KV
        the prefill may wait in its engine's queue behind others, so the wait may be longer."""
        return self._idle_timeout_s if receiving.started else self._first_frame_timeout_s

    def _collect(self, failed: dict[str, str]) -> TransferResults:
        if self._loader is not None:
            self._loader.poll()
            if failed or self._released:
                self._loader.fence()  # their blocks may be reused by the next step
        finished, failed_req_ids = self._released, set()
        self._released = set()
        for transfer_id, reason in failed.items():
            receiving = self._receiving.get(transfer_id)
            if receiving is not None and receiving.spec is not None:
                finished.add(receiving.spec.req_id)
                failed_req_ids.add(receiving.spec.req_id)
            self._forget(transfer_id, reason)
        for transfer_id, receiving in list(self._receiving.items()):
            if receiving.done and receiving.spec is not None and not receiving.early_frames \
                    and not self._copying_in(transfer_id):
                finished.add(receiving.spec.req_id)
                del self._receiving[transfer_id]
                logger.debug("request %s: KV received", transfer_id)
        return TransferResults(finished, failed_req_ids)

    def _forget(self, transfer_id: str, reason: str) -> None:
        self._deferred.pop(transfer_id, None)
        receiving = self._receiving.pop(transfer_id, None)
        if receiving is not None or reason != "abandoned by the engine":
            logger.warning("request %s: KV transfer dropped: %s", transfer_id, reason)
        if self.streams is not None:
            for wire in {transfer_id, *(receiving.streams if receiving is not None else ())}:
                self.streams.forget(wire)
            for stream in receiving.streams.values() if receiving is not None else ():
                if not stream.forwards_ended:  # the sibling ranks fail it now instead of waiting for its end
                    for peer, forwarded in stream.forward_to:
                        self.forwarder.put(self.streams.abort, peer, forwarded, reason)
        self._forgotten[transfer_id] = None
        while len(self._forgotten) > MAX_FORGOTTEN:
            self._forgotten.popitem(last=False)

    def _copying_in(self, transfer_id: str) -> bool:
        return self._loader is not None and self._loader.busy(transfer_id)

    @property
    def num_receiving(self) -> int:
        return len(self._receiving)

    def shutdown(self) -> None:
        if self._saver is not None:
            self._saver.close()
        self.forwarder.close()
        if self.streams is not None:
            self.streams.close()
        for ring in self._rings:
            ring.close()


def _joined(pieces: list[torch.Tensor]) -> torch.Tensor:
    """Contiguous piece copies back to back, as bytes (a single piece is sent as it is, not copied again)."""
    flat = [piece.reshape(-1).view(torch.uint8) for piece in pieces]
    return flat[0] if len(flat) == 1 else torch.cat(flat)


def _sliced_blocks(view: torch.Tensor, pieces, block_ids) -> torch.Tensor:
    """The heads of ``block_ids`` a consumer rank of another TP size gets (``tp_routes`` pieces)."""
    return _joined([slice_attention(view, block_ids, piece) for piece in pieces])


def _sliced_page(page: torch.Tensor, layer: Layer, pieces, block_ids) -> torch.Tensor:
    """The shares of a state page (the one block of ``block_ids``) a consumer rank gets."""
    return _joined([slice_state(page, layer, piece) for piece in pieces])
