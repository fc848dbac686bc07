"""A rank's ``LayoutSpec`` derived from an engine's configuration, for the layout a worker announces
in its stats (issue 19, negotiation).

The exact ``KVCacheConfig`` exists only inside vLLM's engine-core process; the worker process that
answers ``GetStats`` holds the ``VllmConfig`` (model, cache and parallel configs; after the engine
started, the block sizes the engine core settled on). This module describes, from those configs,
the per-layer cache specs vLLM allocates, and reads them with :func:`spec_from_vllm` as a connector
reads the real ones, so the decomposition of linear-attention states is shared.

What it cannot see: vLLM's KV-cache group ids (here: one group per kind of layer, in order of first
appearance), the attention backend's memory layout (NHD/HND) and the exact padding of state pages
(here: a state page is padded to the attention page, as the hybrid allocator pads it). Two specs built
here are compared with each other only; the per-transfer layout fingerprint remains the backstop.
Describes full and sliding-window attention and Gated DeltaNet (Qwen3-Next) layers; anything else
(MLA, Mamba layers, pipeline parallelism) raises ``ValueError``, and the worker announces no layout.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from services.kv_connector.layouts.spec import DTYPE_BYTES, LayoutSpec
from services.kv_connector.layouts.from_vllm import spec_from_vllm

KV_CACHE_DTYPES = {"fp8": "float8_e4m3fn", "fp8_e4m3": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2",
                   "half": "float16", "float": "float32", "float16": "float16", "bfloat16": "bfloat16",
                   "float32": "float32"}
ATTENTION_TYPES = ("full_attention", "sliding_attention")
GDN_TYPE = "linear_attention"


@dataclass(frozen=True, slots=True)
class AttentionCacheSpec:
    """The attributes of vLLM's ``AttentionSpec`` that ``spec_from_vllm`` reads."""
    block_size: int
    num_kv_heads: int
    head_size: int
    dtype: str
    sliding_window: int | None = None


@dataclass(frozen=True, slots=True)
class StateCacheSpec:
    """The attributes of vLLM's ``MambaSpec`` that ``spec_from_vllm`` reads."""
    block_size: int
    shapes: tuple[tuple[int, ...], ...]
    mamba_type: str
    dtypes: tuple[str, str]
    page_size_bytes: int


@dataclass(frozen=True, slots=True)
class CacheGroup:
    layer_names: tuple[str, ...]
    kv_cache_spec: AttentionCacheSpec | StateCacheSpec


@dataclass(frozen=True, slots=True)
class CacheConfig:
    kv_cache_groups: tuple[CacheGroup, ...]


def spec_from_config(model: str, vllm_config: Any, tp_rank: int = 0, conv_layout: str = "SD",
                     cache_layout: str = "") -> LayoutSpec:
    """``vllm_config``: vLLM's ``VllmConfig`` (or any object with its ``model_config.hf_text_config``,
    ``model_config.dtype``, ``cache_config`` and ``parallel_config`` attributes); ``conv_layout``:
    vLLM's ``get_conv_state_layout()``. Raises ``ValueError`` for what it cannot describe."""
    model_config, parallel = vllm_config.model_config, vllm_config.parallel_config
    hf = model_config.hf_text_config
    tp_size = parallel.tensor_parallel_size
    if getattr(parallel, "pipeline_parallel_size", 1) != 1:
        raise ValueError("pipeline parallelism: a rank's layers are not described")
    if getattr(model_config, "use_mla", False):
        raise ValueError("multi-head latent attention has no layout description")
    kinds = _layer_types(hf)
    attention = _attention_spec(model_config, vllm_config.cache_config, tp_size)
    specs = {kind: _kind_spec(kind, vllm_config, attention, tp_size, conv_layout) for kind in dict.fromkeys(kinds)}
    names = [f"layers.{index}" for index in range(len(kinds))]
    groups = tuple(CacheGroup(tuple(name for name, k in zip(names, kinds) if k == kind), spec)
                   for kind, spec in specs.items())
    return spec_from_vllm(model, CacheConfig(groups), names, tp_rank, tp_size, _total_kv_heads(hf), conv_layout,
                          cache_layout=cache_layout)


