"""Where a request's KV lives in one engine's paged cache, and how to copy it in and out.

Built from vLLM's ``KVCacheConfig`` and the tensors given to ``register_kv_caches``. Layers are
numbered in registration order, which is identical on producer and consumer for the same model.
Attention groups hold one block per ``block_size`` tokens; state groups (Mamba / Gated-DeltaNet)
hold fixed-size state pages, each valid only at the exact position it was taken: one page per request
with prefix caching off, one entry per block position (mostly null) in vLLM's ``align`` mode.
"""
from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass

import torch

from services.kv_connector.device.streams import Device
from services.kv_connector.layouts.physical import Physical, detect, layout_tags

logger = logging.getLogger(__name__)

NULL_BLOCK = 0


@dataclass(frozen=True, slots=True)
class LayerInfo:
    index: int
    name: str
    group: int
    block_dim: int


class KVLayout:
    """``cache_layout``: the attention kernel's cache layout where the registered strides do not show
    it (``from_vllm.engine_cache_layout``: vLLM's CPU kernels store different layouts in tensors of
    one shape), part of the fingerprint."""

    def __init__(self, kv_cache_config, kv_caches: dict[str, torch.Tensor], cache_layout: str = "") -> None:
        num_blocks = kv_cache_config.num_blocks
        group_of = {name: g for g, group in enumerate(kv_cache_config.kv_cache_groups) for name in group.layer_names}
        specs = [group.kv_cache_spec for group in kv_cache_config.kv_cache_groups]
        declared = getattr(kv_cache_config, "kv_cache_layout", None)
        self.physical = {name: _physical(tensor, num_blocks, specs[group_of[name]], declared)
                         for name, tensor in kv_caches.items() if name in group_of}
        self.caches = {name: _manager_blocks(tensor, self.physical.get(name), num_blocks)
                       for name, tensor in kv_caches.items()}
        kv_caches = self.caches
        self.layers = {name: LayerInfo(i, name, group_of[name], _block_dim(tensor, num_blocks))
                       for i, (name, tensor) in enumerate(kv_caches.items()) if name in group_of}
        self.by_index = {info.index: info for info in self.layers.values()}
        self.is_state_group = tuple(not hasattr(spec, "num_kv_heads") for spec in specs)
        self.block_size = tuple(spec.block_size for spec in specs)
        self.state_layers = tuple(info for info in self.layers.values() if self.is_state_group[info.group])
        self.cache_layout = cache_layout
        self.fingerprint = _fingerprint(kv_caches, self.layers, self.physical, cache_layout)

    def extract(self, layer: LayerInfo, block_ids: list[int]) -> torch.Tensor:
        """A contiguous copy of ``block_ids`` of ``layer`` in host memory (safe to send after the
        blocks are freed)."""
        return self.gather(layer, block_ids).cpu()

    def gather(self, layer: LayerInfo, block_ids: list[int], device: Device | None = None) -> torch.Tensor:
        """A contiguous copy of ``block_ids`` of ``layer`` where the cache lives (on CUDA enqueued on
        the current stream with no host wait: in order after the forward, and before any later write
        to the blocks; ``device``: the cache's facade)."""
        tensor = self.caches[layer.name]
        index = (device or Device(tensor.device)).index(block_ids)
        return tensor.index_select(layer.block_dim, index).contiguous()

    def write_some(self, layer: LayerInfo, block_ids: list[int | None], keep: list[int],
                   payload: memoryview) -> None:
        """Copy blocks ``keep`` of ``payload`` (as ``extract`` produced it on an identical layout)
        into ``block_ids[k]`` for each k in ``keep``."""
        tensor = self.caches[layer.name]
        shape = list(tensor.shape)
        shape[layer.block_dim] = len(block_ids)
        source = torch.frombuffer(payload, dtype=torch.uint8).view(tensor.dtype).view(shape)
        if len(keep) != len(block_ids):
            source = source.index_select(layer.block_dim, torch.tensor(keep, dtype=torch.long))
        index = torch.tensor([block_ids[k] for k in keep], dtype=torch.long, device=tensor.device)
        tensor.index_copy_(layer.block_dim, index, source.to(tensor.device))

    def payload_bytes(self, layer: LayerInfo, num_blocks: int) -> int:
        tensor = self.caches[layer.name]
        return tensor.numel() // tensor.shape[layer.block_dim] * num_blocks * tensor.element_size()


def state_block(block_ids: tuple[int, ...]) -> int:
    """A state group's live page: the last non-null block id (align mode keeps one per position)."""
    return next((b for b in reversed(block_ids) if b != NULL_BLOCK), NULL_BLOCK)


