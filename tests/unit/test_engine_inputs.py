"""What the router accepts as token ids, and the dtype a worker's engine runs."""
from __future__ import annotations

import json
import platform

import pytest

from services.engine import args
from services.router.errors import ApiError
from services.router.tokenizer import _embedding_rows, check_token_ids


def test_token_ids_are_bounded_by_the_models_embedding_rows_not_the_tokenizer(tmp_path):
    # the embedded hybrid model: a 259-entry byte tokenizer, 1,024 embedding rows
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": 1024}))
    rows = _embedding_rows(tmp_path)
    assert rows == 1024
    check_token_ids([0, 603, 1023], rows)
    for bad in ([1024], [-1], [5, 10**9]):
        with pytest.raises(ApiError) as error:
            check_token_ids(bad, rows)
        assert error.value.status == 400 and "outside the model's vocabulary" in error.value.message


def test_a_checkpoint_without_a_vocab_size_falls_back_to_the_tokenizer(tmp_path):
    assert _embedding_rows(tmp_path) is None
    (tmp_path / "config.json").write_text(json.dumps({"text_config": {"vocab_size": 77}}))
    assert _embedding_rows(tmp_path) == 77


@pytest.mark.parametrize("flags, expected", [({"avx2"}, "float32"), ({"avx2", "avx512_bf16"}, "bfloat16"),
                                             ({"amx_bf16"}, "bfloat16")])
def test_auto_dtype_on_a_cpu_host_is_bfloat16_only_where_the_cpu_computes_it(monkeypatch, tmp_path, flags, expected):
    monkeypatch.setattr(args, "_has_gpu", lambda: False)
    monkeypatch.setattr(args, "_cpu_flags", lambda: flags)
    (tmp_path / "config.json").write_text(json.dumps({"layer_types": ["full_attention"] * 2}))
    assert args.resolve_dtype("auto", tmp_path) == expected
    assert args.resolve_dtype("float16", tmp_path) == "float16"  # an explicit choice stands


def test_auto_dtype_keeps_bfloat16_for_linear_attention_models_on_any_cpu(monkeypatch, tmp_path):
    monkeypatch.setattr(args, "_has_gpu", lambda: False)
    monkeypatch.setattr(args, "_cpu_flags", lambda: {"avx2"})
    (tmp_path / "config.json").write_text(json.dumps({"layer_types": ["linear_attention", "full_attention"]}))
    assert args.resolve_dtype("auto", tmp_path) == "bfloat16"


def test_auto_dtype_on_a_gpu_host_is_left_to_vllm(monkeypatch):
    monkeypatch.setattr(args, "_has_gpu", lambda: True)
    assert args.resolve_dtype("auto", "/nonexistent") == "auto"


@pytest.mark.skipif(platform.machine() != "x86_64", reason="x86 /proc/cpuinfo names its flags on a flags line")
def test_this_hosts_cpu_flags_are_read():
    assert {"fpu", "sse2"} <= args._cpu_flags()


def test_a_request_vllm_refuses_is_a_value_error_the_servicers_answer_invalid_argument():
    import asyncio

    from vllm.exceptions import VLLMValidationError

    from services.engine.engine import Engine
    from services.worker_api.types import GenerateInput, Sampling

    class Refusing:
        async def generate(self, prompt, params, request_id):
            raise VLLMValidationError("stop cannot contain an empty string.")
            yield  # an async generator, as AsyncLLM.generate is

    engine = Engine(engine_args=None)
    engine._llm = Refusing()

    async def run():
        async for _ in engine.generate(GenerateInput("r1", [1, 2], Sampling(max_tokens=2))):
            pass

    with pytest.raises(ValueError, match="stop cannot contain an empty string"):
        asyncio.run(run())
    assert engine.stats().num_active_requests == 0
