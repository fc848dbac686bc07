"""Worker side of the cache-pool integration: copies prompt blocks out to the cluster's pool and loads
them back in. Every method runs on the engine thread; the pool I/O runs on ``PoolIO``'s thread.

Stores gather the step's new blocks right after the forward (``store``, from ``wait_for_save``), on
the compute stream, so vLLM may reuse them at once; the Put happens in the background and copies
each block of each layer straight from that copy into the pool's arena (``Pieces``: never joined
into ``bytes``; on CUDA ``device.pool_copies.DevicePiece``, a device-to-host DMA into the arena
registered as pinned memory), and a failed Put is logged and counted, nothing more. Loads Get in the
background; a finished Get's blocks go from the arena's slots into the request's blocks through a
``BlockLoader`` (on CUDA host-to-device copies on side streams, the arena pinned), and once the
copies completed each block is checked (a block evicted while being copied fails the load). A failed
or malformed Get is reported as a failed receive, so vLLM recomputes the prompt. A pool block holds,
for one group, the bytes of every layer of that group for one block (full attention) or its state
page (recurrent state), in layer order; an engine of several TP ranks keeps each rank's share under
the rank's own key (``PoolModel.key``).
"""
from __future__ import annotations

import logging
from concurrent.futures import Future
from concurrent.futures import wait as wait_futures

import torch

from services.cache_pool_client.types import Block, Pieces
from services.kv_connector.device import DEFAULT_SLOT_BYTES
from services.kv_connector.device.consumer import BlockLoader
from services.kv_connector.device.pool_copies import DevicePiece, PinnedRegion
from services.kv_connector.device.ring import HostRing
from services.kv_connector.device.streams import Device
from services.kv_connector.layouts.pages import NULL_BLOCK, KVLayout, LayerInfo, state_block_at
from services.kv_connector.metadata import PoolLoadSpec, PoolStoreSpec, PrfaasConnectorMetadata
from services.kv_connector.pool_io import PoolModel
from services.kv_connector.snapshot import PoolCounters

logger = logging.getLogger(__name__)


