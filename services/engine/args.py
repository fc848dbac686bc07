"""From the deployment config to vLLM's engine arguments."""
from __future__ import annotations

import os
from pathlib import Path

from services.config import EngineConfig, ModelConfig

BUILTIN_PREFIX = "builtin:"


def resolve_model_path(model: ModelConfig) -> Path:
    """The checkpoint directory; embedded models are prepared on first use."""
    if not model.path.startswith(BUILTIN_PREFIX):
        path = Path(model.path).expanduser()
        if not path.is_dir():
            raise FileNotFoundError(f"model.path: {path} is not a directory")
        return path
    name = model.path.removeprefix(BUILTIN_PREFIX)
    from services.models import registry

    return registry.prepare(name)


def engine_args(model: ModelConfig, engine: EngineConfig, *, kv_transfer_config=None):
    """vLLM ``AsyncEngineArgs`` for one worker. Sets the CPU KV-cache size in the environment."""
    from vllm.engine.arg_utils import AsyncEngineArgs

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(engine.cpu_kvcache_space_gib))
    path = str(resolve_model_path(model))
    return AsyncEngineArgs(
        model=path,
        tokenizer=path,
        served_model_name=[model.name],
        max_model_len=model.max_model_len,
        dtype=model.dtype,
        enforce_eager=engine.enforce_eager,
        gpu_memory_utilization=engine.gpu_memory_utilization,
        max_num_seqs=engine.max_num_seqs,
        max_num_batched_tokens=engine.max_num_batched_tokens,
        enable_prefix_caching=engine.enable_prefix_caching,
        seed=engine.seed,
        kv_transfer_config=kv_transfer_config,
        disable_log_stats=True,
    )
