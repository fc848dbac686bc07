"""The consumer half of the connector's worker: applies received KV to the paged cache.

Every method runs on the engine thread, between forwards, so nothing else ever writes into engine
memory. Frames are applied once the producer's LAYOUT frame says how (as they are, through the
``device.consumer.BlockLoader``'s side streams; or re-blocked / TP-sliced: ``layouts.reblock``); KV
that arrives before vLLM allocated the request's blocks is staged. A transfer completes when its end
marker and every frame are in, and its copies completed. A rank that receives KV heads its engine
replicates on other ranks passes those frames on to them from a thread of its own (``forwarder``).
"""
from __future__ import annotations

import logging
import time
from collections import OrderedDict
from dataclasses import dataclass, field, replace

from services.kv_connector.codecs import decode
from services.kv_connector.device.consumer import BlockLoader
from services.kv_connector.forwarder import Forwarder
from services.kv_connector.layouts.pages import NULL_BLOCK, KVLayout, LayerInfo, state_block
from services.kv_connector.layouts.reblock import Reblocker, ReblockPlans
from services.kv_connector.layouts.tp_routes import expected_wire_ids, forwarded_id, transfer_of, via_of
from services.kv_connector.metadata import PrfaasConnectorMetadata, RecvSpec
from services.kv_transport import Frame, TransferDone, TransferFailed
from services.kv_transport.codecs import NONE

logger = logging.getLogger(__name__)

MAX_FORGOTTEN = 4096
# While an engine only waits for streamed KV, vLLM runs empty steps back to back; blocking this long
# for the next frame keeps those steps from spinning a core that a colocated engine needs.
IDLE_WAIT_S = 0.005
# KV for a request the engine has not admitted yet (it queues behind running ones) is staged this
# long at least; only then is it taken for a transfer no request will ever claim.
STAGED_TIMEOUT_S = 120.0


@dataclass(frozen=True, slots=True)
class ReceiveSettings:
    """``idle_timeout_s``: a pause in a flowing transfer that fails it; ``first_frame_timeout_s``: the
    wait for its first KV (the prefill may queue); ``max_early_bytes``: KV staged before vLLM
    allocated the request's blocks."""
    idle_timeout_s: float = 30.0
    max_early_bytes: int = 256 << 20
    first_frame_timeout_s: float | None = None

    @property
    def first_frame_limit_s(self) -> float:
        return max(self.idle_timeout_s, self.first_frame_timeout_s or self.idle_timeout_s)


@dataclass(frozen=True, slots=True)
class TransferResults:
    finished_recving: set[str]
    failed_recving: set[str]


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


