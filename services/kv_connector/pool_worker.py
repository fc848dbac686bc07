"""Worker side of the cache-pool integration: copies prompt blocks out to the cluster's pool and loads
them back in. Every method runs on the engine thread; the pool I/O runs on ``PoolIO``'s thread.

Stores copy the step's new blocks right after the forward (``store``, from ``wait_for_save``), so
vLLM may reuse them at once (on a GPU this is the copy to host memory anyway); the Put happens in the
background and copies those tensors' bytes straight into the pool's arena (``Pieces``, one per layer:
never joined into ``bytes``), and a failed Put is logged and counted, nothing more. Loads Get in the
background and are copied between forwards (``finished_loads``) straight from the arena's slots into
the request's blocks, then checked (a block evicted while being copied fails the load); a failed or
malformed Get is reported as a failed receive, so vLLM recomputes the prompt. A pool block holds, for
one group, the bytes of every layer of that group for one block (full attention) or its state page
(recurrent state), in layer order.
"""
from __future__ import annotations

import logging
from concurrent.futures import Future
from concurrent.futures import wait as wait_futures

import torch

from services.cache_pool_client.types import Block, Pieces
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
        self._loads: dict[str, tuple[PoolLoadSpec, Future]] = {}
        self._released: set[str] = set()
        self._stores: list[PoolStoreSpec] = []
        self.num_tokens_loaded = 0
        self.num_tokens_stored = 0
        self.num_loads_failed = 0
        self.num_stores_failed = 0

    def on_metadata(self, meta: PrfaasConnectorMetadata) -> None:
        for spec in meta.pool_loads:
            self._loads[spec.req_id] = (spec, self._io.start_get(self.key, self._refs(spec)))
        for req_id in meta.pool_abandoned:
            if (load := self._loads.pop(req_id, None)) is not None:
                load[1].cancel()
                self._released.add(req_id)  # vLLM frees the blocks once the load is reported finished
        self._stores = meta.pool_stores

    # Store -------------------------------------------------------------------------------------

    def store(self) -> None:
        """After the forward: copy this step's new blocks and Put them in the background."""
        stores, self._stores = self._stores, []
        for spec in stores:
            copies = self._copy_out(spec)
            future = self._io.start_put(self.key, lambda spec=spec, copies=copies: self._blocks(spec, copies))
            future.add_done_callback(lambda f, spec=spec: self._on_stored(spec, f))

    def _copy_out(self, spec: PoolStoreSpec) -> dict[int, list[tuple[LayerInfo, torch.Tensor]]]:
        copies = {}
        for group in self.model.full_group_ids:
            ids = [spec.block_ids[group][i] for i, _ in spec.blocks]
            if ids:
                copies[group] = [(layer, self.layout.extract(layer, ids)) for layer in self._layers(group)]
        for group in self.model.linear_group_ids if spec.state_hash else ():
            page = self._state_page(spec.block_ids, group, spec.end)
            if page != NULL_BLOCK:
                copies[group] = [(layer, self.layout.extract(layer, [page])) for layer in self._layers(group)]
        return copies

    def _blocks(self, spec: PoolStoreSpec, copies) -> list[Block]:
        """Runs on the I/O thread. In prompt order: each block's groups, then the state at the end."""
        blocks = [Block(group, block_hash, _join(copies[group], k))
                  for k, (_, block_hash) in enumerate(spec.blocks) for group in self.model.full_group_ids
                  if group in copies]
        if spec.state_hash and all(g in copies for g in self.model.linear_group_ids):
            blocks += [Block(group, spec.state_hash, _join(copies[group], 0)) for group in self.model.linear_group_ids]
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
        """Block up to ``timeout_s`` for any load (an idle engine would otherwise spin)."""
        if self._loads:
            wait_futures([future for _, future in self._loads.values()], timeout_s, return_when="FIRST_COMPLETED")

    def finished_loads(self) -> tuple[set[str], set[str]]:
        """Write completed loads into their blocks; returns (finished, failed) request ids."""
        finished, failed = self._released, set()
        self._released = set()
        for req_id, (spec, future) in list(self._loads.items()):
            if not future.done():
                continue
            del self._loads[req_id]
            finished.add(req_id)
            if error := self._apply(spec, future):
                failed.add(req_id)
                self.num_loads_failed += 1
                logger.warning("request %s: cache pool load failed, recomputing: %s", req_id, error)
            else:
                self.num_tokens_loaded += spec.num_blocks * self.model.block_size
                logger.debug("request %s: loaded %d prompt tokens from the cache pool", req_id,
                             spec.num_blocks * self.model.block_size)
        return finished, failed

    def counters(self) -> PoolCounters:
        return PoolCounters(tokens_loaded=self.num_tokens_loaded, tokens_stored=self.num_tokens_stored,
                            loads_failed=self.num_loads_failed, stores_failed=self.num_stores_failed)

    def _refs(self, spec: PoolLoadSpec) -> list[tuple[int, bytes]]:
        refs = [(group, spec.block_hashes[i]) for i in range(spec.first_block, len(spec.block_hashes))
                for group in self.model.full_group_ids]
        return refs + [(group, spec.block_hashes[-1]) for group in self.model.linear_group_ids]

    def _apply(self, spec: PoolLoadSpec, future: Future) -> str | None:
        """Copy a Get's blocks into the request's blocks; an error text instead of raising."""
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
        for block, target in zip(blocks, targets):
            self._write(block, target)
        if not all(_intact(block.data) for block in blocks):
            return "a block was evicted from the pool while being read"
        return None

    def _check(self, block: Block, target: int) -> str | None:
        if target == NULL_BLOCK:
            return f"no block allocated for group {block.group_id}"
        expected = sum(self.layout.payload_bytes(layer, 1) for layer in self._layers(block.group_id))
        if len(block.data) != expected:
            return f"a block of group {block.group_id} has {len(block.data)} bytes, this engine's has {expected}"
        return None

    def _write(self, block: Block, target: int) -> None:
        offset = 0
        for layer in self._layers(block.group_id):
            size = self.layout.payload_bytes(layer, 1)
            self.layout.write_some(layer, [target], [0], _span(block.data, offset, offset + size))
            offset += size

    def _state_page(self, block_ids, group: int, num_tokens: int) -> int:
        return state_block_at(block_ids[group], num_tokens, self.layout.block_size[group])

    def _layers(self, group: int) -> list[LayerInfo]:
        return sorted((info for info in self.layout.layers.values() if info.group == group), key=lambda i: i.index)


def _join(copies: list[tuple[LayerInfo, torch.Tensor]], k: int) -> Pieces:
    """Block ``k`` of each layer's copy, as views of the copies (no bytes are joined)."""
    return Pieces(tuple(piece for layer, tensor in copies for piece in _block_pieces(tensor, layer.block_dim, k)))


def _block_pieces(tensor: torch.Tensor, block_dim: int, k: int) -> list:
    """Block ``k`` of a contiguous copy as contiguous uint8 arrays, in the order ``extract`` lays it out."""
    rows = [tensor[k]] if block_dim == 0 else [tensor[j, k] for j in range(tensor.shape[0])]
    return [row.reshape(-1).view(torch.uint8).numpy() for row in rows]


def _span(data, start: int, stop: int):
    """Bytes [start, stop) of a Get's block: a view of its arena slots, or of its bytes."""
    return data.view(start, stop) if hasattr(data, "intact") else memoryview(data)[start:stop]


def _intact(data) -> bool:
    return data.intact() if hasattr(data, "intact") else True
