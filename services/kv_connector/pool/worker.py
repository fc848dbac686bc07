"""Worker side of the cache-pool integration: copies prompt blocks out to the cluster's pool and loads
them back in. Every method runs on the engine thread; the pool I/O runs on ``PoolIO``'s thread.

Stores gather the step's new blocks right after the forward (``store``, from ``wait_for_save``), on
the compute stream, so vLLM may reuse them at once; the Put happens in the background and copies
each block of each layer straight from that copy into the pool's arena (``Pieces``: never joined
into ``bytes``; on CUDA ``pool.copies.DeviceRows``: one device-to-host DMA per contiguous run of the
arena, registered as pinned memory), and a failed Put is logged and counted, nothing more. Loads Get in the
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

from services.cache_pool_client.arena_client import ArenaView, intact
from services.cache_pool_client.types import Block, Pieces
from services.kv_connector.device import DEFAULT_SLOT_BYTES
from services.kv_connector.device.consumer import BlockLoader
from services.kv_connector.device.streams import Device
from services.kv_connector.pool.copies import DeviceRows, PinnedRegion
from services.kv_connector.layouts.pages import NULL_BLOCK, KVLayout, LayerInfo, state_block_at
from services.kv_connector.metadata import PoolLoadSpec, PoolStoreSpec, PrfaasConnectorMetadata
from services.kv_connector.pool.io import PoolModel, failure_text
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
        self._arena: PinnedRegion | None = None  # the pool's arena, pinned (the I/O thread's to change)
        self._loads: dict[str, tuple[PoolLoadSpec, Future]] = {}
        self._copying: dict[str, tuple[PoolLoadSpec, list[Block]]] = {}  # loads whose copies may still run
        self._released: set[str] = set()
        self._stores: list[PoolStoreSpec] = []
        self.num_tokens_loaded = 0
        self.num_tokens_stored = 0
        self.num_loads_failed = 0
        self.num_stores_failed = 0

    def register_kv_caches(self, layout: KVLayout, device: Device, slot_bytes: int = DEFAULT_SLOT_BYTES) -> None:
        """The engine's paged cache and its device facade; ``slot_bytes``: the most bytes one batch
        of copies in holds (at least one block of any layer). From now on the pool's I/O thread pins
        each arena it meets (``_pin_arena``), so neither stores nor loads register it on this thread."""
        self.layout = layout
        self._device = device
        largest = max((layout.payload_bytes(layer, 1) for layer in layout.layers.values()), default=0)
        self._loader = BlockLoader(device, max(slot_bytes, largest))
        if device.is_cuda:
            self._io.watch_arena(self._pin_arena)

    def close(self) -> None:
        """After the copies in flight (the arena's registration goes once nothing reads it)."""
        if self._loader is not None:
            self._loader.close()
        if self._arena is not None:
            self._arena.close()
            self._arena = None

    def _pin_arena(self, address: int, size: int) -> None:
        """On the pool's I/O thread, before a Put or Get goes through the arena at ``address``: pin it
        the first time (a restarted pool maps a new one: the old one's registration is undone), so
        both directions are single DMAs and no step waits for the registration."""
        if self._arena is not None and self._arena.address == address:
            return
        self._device.bind_thread()
        old, self._arena = self._arena, PinnedRegion(self._device, address, size)
        self._loader.pinned = [self._arena]
        if old is not None:
            old.close()

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

    def _copy_out(self, spec: PoolStoreSpec) -> dict[int, torch.Tensor]:
        """Per group, the step's blocks gathered block-major: row k holds block k of every layer of the
        group, in layer order (a pool block's bytes), so each block leaves the device as one run."""
        copies = {}
        for group in self.model.full_group_ids:
            ids = [spec.block_ids[group][i] for i, _ in spec.blocks]
            if ids:
                copies[group] = self._gather_rows(group, ids)
        for group in self.model.linear_group_ids if spec.state_hash else ():
            page = self._state_page(spec.block_ids, group, spec.end)
            if page != NULL_BLOCK:
                copies[group] = self._gather_rows(group, [page])
        return copies

    def _gather_rows(self, group: int, ids: list[int]) -> torch.Tensor:
        layers = self._layers(group)
        index = self._device.index(ids)
        rows = torch.empty(len(ids), sum(self.layout.payload_bytes(layer, 1) for layer in layers), dtype=torch.uint8,
                           device=self.layout.caches[layers[0].name].device)
        offset = 0
        for layer in layers:
            size = self.layout.payload_bytes(layer, 1)
            blocks = self.layout.caches[layer.name].index_select(layer.block_dim, index).movedim(layer.block_dim, 0)
            rows[:, offset:offset + size].copy_(blocks.reshape(len(ids), -1).view(torch.uint8))
            offset += size
        return rows

    def _blocks(self, spec: PoolStoreSpec, copies: dict[int, torch.Tensor], ready) -> list[Block]:
        """Runs on the I/O thread. In prompt order: each block's groups, then the state at the end. On
        CUDA each block is one ``DevicePiece`` of its group's batch (one copy per contiguous arena run)."""
        batches = {group: DeviceRows(rows, ready, self._device) for group, rows in copies.items()}

        def piece(group: int, k: int) -> Pieces:
            return Pieces((batches[group].row(k) if self._device.is_cuda else copies[group][k].numpy(),))

        blocks = [Block(group, block_hash, piece(group, k))
                  for k, (_, block_hash) in enumerate(spec.blocks) for group in self.model.full_group_ids
                  if group in copies]
        if spec.state_hash and all(g in copies for g in self.model.linear_group_ids):
            blocks += [Block(group, spec.state_hash, piece(group, 0)) for group in self.model.linear_group_ids]
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
            if not all(intact(block.data) for block in blocks):
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
            return failure_text(exc)
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

    def _state_page(self, block_ids, group: int, num_tokens: int) -> int:
        return state_block_at(block_ids[group], num_tokens, self.layout.block_size[group])

    def _layers(self, group: int) -> list[LayerInfo]:
        return sorted((info for info in self.layout.layers.values() if info.group == group), key=lambda i: i.index)


def _load_key(req_id: str) -> str:
    return f"pool:{req_id}"


def _span(data, start: int, stop: int):
    """Bytes [start, stop) of a Get's block: a view of its arena slots, or of its bytes."""
    return data.view(start, stop) if isinstance(data, ArenaView) else memoryview(data)[start:stop]
