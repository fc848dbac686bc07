"""The layout a worker announces, derived from its engine's configs (stand-ins for vLLM's)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from transformers import LlamaConfig

from services.engine.engine import announced_layout
from services.kv_connector.layouts.from_config import spec_from_config
from services.kv_connector.layouts.mapping import LayoutMap, Unmappable, plan_mapping
from services.kv_connector.layouts.spec import CPU_K_TRANSPOSED, AttentionLayer, LayoutSpec, LinearLayer, Sharded
from services.models import tiny_hybrid


def smollm2() -> LlamaConfig:
    return LlamaConfig(hidden_size=576, num_attention_heads=9, num_key_value_heads=3, num_hidden_layers=30,
                       head_dim=64)


def vllm_config(hf, dtype=torch.float32, tp: int = 1, block_size: int = 128, cache_dtype: str = "auto",
                **cache) -> SimpleNamespace:
    return SimpleNamespace(
        model_config=SimpleNamespace(hf_text_config=hf, dtype=dtype, use_mla=False),
        cache_config=SimpleNamespace(block_size=block_size, cache_dtype=cache_dtype, mamba_cache_dtype="auto",
                                     mamba_ssm_cache_dtype="auto", **cache),
        parallel_config=SimpleNamespace(tensor_parallel_size=tp, pipeline_parallel_size=1),
        speculative_config=None)


def announced(hf, **options) -> list[LayoutSpec]:
    spec = spec_from_config("m", vllm_config(hf, **options))
    return [spec.for_rank(rank) for rank in range(spec.tp_size)]


def test_smollm2_is_thirty_attention_layers_of_three_kv_heads():
    spec = spec_from_config("smollm2", vllm_config(smollm2()))
    assert (spec.model, spec.dtype, spec.tp_rank, spec.tp_size, spec.block_sizes) == ("smollm2", "float32", 0, 1,
                                                                                       (128,))
    assert len(spec.layers) == 30
    assert spec.layers[29] == AttentionLayer("layers.29", 0, Sharded("kv_heads", 3, 64, 3))


def test_tiny_qwen3_next_has_three_gdn_layers_and_one_attention_layer():
    spec = spec_from_config("tiny", vllm_config(tiny_hybrid.config(), torch.bfloat16, tp=2, block_size=256))
    linear, attention = spec.layers[0], spec.layers[3]
    assert isinstance(linear, LinearLayer) and isinstance(attention, AttentionLayer)
    assert [layer.group for layer in spec.layers] == [0, 0, 0, 1]
    assert linear.conv == (Sharded("query_key", 2, 64, 1), Sharded("key", 2, 64, 1), Sharded("value", 4, 64, 2))
    assert (linear.conv_state_len, linear.temporal, linear.temporal_head_shape) == (3, Sharded("ssm", 4, 4096, 2),
                                                                                    (64, 64))
    assert linear.page_bytes == 256 * 2 * 1 * 64 * 2  # padded to the attention page
    assert attention.kv == Sharded("kv_heads", 2, 64, 1)
    assert spec.to_bytes() == LayoutSpec.from_bytes(spec.to_bytes()).to_bytes()


def outcome(result: LayoutMap | Unmappable) -> str:
    if isinstance(result, Unmappable):
        return result.reason
    return "identity" if result.is_identity else "mapped"


@pytest.mark.parametrize("producer, consumer, expected", [
    ({}, {}, "identity"),
    ({}, {"dtype": torch.bfloat16}, "different KV dtypes: producer float32, consumer bfloat16"),
    ({}, {"cache_dtype": "fp8_e5m2"}, "different KV dtypes: producer float32, consumer float8_e5m2"),
    ({}, {"block_size": 16}, "mapped"),
    ({"tp": 3}, {}, "mapped"),
])
def test_dense_pairs(producer, consumer, expected):
    assert outcome(plan_mapping(announced(smollm2(), **producer), announced(smollm2(), **consumer))) == expected


def test_hybrid_tp1_and_tp2_map():
    tp1 = announced(tiny_hybrid.config(), dtype=torch.bfloat16)
    tp2 = announced(tiny_hybrid.config(), dtype=torch.bfloat16, tp=2)
    assert isinstance(plan_mapping(tp1, tp2), LayoutMap)


@pytest.mark.parametrize("change, message", [
    ({"layer_types": ["mamba"] * 30}, "layer types \\['mamba'\\] have no layout description"),
    ({"layer_types": ["full_attention"]}, "1 layer types for 30 layers"),
])
def test_what_cannot_be_described_is_a_value_error(change, message):
    hf = smollm2()
    for key, value in change.items():
        setattr(hf, key, value)
    with pytest.raises(ValueError, match=message):
        spec_from_config("m", vllm_config(hf))


def test_unknown_cache_dtype_is_a_value_error():
    with pytest.raises(ValueError, match="cache dtype 'int4_per_token_head'"):
        spec_from_config("m", vllm_config(smollm2(), cache_dtype="int4_per_token_head"))


def test_an_engine_announces_its_rank_0_spec_or_nothing(caplog):
    config = vllm_config(smollm2())
    config.model_config.served_model_name = "smollm2"
    announced = LayoutSpec.from_bytes(announced_layout(config))
    assert announced == spec_from_config("smollm2", config, cache_layout=announced.cache_layout)
    assert announced.cache_layout == CPU_K_TRANSPOSED  # float32 KV, 128-token blocks: vLLM's vec kernel on x86
    config.model_config.hf_text_config.layer_types = ["mamba"] * 30
    assert announced_layout(config) == b""
    assert "announcing no KV layout (peers will treat it as unknown): layer types ['mamba']" in caplog.text
