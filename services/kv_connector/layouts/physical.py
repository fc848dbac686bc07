"""The physical layout of a registered KV cache tensor, as vLLM 0.32 hands it to a connector.

Every attention layer comes as a 4-D view, logical ``[B, H, N, C]`` (blocks, KV heads, tokens per
block, K and V side by side), strided over one backing buffer in the order ``kv_cache_layout`` names:
token-major ``LBNHC`` (FlashAttention's default on an H100) or head-major ``LBHNC`` (the CPU backend,
or what a connector asks for), ``BL..`` when blocks are outermost across layers. MLA has one latent
per token (H = 1), and a Mamba / Gated-DeltaNet page is ``[B, 1, 1, bytes]`` int8. When the kernel's
block is smaller than the manager's, dim 0 is ``num_blocks * ratio``.

The name and strides go into the transfer fingerprint: the producer's gather copies blocks in the
view's logical order, so two engines exchange pages as they are only when both layouts agree.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

ALIASES = {"NHD": "LBNHC", "HND": "LBHNC"}  # vLLM's legacy names (VLLM_KV_CACHE_LAYOUT accepts both)
STATE = "STATE"  # a Mamba / Gated-DeltaNet state page
MLA = "MLA"      # one latent per token: head order does not exist


@dataclass(frozen=True, slots=True)
class Physical:
    name: str                # LBNHC, LBHNC, BLNHC, BLHNC, MLA or STATE
    kernel_ratio: int        # kernel blocks per manager block (dim 0 = num_blocks * ratio)
    strides: tuple[int, ...]  # of the view, in elements

    @property
    def tag(self) -> str:
        """What the fingerprint says of it: name, kernel ratio and strides, readable in a refusal."""
        ratio = f"x{self.kernel_ratio}" if self.kernel_ratio != 1 else ""
        return f"{self.name}{ratio}{list(self.strides)}"


def detect(tensor: torch.Tensor, num_blocks: int, kind: str = "attention", declared: str | None = None) -> Physical:
    """``kind``: attention, mla or state (from the layer's cache spec); ``declared``: the config's
    ``kv_cache_layout``. Raises ``ValueError`` with the reason when the strides contradict it."""
    if tensor.dim() != 4:
        raise ValueError(f"a KV cache view of shape {tuple(tensor.shape)} is not 4-D [blocks, heads, tokens, content]")
    ratio = _kernel_ratio(tensor.shape[0], num_blocks)
    strides = tuple(tensor.stride())
    if kind == "state" or (tensor.dtype == torch.int8 and tensor.shape[1] == tensor.shape[2] == 1):
        return Physical(STATE, ratio, strides)
    if kind == "mla":
        return Physical(MLA, ratio, strides)
    name = _name(tensor)
    wanted = ALIASES.get(declared or "", declared)
    if wanted and tensor.shape[1] > 1 and name != wanted:
        raise ValueError(f"kv_cache_layout {declared} but the strides {list(strides)} of shape "
                         f"{list(tensor.shape)} are {name}")
    if tensor.shape[1] == 1 and wanted:  # one head: NHD and HND are the same bytes; take the config's word
        name = wanted
    return Physical(name, ratio, strides)


def mismatch(theirs: str, ours: str) -> str | None:
    """Why a producer's fingerprint tags (``layout_tags``) do not match this engine's; None when they do."""
    if theirs == ours:
        return None
    return (f"the producer's KV cache is laid out as {theirs or 'unknown'}, this engine's as {ours or 'unknown'}: "
            "pages cannot be copied as they are")


def layout_tags(physical: dict[str, Physical]) -> str:
    """The distinct tags of a rank's layers, in first-seen order (the readable part of a fingerprint)."""
    return ",".join(dict.fromkeys(p.tag for p in physical.values()))


def _kernel_ratio(dim0: int, num_blocks: int) -> int:
    if num_blocks <= 0 or dim0 % num_blocks:
        raise ValueError(f"dim 0 of the KV cache view ({dim0}) is not a multiple of the {num_blocks} blocks")
    return dim0 // num_blocks


def _name(tensor: torch.Tensor) -> str:
    """Orders B, H, N (C innermost) by stride; blocks strided past their own page belong to a
    block-outermost buffer (``BL..``: the layers of one block sit together)."""
    b, h, n, c = tensor.stride()
    if c != 1:
        raise ValueError(f"the content dim of a KV cache view is not contiguous (strides {list(tensor.stride())})")
    heads_outer = h >= n * tensor.shape[2] if tensor.shape[1] > 1 else True
    page = tensor.shape[1] * tensor.shape[2] * tensor.shape[3]
    prefix = "BL" if b > page else "LB"
    return prefix + ("HNC" if heads_outer else "NHC")
