"""A rank's layout spec from what vLLM hands a connector (plain stand-ins for its spec objects)."""
from __future__ import annotations

from enum import Enum
from types import SimpleNamespace

import pytest
import torch

from services.kv_connector.layouts.mapping import LayoutMap, plan_mapping
from services.kv_connector.layouts.spec import LinearLayer, Sharded
from services.kv_connector.layouts.from_vllm import spec_from_vllm


class MambaType(Enum):
    GDN_ATTN = "gdn"
    MAMBA2 = "mamba2"


def attention_spec(tp: int) -> SimpleNamespace:
    return SimpleNamespace(block_size=128, num_kv_heads=max(1, 2 // tp), head_size=64, head_size_v=64,
                           dtype=torch.bfloat16, sliding_window=None)


def gdn_spec(tp: int) -> SimpleNamespace:
    """Qwen3-Next's tiny GDN layer as measured at TP1: conv (3, 512), state (4, 64, 64), 65,536-B page."""
    return SimpleNamespace(block_size=128, shapes=((3, 512 // tp), (4 // tp, 64, 64)), mamba_type=MambaType.GDN_ATTN,
                           dtypes=(torch.bfloat16, torch.bfloat16), page_size_bytes=65536 // tp)


def config(tp: int, linear=gdn_spec) -> SimpleNamespace:
    groups = [SimpleNamespace(layer_names=[f"layers.{i}"], kv_cache_spec=linear(tp)) for i in range(3)]
    groups.append(SimpleNamespace(layer_names=["layers.3"], kv_cache_spec=attention_spec(tp)))
    return SimpleNamespace(kv_cache_groups=groups)


NAMES = [f"layers.{i}" for i in range(4)]


def test_gdn_layers_decompose_into_query_key_key_value():
    spec = spec_from_vllm("qwen3-next-tiny", config(2), NAMES, 1, 2, total_kv_heads=2)
    layer = spec.layers[0]
    assert isinstance(layer, LinearLayer)
    assert layer.conv == (Sharded("query_key", 2, 64, 1), Sharded("key", 2, 64, 1), Sharded("value", 4, 64, 2))
    assert (layer.temporal, layer.temporal_head_shape) == (Sharded("ssm", 4, 4096, 2), (64, 64))
    assert (layer.conv_bytes, layer.temporal_bytes, layer.page_bytes) == (1536, 16384, 32768)
    assert spec.layers[3].kv == Sharded("kv_heads", 2, 64, 1)
    assert (spec.dtype, spec.block_sizes, spec.tp_rank) == ("bfloat16", (128,) * 4, 1)


def test_specs_of_two_tp_sizes_map():
    tp1 = [spec_from_vllm("m", config(1), NAMES, 0, 1, total_kv_heads=2)]
    tp2 = [spec_from_vllm("m", config(2), NAMES, rank, 2, total_kv_heads=2) for rank in range(2)]
    assert isinstance(plan_mapping(tp1, tp2), LayoutMap)
    assert isinstance(plan_mapping(tp2, tp1), LayoutMap)


def test_mamba2_groups_replicate_when_told_the_model_total():
    def mamba(tp):  # 4 heads of 16, one group of state 32: conv x 64 + B 32 + C 32 at TP1
        return SimpleNamespace(block_size=256, shapes=((3, 64 // tp + 64), (4 // tp, 16, 32)),
                               mamba_type=MambaType.MAMBA2, dtypes=(torch.bfloat16, torch.float32),
                               page_size_bytes=1 << 16)

    layer = spec_from_vllm("m", config(2, mamba), NAMES, 0, 2, total_kv_heads=2, mamba_groups=1).layers[0]
    assert isinstance(layer, LinearLayer)
    assert layer.conv == (Sharded("x", 4, 16, 2), Sharded("B", 1, 32, 1), Sharded("C", 1, 32, 1))
    assert layer.temporal_dtype == "float32"


def test_undecomposable_conv_dim_is_a_clear_error():
    def broken(tp):
        return SimpleNamespace(block_size=128, shapes=((3, 300), (4, 64, 64)), mamba_type=MambaType.GDN_ATTN,
                               dtypes=(torch.bfloat16, torch.bfloat16), page_size_bytes=65536)

    with pytest.raises(ValueError, match="GDN conv dim 300 is not 2 x key"):
        spec_from_vllm("m", config(1, broken), NAMES, 0, 1, total_kv_heads=2)
