"""Builds a rank's ``LayoutSpec`` from what vLLM gives a connector: the ``KVCacheConfig`` (per group,
an attention spec or a ``MambaSpec`` with this rank's state shapes) and the registration order of the
layers. Reads the specs' attributes only (no vLLM import), so tests pass plain objects.

Totals come from the rank's local shapes times the TP size, as vLLM's NIXL connector derives them
(``ssm_conv_transfer_utils.derive_mamba_conv_split``), except where vLLM replicates: attention KV
heads (pass the model's total) and Mamba2 groups (pass ``mamba_groups`` when TP may exceed them).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from services.kv_connector.layouts.spec import (CPU_AMX, CPU_K_TRANSPOSED, CPU_KERNEL_PREFIX, TOKEN_ROWS,
                                                AttentionLayer, Layer, LayoutSpec, LinearLayer, Sharded)


def spec_from_vllm(model: str, kv_cache_config: Any, layer_names: Sequence[str], tp_rank: int, tp_size: int,
                   total_kv_heads: int, conv_layout: str = "SD", mamba_groups: int | None = None,
                   cache_layout: str = "") -> LayoutSpec:
    """``layer_names`` in ``register_kv_caches`` order; ``conv_layout`` is vLLM's
    ``get_conv_state_layout()``; ``total_kv_heads`` the model's ``get_total_num_kv_heads()``;
    ``cache_layout`` the attention cache's memory layout (see ``with_cache_layout``)."""
    groups = list(kv_cache_config.kv_cache_groups)
    group_of = {name: g for g, group in enumerate(groups) for name in group.layer_names}
    specs = [group.kv_cache_spec for group in groups]
    layers: list[Layer] = []
    dtype = None
    for name in layer_names:
        if name not in group_of:
            continue
        spec = specs[group_of[name]]
        if hasattr(spec, "num_kv_heads"):
            layers.append(_attention(name, group_of[name], spec, tp_size, total_kv_heads))
            dtype = _dtype(spec.dtype)
        else:
            layers.append(_linear(name, group_of[name], spec, tp_size, conv_layout, mamba_groups))
    if dtype is None:
        raise ValueError("the KV cache config has no attention layer to take the KV dtype from")
    return LayoutSpec(model, dtype, tp_rank, tp_size, tuple(spec.block_size for spec in specs), tuple(layers),
                      cache_layout)


# vLLM CPU attention kernels (by ISA) whose cache layout ``apply`` reads; checked against the kernel
# by tests/unit/test_layout_apply.py. Other kernels (neon, vsx, ...) announce ``cpu-<isa>``: unmapped.
KERNEL_LAYOUTS = {"vec": CPU_K_TRANSPOSED, "vec16": CPU_K_TRANSPOSED, "amx": CPU_AMX}
ROW_VIEWS = ("LBNHC", "LBHNC", "BLNHC", "BLHNC")  # ``physical`` names of a plain strided [B, H, N, C] view


def cpu_kernel_layout(dtype: str, block_size: int, head_size: int, cache_dtype: str = "auto") -> str:
    """The cache layout of the CPU attention kernel vLLM picks on this host for a KV dtype, block
    size and head size (``cpu_attn._get_attn_isa``: ``amx`` on hosts with AMX tiles for bfloat16 and
    blocks of a multiple of 32 tokens, else ``vec`` or ``vec16`` on x86): a ``KERNEL_LAYOUTS`` entry,
    or ``cpu-<isa>`` for a kernel whose layout is not mapped here. Raises ``NotImplementedError`` where
    vLLM has no kernel for it (an FP8 cache on a host without AVX-512)."""
    import torch
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    isa = _get_attn_isa(getattr(torch, dtype), block_size, head_size, cache_dtype)
    return KERNEL_LAYOUTS.get(isa, f"{CPU_KERNEL_PREFIX}{isa}")


def engine_cache_layout(kv_cache_config: Any, cache_dtype: str = "auto") -> str:
    """What ``KVLayout`` and the cache pool's keys name an engine's attention cache layout by, before
    its tensors exist: on the CPU platform the kernel's (``cpu_kernel_layout`` of the first attention
    group), elsewhere ``""`` (a GPU backend's layout shows in its registered strides instead)."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return ""
    for group in kv_cache_config.kv_cache_groups:
        spec = group.kv_cache_spec
        specs = list(getattr(spec, "kv_cache_specs", {}).values()) or [spec]
        attention = next((s for s in specs if hasattr(s, "num_kv_heads")), None)
        if attention is not None:
            try:
                return cpu_kernel_layout(_dtype(attention.dtype), attention.block_size, attention.head_size,
                                         cache_dtype)
            except (ImportError, NotImplementedError, RuntimeError, AttributeError):
                return ""
    return ""


def with_cache_layout(spec: LayoutSpec, cache_dtype: str = "auto", physical: dict | None = None) -> LayoutSpec:
    """``spec`` naming the attention cache layout its engine uses. On the CPU platform the KV dtype and
    the first attention layer's head and block size choose vLLM's kernel (``cpu_kernel_layout``).
    Elsewhere ``TOKEN_ROWS`` when every attention layer's registered view (``physical``:
    ``KVLayout.physical``) is a plain strided ``[B, H, N, C]`` (LBNHC, LBHNC or their block-outermost
    forms, one kernel block per block), as vLLM 0.32's GPU backends register it; unchanged (unknown)
    otherwise (MLA, split kernel blocks, no view to judge)."""
    from vllm.platforms import current_platform

    attention = next((layer for layer in spec.layers if isinstance(layer, AttentionLayer)), None)
    if attention is None:
        return spec
    if not current_platform.is_cpu():
        return replace(spec, cache_layout=TOKEN_ROWS) if token_rows(spec, physical) else spec
    try:
        layout = cpu_kernel_layout(spec.dtype, spec.block_sizes[attention.group], attention.head_size, cache_dtype)
    except (ImportError, NotImplementedError, RuntimeError):
        return spec
    return replace(spec, cache_layout=layout)


def token_rows(spec: LayoutSpec, physical: dict | None) -> bool:
    """Whether every attention layer of ``spec`` is registered as a strided ``[B, H, N, C]`` view with
    each token's K then V in C (what ``TOKEN_ROWS`` names), judged from ``physical`` (by layer name)."""
    names = [layer.name for layer in spec.layers if isinstance(layer, AttentionLayer)]
    if not physical or not names:
        return False
    return all(name in physical and physical[name].name in ROW_VIEWS and physical[name].kernel_ratio == 1
               for name in names)


