"""A vLLM AsyncLLM engine behind a small interface the workers and tests share."""
from __future__ import annotations

import logging
import json
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

from services.engine.cpus import fork_engine_core
from services.engine.vllm_plugin import GRAMMAR_PREFIX_KEY
from services.worker_api.resume import resume_problem, resumed_logit_bias, resumed_min_tokens
from services.worker_api.types import (STRUCTURED_OUTPUT_KINDS, EngineStats, GenerateInput, LogprobEntry, Sampling,
                                      StructuredOutput, TokenDelta)
from services.kv_connector.params import KvTransfer
from services.kv_connector.stats_file import read_stats

logger = logging.getLogger(__name__)


class Engine:
    """One vLLM engine. ``start`` blocks until the engine is ready (~30 s for a tiny model on CPU)."""

    def __init__(self, engine_args: Any, stats_dir: Path | None = None, fork_core: bool = False) -> None:
        """``stats_dir``: where the engine's connector writes its telemetry (the ``stats_dir`` of its
        ``kv_transfer_config``); None: it comes with vLLM's stats, on engine steps only. ``fork_core``:
        fork vLLM's engine-core process from this one (``services.engine.cpus.engine_core_forks``)."""
        self._engine_args = engine_args
        self._stats_dir = stats_dir
        self._fork_core = fork_core
        self._llm = None
        self._stats = EngineStats()
        self._active: set[str] = set()
        self.layout_spec = b""  # what GetStats announces: the rank-0 LayoutSpec once started, b"" if unknown

    async def start(self) -> None:
        """Start the engine (blocking this process, its event loop included, until it is ready); as
        ``AsyncLLM.from_engine_args``, with the engine-core process forked where ``fork_core``."""
        from vllm.usage.usage_lib import UsageContext
        from vllm.v1.engine.async_llm import AsyncLLM
        from vllm.v1.executor import Executor

        args, context = self._engine_args, UsageContext.ENGINE_CONTEXT
        vllm_config = args.create_engine_config(context)
        if self._fork_core:
            fork_engine_core()
        self._llm = AsyncLLM(vllm_config=vllm_config, executor_class=Executor.get_class(vllm_config),
                             log_requests=args.enable_log_requests, log_stats=not args.disable_log_stats,
                             usage_context=context, stat_loggers=[self._stat_logger_factory()])
        self.layout_spec = announced_layout(self._llm.vllm_config)
        logger.info("engine ready: %s", self._engine_args.model)

    @property
    def started(self) -> bool:
        return self._llm is not None

    @property
    def max_model_len(self) -> int:
        return self._llm.model_config.max_model_len

    async def generate(self, request: GenerateInput) -> AsyncIterator[TokenDelta]:
        """Stream one request's output step by step. Closing the iterator aborts the request. A
        request vLLM refuses (its client errors) raises ``ValueError`` with vLLM's message."""
        from vllm.exceptions import VLLMClientError
        from vllm.inputs import TokensPrompt

        prompt = TokensPrompt(prompt_token_ids=list(request.prompt_token_ids))
        self._active.add(request.request_id)
        try:
            params = sampling_params(request.sampling, request.kv_transfer, request.prompt_token_ids)
            async for output in self._llm.generate(prompt, params, request.request_id):
                yield _delta(output)
        except VLLMClientError as exc:
            raise ValueError(str(exc)) from exc
        finally:
            self._active.discard(request.request_id)

    def stats(self) -> EngineStats:
        self._stats.num_active_requests = len(self._active)
        if self._stats_dir is not None and (connector := read_stats(self._stats_dir)) is not None:
            self._stats.kv_connector = connector
        return self._stats

    async def check_health(self) -> None:
        await self._llm.check_health()

    def shutdown(self) -> None:
        if self._llm is not None:
            self._llm.shutdown()
            self._llm = None

    def _stat_logger_factory(self):
        from vllm.v1.metrics.loggers import StatLoggerBase

        stats = self._stats

        class _Recorder(StatLoggerBase):
            def __init__(self, vllm_config, engine_index: int = 0) -> None:
                pass

            def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None, engine_idx=0):
                if scheduler_stats is not None:
                    stats.num_running_requests = scheduler_stats.num_running_reqs
                    stats.num_waiting_requests = scheduler_stats.num_waiting_reqs
                    stats.kv_cache_usage = scheduler_stats.kv_cache_usage
                if iteration_stats is not None:
                    stats.num_finished_requests += len(iteration_stats.finished_requests)

            def log_engine_initialized(self) -> None:
                pass

        return _Recorder


