"""One vLLM engine in this process, driven step by step (``LLMEngine.add_request`` / ``step``), so
the profiler times exactly the steps it means: a prompt's prefill, or decode steps of a full batch.

The engine core runs in the caller's process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, set by the CLI
before vLLM is imported): it starts in seconds rather than ~30 s, and its KV cache config is at hand.
It measures what a worker's engine does once it runs on the worker's CPUs (the CLI binds them, see
``services.engine.cpus``): SmolLM2-135M on one core of this project's 2-core machine, prefill of
128/512/1024/2000 tokens and decode steps at batch 1/4/16, in-process vs a spawned engine core, two
runs each: every figure within 10% (e.g. 1024 tokens 0.73-0.81 s vs 0.74-0.87 s; batch 16 36-38 ms
both). Unbound, the in-process engine ran two threads and prefilled 2x faster than the worker.
"""
from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass
from typing import Any

from services.profiler.kv import KvGroup, kv_groups

logger = logging.getLogger(__name__)


class EngineStartError(RuntimeError):
    """The engine did not start (unloadable model, bad settings); the message is vLLM's, on one line."""


class EngineStepError(RuntimeError):
    """The engine did not do what a measurement needs (a request that never finished, a batch it split)."""


@dataclass(frozen=True, slots=True)
class EngineInfo:
    vllm_version: str
    dtype: str
    max_model_len: int
    chunk_tokens: int
    max_num_seqs: int
    block_size: int
    num_blocks: int
    enable_prefix_caching: bool
    vocab_size: int
    groups: tuple[KvGroup, ...]

    @property
    def kv_capacity_tokens(self) -> int:
        return self.num_blocks * self.block_size


class ProfilingEngine:
    """``start`` blocks until the engine is ready; ``shutdown`` releases it. Not thread-safe."""

    def __init__(self, engine_args: Any) -> None:
        self._engine_args = engine_args
        self._engine: Any = None
        self._ids = itertools.count()

    def start(self) -> EngineInfo:
        from vllm.v1.engine.llm_engine import LLMEngine

        self._engine = LLMEngine.from_engine_args(self._engine_args)
        self.prefill([1] * 16)  # the first step pays one-off set-up costs
        return self.info()

    def info(self) -> EngineInfo:
        import vllm

        config = self._engine.vllm_config
        kv_config = self._kv_cache_config()
        return EngineInfo(vllm_version=vllm.__version__, dtype=str(config.model_config.dtype).removeprefix("torch."),
                          max_model_len=config.model_config.max_model_len,
                          chunk_tokens=config.scheduler_config.max_num_batched_tokens,
                          max_num_seqs=config.scheduler_config.max_num_seqs,
                          block_size=config.cache_config.block_size, num_blocks=kv_config.num_blocks,
                          enable_prefix_caching=bool(config.cache_config.enable_prefix_caching),
                          vocab_size=config.model_config.get_vocab_size(), groups=tuple(kv_groups(kv_config)))

    def prefill(self, prompt: list[int]) -> tuple[float, int]:
        """Seconds from adding the prompt to its first token, and the prompt tokens vLLM found cached."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        request_id = f"prefill-{next(self._ids)}"
        started = time.perf_counter()
        self._engine.add_request(request_id, TokensPrompt(prompt_token_ids=list(prompt)),
                                 SamplingParams(max_tokens=1, temperature=0.0))
        while self._engine.has_unfinished_requests():
            for output in self._engine.step():
                if output.request_id == request_id and output.finished:
                    return time.perf_counter() - started, int(output.num_cached_tokens or 0)
        raise EngineStepError(f"request {request_id} ended without an output")

    def decode_steps(self, prompts: list[list[int]], num_steps: int) -> list[float]:
        """Durations of ``num_steps`` decode steps with every prompt in the batch (after all are prefilled)."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        ids = [f"decode-{next(self._ids)}" for _ in prompts]
        params = SamplingParams(max_tokens=num_steps + len(prompts) + 64, temperature=0.0, ignore_eos=True)
        for request_id, prompt in zip(ids, prompts):
            self._engine.add_request(request_id, TokensPrompt(prompt_token_ids=list(prompt)), params)
        try:
            self._until_all_started(set(ids))
            return [self._timed_step(len(ids)) for _ in range(num_steps)]
        finally:
            self._engine.abort_request(ids)
            while self._engine.has_unfinished_requests():
                self._engine.step()

    def shutdown(self) -> None:
        if self._engine is not None:
            engine, self._engine = self._engine, None
            engine.engine_core.shutdown()

    def _until_all_started(self, waiting: set[str]) -> None:
        while waiting:
            if not self._engine.has_unfinished_requests():
                raise EngineStepError("decode requests finished before all of them were prefilled")
            waiting -= {output.request_id for output in self._engine.step()}

    def _timed_step(self, batch_size: int) -> float:
        started = time.perf_counter()
        outputs = self._engine.step()
        elapsed = time.perf_counter() - started
        if len(outputs) != batch_size:
            raise EngineStepError(f"a decode step returned {len(outputs)} outputs for a batch of {batch_size} "
                                  "(preempted? the KV cache may be too small for this point)")
        return elapsed

    def _kv_cache_config(self) -> Any:
        core = getattr(self._engine.engine_core, "engine_core", None)
        if core is None:
            raise EngineStepError("the engine core runs in another process: set VLLM_ENABLE_V1_MULTIPROCESSING=0")
        return core.scheduler.kv_cache_config