class PoolWorker:
    def __init__(self, io, model: PoolModel, rank: int = 0) -> None:
        self._io = io
        self.model = model
        self.key = model.key(rank)  # this TP rank's share of each block
        self.layout: KVLayout | None = None
        self._device = Device("cpu")
        self._loader: BlockLoader | None = None
        self._rings: list[HostRing] = []
        self._arenas: dict[int, PinnedRegion] = {}  # by the arena mapping's address
        self._loads: dict[str, tuple[PoolLoadSpec, Future]] = {}
        self._copying: dict[str, tuple[PoolLoadSpec, list[Block]]] = {}  # loads whose copies may still run
        self._released: set[str] = set()
        self._stores: list[PoolStoreSpec] = []
        self.num_tokens_loaded = 0
        self.num_tokens_stored = 0
        self.num_loads_failed = 0
        self.num_stores_failed = 0

    def register_kv_caches(self, layout: KVLayout, slot_bytes: int = DEFAULT_SLOT_BYTES) -> None:
        """The engine's paged cache; ``slot_bytes``: the loader's host slots for bytes that are not
        in pinned memory (a Get's that came inline), at least one block of any layer."""
        self.layout = layout
        caches = list(layout.caches.values())
        self._device = Device(caches[0].device if caches else "cpu")
        largest = max((layout.payload_bytes(layer, 1) for layer in layout.layers.values()), default=0)
        self._rings = [HostRing(self._device, max(slot_bytes, largest), 2)]
        self._loader = BlockLoader(self._device, self._rings[0])

    def close(self) -> None:
        for ring in self._rings:
            ring.close()
        for region in self._arenas.values():
            region.close()
        self._rings, self._arenas = [], {}

    def on_metadata(self, meta: PrfaasConnectorMetadata) -> None:
        for spec in meta.pool_loads:
            self._loads[spec.req_id] = (spec, self._io.start_get(self.key, self._refs(spec)))
        for req_id in meta.pool_abandoned:
            if (load := self._loads.pop(req_id, None)) is not None:
                load[1].cancel()
                self._released.add(req_id)  # vLLM frees the blocks once the load is reported finished
            elif self._copying.pop(req_id, None) is not None:
                self._loader.fence()  # the blocks' next use waits for the copies into them
                self._released.add(req_id)
        self._stores = meta.pool_stores

    # Store -------------------------------------------------------------------------------------

    def store(self) -> None:
        """After the forward: gather this step's new blocks and Put them in the background."""
        stores, self._stores = self._stores, []
        if not stores:
            return
        gathered = [self._copy_out(spec) for spec in stores]
        ready = self._device.event()  # the gathers are done: the Put's copies may read them
        ready.record(self._device.current_stream())
        for spec, copies in zip(stores, gathered):
            future = self._io.start_put(self.key, lambda spec=spec, copies=copies: self._blocks(spec, copies, ready))
            future.add_done_callback(lambda f, spec=spec: self._on_stored(spec, f))

    def _copy_out(self, spec: PoolStoreSpec) -> dict[int, list[tuple[LayerInfo, torch.Tensor]]]:
        copies = {}
        for group in self.model.full_group_ids:
            ids = [spec.block_ids[group][i] for i, _ in spec.blocks]
            if ids:
                copies[group] = [(layer, self.layout.gather(layer, ids)) for layer in self._layers(group)]
        for group in self.model.linear_group_ids if spec.state_hash else ():
            page = self._state_page(spec.block_ids, group, spec.end)
            if page != NULL_BLOCK:
                copies[group] = [(layer, self.layout.gather(layer, [page])) for layer in self._layers(group)]
        return copies

    def _blocks(self, spec: PoolStoreSpec, copies, ready) -> list[Block]:
        """Runs on the I/O thread. In prompt order: each block's groups, then the state at the end."""
        def join(group: int, k: int) -> Pieces:
            return _join(copies[group], k, self._device, ready)

        blocks = [Block(group, block_hash, join(group, k))
                  for k, (_, block_hash) in enumerate(spec.blocks) for group in self.model.full_group_ids
                  if group in copies]
        if spec.state_hash and all(g in copies for g in self.model.linear_group_ids):
            blocks += [Block(group, spec.state_hash, join(group, 0)) for group in self.model.linear_group_ids]
        return blocks

    def _on_stored(self, spec: PoolStoreSpec, future: Future) -> None:
        if future.cancelled():
            return
        if (exc := future.exception()) is not None:
            self.num_stores_failed += 1
            logger.warning("request %s: storing prompt blocks in the cache pool failed: %s", spec.req_id, exc)
            return
        self.num_tokens_stored += len(spec.blocks) * self.model.block_size

    # Load --------------------------------------------------------------------------------------

    def wait_for_loads(self, timeout_s: float) -> None:
        """Block up to ``timeout_s`` for any Get (an idle engine would otherwise spin); copies already
        issued take microseconds, and the next call sees them done."""
        if self._loads and not self._copying:
            wait_futures([future for _, future in self._loads.values()], timeout_s, return_when="FIRST_COMPLETED")

    def finished_loads(self) -> tuple[set[str], set[str]]:
        """Issue the copies of finished Gets into their blocks; returns the (finished, failed) request
        ids whose copies completed (and were checked) since the last call. Never waits for a copy."""
        finished, failed = self._released, set()
        self._released = set()
        for req_id, (spec, future) in list(self._loads.items()):
            if not future.done():
                continue
            del self._loads[req_id]
            if error := self._apply(spec, future):
                finished.add(req_id)
                self._failed(req_id, error, failed)
            else:
                self._copying[req_id] = (spec, future.result())
        self._loader.poll()
        for req_id, (spec, blocks) in list(self._copying.items()):
            if self._loader.busy(_load_key(req_id)):
                continue
            del self._copying[req_id]
            finished.add(req_id)
            if not all(_intact(block.data) for block in blocks):
                self._failed(req_id, "a block was evicted from the pool while being read", failed)
                continue
            self.num_tokens_loaded += spec.num_blocks * self.model.block_size
            logger.debug("request %s: loaded %d prompt tokens from the cache pool", req_id,
                         spec.num_blocks * self.model.block_size)
        return finished, failed

    def _failed(self, req_id: str, error: str, failed: set[str]) -> None:
        failed.add(req_id)
        self.num_loads_failed += 1
        logger.warning("request %s: cache pool load failed, recomputing: %s", req_id, error)

    def counters(self) -> PoolCounters:
        return PoolCounters(tokens_loaded=self.num_tokens_loaded, tokens_stored=self.num_tokens_stored,
                            loads_failed=self.num_loads_failed, stores_failed=self.num_stores_failed)

    def _refs(self, spec: PoolLoadSpec) -> list[tuple[int, bytes]]:
        refs = [(group, spec.block_hashes[i]) for i in range(spec.first_block, len(spec.block_hashes))
                for group in self.model.full_group_ids]
        return refs + [(group, spec.block_hashes[-1]) for group in self.model.linear_group_ids]

    def _apply(self, spec: PoolLoadSpec, future: Future) -> str | None:
        """Issue the copies of a Get's blocks into the request's blocks; an error text instead of
        raising (then nothing was copied)."""
        if future.cancelled():
            return "cancelled"
        if (exc := future.exception()) is not None:
            return str(getattr(exc, "details", lambda: exc)() or exc)
        blocks = future.result()
        refs = self._refs(spec)
        if [(b.group_id, b.block_hash) for b in blocks] != refs:
            return "the pool returned other blocks than asked for"
        targets = [spec.block_ids[g][i] for i in range(spec.first_block, len(spec.block_hashes))
                   for g in self.model.full_group_ids]
        end = len(spec.block_hashes) * self.model.block_size
        targets += [self._state_page(spec.block_ids, g, end) for g in self.model.linear_group_ids]
        for block, target in zip(blocks, targets):
            if error := self._check(block, target):
                return error
        self._pin_arenas(blocks)
        for block, target in zip(blocks, targets):
            self._write(spec.req_id, block, target)
        return None

    def _check(self, block: Block, target: int) -> str | None:
        if target == NULL_BLOCK:
            return f"no block allocated for group {block.group_id}"
        expected = sum(self.layout.payload_bytes(layer, 1) for layer in self._layers(block.group_id))
        if len(block.data) != expected:
            return f"a block of group {block.group_id} has {len(block.data)} bytes, this engine's has {expected}"
        return None

    def _write(self, req_id: str, block: Block, target: int) -> None:
        offset = 0
        for layer in self._layers(block.group_id):
            size = self.layout.payload_bytes(layer, 1)
            self._loader.write(_load_key(req_id), self.layout.caches[layer.name], layer.block_dim,
                               memoryview(_span(block.data, offset, offset + size)), [0], [target])
            offset += size

    def _pin_arenas(self, blocks: list[Block]) -> None:
        """On CUDA, register the pool's arena as pinned memory the first time a Get comes through it
        (a restarted pool maps a new one), so its blocks go to the device in one DMA each."""
        if not self._device.is_cuda:
            return
        for block in blocks:
            mapping = getattr(block.data, "mapping", None)
            if mapping is not None and mapping.address not in self._arenas:
                region = PinnedRegion(self._device, mapping.address, mapping.size)
                self._arenas[mapping.address] = region
                self._loader.pinned.append(region)

    def _state_page(self, block_ids, group: int, num_tokens: int) -> int:
        return state_block_at(block_ids[group], num_tokens, self.layout.block_size[group])

    def _layers(self, group: int) -> list[LayerInfo]:
        return sorted((info for info in self.layout.layers.values() if info.group == group), key=lambda i: i.index)