def announced_layout(vllm_config: Any) -> bytes:
    """The engine's rank-0 KV layout, derived from its configs (the worker process has no
    ``KVCacheConfig``; see ``layouts.from_config``); b"" where it cannot be described, which peers treat as
    unknown (allowed)."""
    from vllm.model_executor.layers.mamba.mamba_utils import get_conv_state_layout

    from services.kv_connector.layouts.from_config import spec_from_config
    from services.kv_connector.layouts.from_vllm import with_cache_layout

    model = vllm_config.model_config.served_model_name
    try:
        spec = with_cache_layout(spec_from_config(model, vllm_config, conv_layout=get_conv_state_layout()),
                                 getattr(vllm_config.cache_config, "cache_dtype", "auto"))
    except (ValueError, AttributeError, TypeError) as error:
        logger.warning("announcing no KV layout (peers will treat it as unknown): %s", error)
        return b""
    logger.info("KV layout: %s, KV dtype %s, TP %d, block sizes %s, %d layers", spec.model, spec.dtype,
                spec.tp_size, spec.block_sizes, len(spec.layers))
    return spec.to_bytes()


def sampling_params(sampling: Sampling, kv_transfer: KvTransfer | None = None,
                    prompt_token_ids: Sequence[int] = ()):
    """vLLM's ``SamplingParams`` for ``sampling``; for a request that moved here (``num_output_prompt_tokens``
    of ``prompt_token_ids`` generated before), those tokens count as output (services/worker_api/resume.py).
    Raises ValueError for a move that cannot go on exactly."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    generated = list(prompt_token_ids[len(prompt_token_ids) - sampling.num_output_prompt_tokens:]) \
        if sampling.num_output_prompt_tokens else []
    if generated and (problem := resume_problem(sampling)) is not None:
        raise ValueError(f"this request cannot continue here exactly: {problem}")
    extra_args = kv_transfer.to_extra_args() if kv_transfer else {}
    if generated and sampling.structured is not None:
        extra_args[GRAMMAR_PREFIX_KEY] = generated
    return SamplingParams(
        max_tokens=sampling.max_tokens,
        temperature=sampling.temperature,
        top_p=sampling.top_p,
        top_k=sampling.top_k,
        min_p=sampling.min_p,
        seed=sampling.seed,
        stop=list(sampling.stop) or None,
        stop_token_ids=list(sampling.stop_token_ids) or None,
        ignore_eos=sampling.ignore_eos,
        presence_penalty=sampling.presence_penalty,
        frequency_penalty=sampling.frequency_penalty,
        repetition_penalty=sampling.repetition_penalty,
        min_tokens=resumed_min_tokens(sampling),
        logit_bias=resumed_logit_bias(sampling, generated) or None,
        logprobs=sampling.top_logprobs if sampling.wants_logprobs else None,
        prompt_logprobs=sampling.prompt_logprobs,
        structured_outputs=_structured_outputs(sampling.structured),
        output_kind=RequestOutputKind.DELTA,
        extra_args=extra_args or None,
    )


def _structured_outputs(structured: StructuredOutput | None):
    if structured is None:
        return None
    from vllm.sampling_params import StructuredOutputsParams

    if structured.kind == "json":
        return StructuredOutputsParams(json=json.loads(structured.spec))
    if structured.kind == "json_object":
        return StructuredOutputsParams(json_object=True)
    if structured.kind == "choice":
        return StructuredOutputsParams(choice=json.loads(structured.spec))
    if structured.kind == "regex":
        return StructuredOutputsParams(regex=structured.spec)
    if structured.kind == "grammar":
        return StructuredOutputsParams(grammar=structured.spec)
    if structured.kind == "structural_tag":
        return StructuredOutputsParams(structural_tag=structured.spec)
    raise ValueError(f"unknown structured output kind {structured.kind!r}; one of {', '.join(STRUCTURED_OUTPUT_KINDS)}")


def _delta(output) -> TokenDelta:
    completion = output.outputs[0]
    return TokenDelta(
        text=completion.text,
        token_ids=tuple(completion.token_ids),
        finish_reason=completion.finish_reason if output.finished else None,
        num_prompt_tokens=len(output.prompt_token_ids or ()),
        num_cached_tokens=output.num_cached_tokens or 0,
        top_logprobs=_logprobs(completion.logprobs),
        prompt_logprobs=_logprobs(output.prompt_logprobs),
    )


def _logprobs(positions) -> tuple[tuple[LogprobEntry, ...], ...]:
    """vLLM's per-position logprobs (a dict of token id to ``Logprob``, or None, per position) in vLLM's
    order: the sampled (or prompt) token first, then the most likely by rank; () when none were asked."""
    if not positions:
        return ()
    return tuple(tuple(LogprobEntry(token, entry.logprob, entry.decoded_token) for token, entry in position.items())
                 if position else () for position in positions)
