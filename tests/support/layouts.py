"""Layout specs of tiny models at a given TP size, split as vLLM splits them (for the layout tests).

GDN sizes are chosen so that a rank's per-component conv shard differs from a contiguous slice of
the concatenated conv dim: query-key 2x4, key 2x4, value 4x4 channels.
"""
from __future__ import annotations

from services.kv_connector.layouts.spec import DTYPE_BYTES, AttentionLayer, LayoutSpec, LinearLayer, Sharded

MODEL = "tiny-hybrid"
STATE_LEN = 3
PAGE_PADDING = 64


def sharded(name: str, num_units: int, unit_size: int, tp: int) -> Sharded:
    return Sharded(name, num_units, unit_size, max(1, num_units // tp))


def attention(name: str, group: int, tp: int, num_kv_heads: int = 2, head_size: int = 8) -> AttentionLayer:
    return AttentionLayer(name, group, sharded("kv_heads", num_kv_heads, head_size, tp))


def linear(name: str, group: int, conv: tuple[Sharded, ...], temporal: Sharded, head_shape: tuple[int, ...],
           dtype: str = "bfloat16") -> LinearLayer:
    state_bytes = (sum(part.local_size for part in conv) * STATE_LEN + temporal.local_size) * DTYPE_BYTES[dtype]
    return LinearLayer(name, group, conv, STATE_LEN, temporal, head_shape, dtype, dtype, state_bytes + PAGE_PADDING)


def gdn(name: str, group: int, tp: int, k_heads: int = 2, k_dim: int = 4, v_heads: int = 4, v_dim: int = 4,
        dtype: str = "bfloat16") -> LinearLayer:
    conv = (sharded("query_key", k_heads, k_dim, tp), sharded("key", k_heads, k_dim, tp),
            sharded("value", v_heads, v_dim, tp))
    return linear(name, group, conv, sharded("ssm", v_heads, v_dim * k_dim, tp), (v_dim, k_dim), dtype)


def mamba2(name: str, group: int, tp: int, heads: int = 4, head_dim: int = 4, groups: int = 1,
           state_size: int = 8) -> LinearLayer:
    conv = (sharded("x", heads, head_dim, tp), sharded("B", groups, state_size, tp),
            sharded("C", groups, state_size, tp))
    return linear(name, group, conv, sharded("ssm", heads, head_dim * state_size, tp), (head_dim, state_size))


def gdn_model(tp: int, block_size: int = 16, model: str = MODEL, dtype: str = "bfloat16",
              cache_layout: str = "", head_size: int = 8) -> LayoutSpec:
    """Qwen3-Next-like: three Gated-DeltaNet layers and one full-attention layer, a group each."""
    layers = (gdn("layers.0", 0, tp), gdn("layers.1", 1, tp), gdn("layers.2", 2, tp),
              attention("layers.3", 3, tp, head_size=head_size))
    return LayoutSpec(model, dtype, 0, tp, (block_size,) * 4, layers, cache_layout)


def mamba_model(tp: int, block_size: int = 16) -> LayoutSpec:
    """Granite-like: Mamba2 layers (one B/C group, replicated past TP 1) and two attention layers with
    2 KV heads (replicated past TP 2), attention in one group."""
    layers = (mamba2("layers.0", 0, tp), attention("layers.1", 2, tp), mamba2("layers.2", 1, tp),
              attention("layers.3", 2, tp))
    return LayoutSpec("tiny-mamba", "bfloat16", 0, tp, (block_size, block_size, block_size), layers)


def ranks(spec: LayoutSpec) -> list[LayoutSpec]:
    return [spec.for_rank(rank) for rank in range(spec.tp_size)]