def _layer_types(hf: Any) -> list[str]:
    kinds = list(getattr(hf, "layer_types", None) or [ATTENTION_TYPES[0]] * hf.num_hidden_layers)
    if len(kinds) != hf.num_hidden_layers:
        raise ValueError(f"{len(kinds)} layer types for {hf.num_hidden_layers} layers")
    unknown = sorted(set(kinds) - {*ATTENTION_TYPES, GDN_TYPE})
    if unknown:
        raise ValueError(f"layer types {unknown} have no layout description")
    return kinds


def _total_kv_heads(hf: Any) -> int:
    return getattr(hf, "num_key_value_heads", None) or hf.num_attention_heads


def _kind_spec(kind: str, vllm_config: Any, attention: AttentionCacheSpec, tp_size: int,
               conv_layout: str) -> AttentionCacheSpec | StateCacheSpec:
    if kind == GDN_TYPE:
        return _state_spec(vllm_config, attention, tp_size, conv_layout)
    if kind == "sliding_attention":
        return replace(attention, sliding_window=vllm_config.model_config.hf_text_config.sliding_window)
    return attention


def _attention_spec(model_config: Any, cache_config: Any, tp_size: int) -> AttentionCacheSpec:
    hf = model_config.hf_text_config
    head_size = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
    dtype = _kv_cache_dtype(getattr(cache_config, "cache_dtype", "auto"), model_config.dtype)
    return AttentionCacheSpec(cache_config.block_size, max(1, _total_kv_heads(hf) // tp_size), head_size, dtype)


def _state_spec(vllm_config: Any, attention: AttentionCacheSpec, tp_size: int, conv_layout: str) -> StateCacheSpec:
    """A Gated DeltaNet layer's state, shaped as vLLM's ``gated_delta_net_state_shape`` shapes it."""
    hf, cache = vllm_config.model_config.hf_text_config, vllm_config.cache_config
    k_heads, v_heads = hf.linear_num_key_heads, hf.linear_num_value_heads
    k_dim, v_dim = hf.linear_key_head_dim, hf.linear_value_head_dim
    speculative = getattr(vllm_config, "speculative_config", None)
    state_len = hf.linear_conv_kernel_dim - 1 + (speculative.num_speculative_tokens if speculative else 0)
    conv_dim = _divide(2 * k_heads * k_dim + v_heads * v_dim, tp_size, "GDN conv channels")
    conv_shape = (state_len, conv_dim) if conv_layout == "SD" else (conv_dim, state_len)
    temporal_shape = (_divide(v_heads, tp_size, "GDN value heads"), v_dim, k_dim)
    model_dtype = vllm_config.model_config.dtype
    conv_dtype = _kv_cache_dtype(getattr(cache, "mamba_cache_dtype", "auto"), model_dtype)
    ssm_setting = getattr(cache, "mamba_ssm_cache_dtype", "auto")
    temporal_dtype = conv_dtype if ssm_setting == "auto" else _kv_cache_dtype(ssm_setting, model_dtype)
    state_bytes = (conv_dim * state_len * DTYPE_BYTES[conv_dtype]
                   + temporal_shape[0] * v_dim * k_dim * DTYPE_BYTES[temporal_dtype])
    attention_page = attention.block_size * 2 * attention.num_kv_heads * attention.head_size \
        * DTYPE_BYTES[attention.dtype]
    block_size = getattr(cache, "mamba_block_size", None) or cache.block_size
    return StateCacheSpec(block_size, (conv_shape, temporal_shape), "GDN_ATTN", (conv_dtype, temporal_dtype),
                          max(state_bytes, attention_page))


def _kv_cache_dtype(setting: str | None, model_dtype: Any) -> str:
    name = str(model_dtype).removeprefix("torch.") if setting in (None, "auto") else setting
    if name not in KV_CACHE_DTYPES:
        raise ValueError(f"cache dtype {name!r} is not one of {sorted(KV_CACHE_DTYPES)}")
    return KV_CACHE_DTYPES[name]


def _divide(total: int, tp_size: int, what: str) -> int:
    if total % tp_size:
        raise ValueError(f"{total} {what} do not divide over TP {tp_size}")
    return total // tp_size