def state_block_at(block_ids: tuple[int, ...], num_tokens: int, block_size: int) -> int:
    """A state group's page for the state after ``num_tokens`` tokens. In Mamba ``align`` mode (vLLM's
    prefix caching on) a group has one entry per ``block_size`` tokens, and the state at a block-aligned
    ``num_tokens`` is at position ``num_tokens / block_size - 1``: where a step that ends there wrote it,
    and where vLLM's first step of a request with ``num_tokens`` loaded tokens reads it (then copies it on
    to the step's running page). Otherwise, the live page (one per request with prefix caching off)."""
    position = num_tokens // block_size - 1
    if num_tokens % block_size == 0 and 0 <= position < len(block_ids) and block_ids[position] != NULL_BLOCK:
        return block_ids[position]
    return state_block(block_ids)


def _physical(tensor: torch.Tensor, num_blocks: int, spec, declared: str | None) -> Physical:
    """The layer's physical layout; one the strides cannot name is described by its strides alone."""
    kind = "state" if not hasattr(spec, "num_kv_heads") else "mla" if "MLA" in type(spec).__name__ else "attention"
    try:
        return detect(tensor, num_blocks, kind, declared)
    except ValueError as error:
        if tensor.dim() == 4:
            logger.warning("KV cache layout: %s", error)
        return Physical("strided", 1, tuple(tensor.stride()))


def _manager_blocks(tensor: torch.Tensor, physical: Physical | None, num_blocks: int) -> torch.Tensor:
    """With kernel blocks smaller than the manager's (dim 0 = num_blocks * ratio), a view whose dim 0
    is the manager's block: its kernel blocks are adjacent, so a block id indexes them all."""
    if physical is None or physical.kernel_ratio == 1 or tensor.shape[0] != num_blocks * physical.kernel_ratio:
        return tensor
    return tensor.unflatten(0, (num_blocks, physical.kernel_ratio))


def _block_dim(tensor: torch.Tensor, num_blocks: int) -> int:
    for dim in (0, 1):
        if tensor.shape[dim] == num_blocks:
            return dim
    raise ValueError(f"cannot find the block dimension of a KV cache tensor of shape {tuple(tensor.shape)}")


SPEC_FIELDS = ("block_size", "num_kv_heads", "head_size", "head_size_v", "dtype", "kv_quant_mode", "sliding_window",
               "shapes", "dtypes", "mamba_type", "page_size_bytes",
               "kv_cache_specs")


def spec_fingerprint(kv_cache_config, cache_layout: str = "") -> str:
    """The per-block layout as the scheduler sees it (no tensors yet): per group, its spec kind, block
    size, dtype, heads, head size, state shapes, page size and layer names, and the cache layout
    (``kv_cache_layout``, and ``cache_layout``: the CPU kernel's, ``KVLayout``). Part of every
    cache-pool key, so engines whose blocks differ never read each other's bytes."""
    digest = hashlib.sha256(f"{getattr(kv_cache_config, 'kv_cache_layout', None)};".encode())
    if cache_layout:
        digest.update(f"kernel:{cache_layout};".encode())
    for group_id, group in enumerate(kv_cache_config.kv_cache_groups):
        spec = group.kv_cache_spec
        values = {name: getattr(spec, name) for name in SPEC_FIELDS if hasattr(spec, name)}
        digest.update(f"{group_id}:{type(spec).__name__}:{values}:{list(group.layer_names)};".encode())
    return digest.hexdigest()[:16]


def _fingerprint(kv_caches: dict[str, torch.Tensor], layers: dict[str, LayerInfo],
                 physical: dict[str, Physical], cache_layout: str = "") -> str:
    """Equal on two engines exactly when their per-block layouts match (checked before a transfer):
    a digest of the layers' shapes, dtypes, physical layouts and the kernel's cache layout, then ``@``
    and the physical layouts in words, the kernel's after a ``/`` (so that a refusal can say how they
    differ)."""
    digest = hashlib.sha256(f"kernel:{cache_layout};".encode() if cache_layout else b"")
    for name, info in layers.items():
        shape = list(kv_caches[name].shape)
        shape[info.block_dim] = -1
        digest.update(f"{info.index}:{name}:{info.group}:{info.block_dim}:{shape}:{kv_caches[name].dtype}:"
                      f"{physical[name].tag};".encode())
    return f"{digest.hexdigest()[:16]}@{layout_tags(physical)}" + (f"/{cache_layout}" if cache_layout else "")