def _load_key(req_id: str) -> str:
    return f"pool:{req_id}"


def _join(copies: list[tuple[LayerInfo, torch.Tensor]], k: int, device: Device, ready) -> Pieces:
    """Block ``k`` of each layer's copy, as views of the copies (no bytes are joined)."""
    return Pieces(tuple(piece for layer, tensor in copies
                        for piece in _block_pieces(tensor, layer.block_dim, k, device, ready)))


def _block_pieces(tensor: torch.Tensor, block_dim: int, k: int, device: Device, ready) -> list:
    """Block ``k`` of a contiguous copy, in the order ``extract`` lays it out: contiguous uint8 arrays
    on CPU, pieces the pool client copies out of the device (after ``ready``) on CUDA."""
    rows = [tensor[k]] if block_dim == 0 else [tensor[j, k] for j in range(tensor.shape[0])]
    if device.is_cuda:
        return [DevicePiece(row, ready, device) for row in rows]
    return [row.reshape(-1).view(torch.uint8).numpy() for row in rows]


def _span(data, start: int, stop: int):
    """Bytes [start, stop) of a Get's block: a view of its arena slots, or of its bytes."""
    return data.view(start, stop) if hasattr(data, "intact") else memoryview(data)[start:stop]


def _intact(data) -> bool:
    return data.intact() if hasattr(data, "intact") else True