class Consumer:
    def __init__(self, streams, layout: KVLayout, plans: ReblockPlans, loader: BlockLoader,
                 settings: ReceiveSettings = ReceiveSettings(), tp_rank: int = 0) -> None:
        self.streams = streams
        self.layout = layout
        self.plans = plans
        self.loader = loader
        self._settings = settings
        self._tp_rank = tp_rank
        self._idle_step = False
        self._receiving: dict[str, _Receiving] = {}
        self._released: set[str] = set()  # aborted while receiving: vLLM frees their blocks once told
        self._forgotten: OrderedDict[str, None] = OrderedDict()
        self.forwarder = Forwarder()  # sends to sibling ranks that replicate what this rank receives

    @property
    def num_receiving(self) -> int:
        return len(self._receiving)

    @property
    def waits_for_kv(self) -> bool:
        """An idle step with receives open: the next poll may block briefly for a frame."""
        return self._idle_step and bool(self._receiving)

    def on_metadata(self, meta: PrfaasConnectorMetadata) -> None:
        for spec in meta.recvs:
            receiving = self._receiving.setdefault(spec.transfer_id, _Receiving())
            receiving.spec = spec
            receiving.last_activity = time.monotonic()
        for transfer_id in meta.abandoned:
            self._abandon(transfer_id)
        self._idle_step = meta.idle

    def get_transfer_results(self, wait_s: float = 0.0) -> TransferResults:
        """Apply what arrived since the last step (waiting up to ``wait_s`` for it); report finished
        and failed receives."""
        failed: dict[str, str] = {}
        for event in self.streams.poll(wait_s):
            self._on_event(event, failed)
        for transfer_id, receiving in list(self._receiving.items()):
            if receiving.spec is not None and receiving.early_frames and transfer_id not in failed:
                self._apply_early(transfer_id, receiving, failed)
            if transfer_id not in failed:
                self._end_forwards(receiving)
        self._expire_idle(failed)
        return self._collect(failed)

    def close(self) -> None:
        self.forwarder.close()
        self.loader.close()

    def _abandon(self, transfer_id: str) -> None:
        """vLLM dropped the request (it keeps the blocks until the receive is reported finished)."""
        receiving = self._receiving.get(transfer_id)
        if receiving is not None and receiving.spec is not None:
            self._released.add(receiving.spec.req_id)
        if receiving is not None:
            logger.warning("request %s: KV transfer dropped: abandoned by the engine", transfer_id)
        self._forget(transfer_id, "abandoned by the engine")

    def _drop(self, transfer_id: str, reason: str) -> None:
        logger.warning("request %s: KV transfer dropped: %s", transfer_id, reason)
        self._forget(transfer_id, reason)

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
        plan = self.plans.plan(payload, via_of(frame.transfer_id))
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
        if receiving.early_bytes > self._settings.max_early_bytes:
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
        return f"{host}:{self.streams.port - self._tp_rank + rank}"

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
            self.loader.write(spec.transfer_id, self.layout.caches[layer.name], layer.block_dim, frame.payload,
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
                if idle_s > max(self._settings.idle_timeout_s, STAGED_TIMEOUT_S):
                    self._drop(transfer_id, "no request on this engine waits for it")
            elif not receiving.done and idle_s > (limit := self._idle_limit(receiving)):
                what = "no KV received" if receiving.started else "no KV arrived (prefill queued, slow or lost)"
                failed.setdefault(transfer_id, f"{what} for {limit:.0f} s")

    def _idle_limit(self, receiving: _Receiving) -> float:
        """Once KV flows, a pause of ``idle_timeout_s`` means the sender is gone; before the first KV
        the prefill may wait in its engine's queue behind others, so the wait may be longer."""
        return self._settings.idle_timeout_s if receiving.started else self._settings.first_frame_limit_s

    def _collect(self, failed: dict[str, str]) -> TransferResults:
        self.loader.poll()
        if failed or self._released:
            self.loader.fence()  # their blocks may be reused by the next step
        finished, failed_req_ids = self._released, set()
        self._released = set()
        for transfer_id, reason in failed.items():
            receiving = self._receiving.get(transfer_id)
            if receiving is not None and receiving.spec is not None:
                finished.add(receiving.spec.req_id)
                failed_req_ids.add(receiving.spec.req_id)
            self._drop(transfer_id, reason)
        for transfer_id, receiving in list(self._receiving.items()):
            if receiving.done and receiving.spec is not None and not receiving.early_frames \
                    and not self.loader.busy(transfer_id):
                finished.add(receiving.spec.req_id)
                del self._receiving[transfer_id]
                logger.debug("request %s: KV received", transfer_id)
        return TransferResults(finished, failed_req_ids)

    def _forget(self, transfer_id: str, reason: str) -> None:
        receiving = self._receiving.pop(transfer_id, None)
        for wire in {transfer_id, *(receiving.streams if receiving is not None else ())}:
            self.streams.forget(wire)
        for stream in receiving.streams.values() if receiving is not None else ():
            if not stream.forwards_ended:  # the sibling ranks fail it now instead of waiting for its end
                for peer, forwarded in stream.forward_to:
                    self.forwarder.put(self.streams.abort, peer, forwarded, reason)
        self._forgotten[transfer_id] = None
        while len(self._forgotten) > MAX_FORGOTTEN:
            self._forgotten.popitem(last=False)