def _attention(name: str, group: int, spec: Any, tp_size: int, total_kv_heads: int) -> AttentionLayer:
    head_size_v = getattr(spec, "head_size_v", None)
    if head_size_v not in (None, spec.head_size):
        raise ValueError(f"layer {name}: K and V head sizes differ ({spec.head_size}, {head_size_v})")
    kv = Sharded("kv_heads", total_kv_heads, spec.head_size, spec.num_kv_heads)
    return AttentionLayer(name, group, kv, getattr(spec, "sliding_window", None))


def _linear(name: str, group: int, spec: Any, tp_size: int, conv_layout: str, mamba_groups: int | None) -> LinearLayer:
    kind = getattr(spec.mamba_type, "name", str(spec.mamba_type)).upper()
    conv_shape, temporal_shape = spec.shapes[0], spec.shapes[1]
    state_len, conv_dim = conv_shape if conv_layout == "SD" else reversed(conv_shape)
    if kind == "GDN_ATTN":
        conv, temporal = _gdn_parts(conv_dim, temporal_shape, tp_size)
    elif kind == "MAMBA2":
        conv, temporal = _mamba2_parts(conv_dim, temporal_shape, tp_size, mamba_groups)
    elif kind == "MAMBA1":
        conv = (Sharded("x", conv_dim * tp_size, 1, conv_dim),)
        temporal = Sharded("ssm", temporal_shape[0] * tp_size, temporal_shape[1], temporal_shape[0])
    else:
        raise ValueError(f"layer {name}: no conv-state decomposition for mamba type {kind}")
    return LinearLayer(name, group, conv, state_len, temporal, tuple(temporal_shape[1:]), _dtype(spec.dtypes[0]),
                       _dtype(spec.dtypes[1]), spec.page_size_bytes, conv_layout)


def _gdn_parts(conv_dim: int, temporal_shape: Any, tp_size: int) -> tuple[tuple[Sharded, ...], Sharded]:
    """Gated DeltaNet: conv = [query-key, key, value], temporal (v heads, v dim, k dim)."""
    v_heads, v_dim, k_dim = temporal_shape
    key_dim = (conv_dim - v_heads * v_dim) // 2
    if key_dim <= 0 or key_dim % k_dim or 2 * key_dim + v_heads * v_dim != conv_dim:
        raise ValueError(f"GDN conv dim {conv_dim} is not 2 x key + {v_heads} x {v_dim} value channels")
    k_heads = key_dim // k_dim
    conv = (Sharded("query_key", k_heads * tp_size, k_dim, k_heads), Sharded("key", k_heads * tp_size, k_dim, k_heads),
            Sharded("value", v_heads * tp_size, v_dim, v_heads))
    return conv, Sharded("ssm", v_heads * tp_size, v_dim * k_dim, v_heads)


def _mamba2_parts(conv_dim: int, temporal_shape: Any, tp_size: int,
                  mamba_groups: int | None) -> tuple[tuple[Sharded, ...], Sharded]:
    """Mamba2: conv = [x, B, C], temporal (heads, head dim, state size); B and C hold groups of
    ``state size`` channels, replicated when TP exceeds the groups."""
    heads, head_dim, state_size = temporal_shape
    bc_dim = (conv_dim - heads * head_dim) // 2
    if bc_dim <= 0 or bc_dim % state_size or 2 * bc_dim + heads * head_dim != conv_dim:
        raise ValueError(f"Mamba2 conv dim {conv_dim} is not {heads} x {head_dim} + 2 x groups x {state_size}")
    local_groups = bc_dim // state_size
    groups = mamba_groups or local_groups * tp_size
    conv = (Sharded("x", heads * tp_size, head_dim, heads), Sharded("B", groups, state_size, local_groups),
            Sharded("C", groups, state_size, local_groups))
    return conv, Sharded("ssm", heads * tp_size, head_dim * state_size, heads)


def _dtype(dtype: Any) -> str:
    return str(dtype).removeprefix("torch.")
