"""Protobuf <-> domain conversions for the worker RPCs (the only place both meet)."""
from __future__ import annotations

from prfaas.v1 import worker_pb2 as pb

from services.engine.types import EngineStats, GenerateInput, Sampling, TokenDelta


def sampling_from_proto(msg: pb.SamplingParams) -> Sampling:
    return Sampling(
        max_tokens=msg.max_tokens,
        temperature=msg.temperature,
        top_p=msg.top_p or 1.0,
        seed=msg.seed if msg.HasField("seed") else None,
        stop=tuple(msg.stop),
        stop_token_ids=tuple(msg.stop_token_ids),
        ignore_eos=msg.ignore_eos,
    )


def sampling_to_proto(sampling: Sampling) -> pb.SamplingParams:
    return pb.SamplingParams(
        max_tokens=sampling.max_tokens,
        temperature=sampling.temperature,
        top_p=sampling.top_p,
        seed=sampling.seed,
        stop=list(sampling.stop),
        stop_token_ids=list(sampling.stop_token_ids),
        ignore_eos=sampling.ignore_eos,
    )


def generate_input_from_proto(msg: pb.GenerateRequest) -> GenerateInput:
    return GenerateInput(
        request_id=msg.request_id,
        prompt_token_ids=list(msg.prompt_token_ids),
        sampling=sampling_from_proto(msg.sampling),
    )


def generate_input_to_proto(request: GenerateInput) -> pb.GenerateRequest:
    return pb.GenerateRequest(
        request_id=request.request_id,
        prompt_token_ids=request.prompt_token_ids,
        sampling=sampling_to_proto(request.sampling),
    )


def delta_to_proto(delta: TokenDelta) -> pb.GenerateResponse:
    return pb.GenerateResponse(
        text=delta.text,
        token_ids=delta.token_ids,
        finish_reason=delta.finish_reason or "",
        num_prompt_tokens=delta.num_prompt_tokens,
        num_cached_tokens=delta.num_cached_tokens,
    )


def delta_from_proto(msg: pb.GenerateResponse) -> TokenDelta:
    return TokenDelta(
        text=msg.text,
        token_ids=tuple(msg.token_ids),
        finish_reason=msg.finish_reason or None,
        num_prompt_tokens=msg.num_prompt_tokens,
        num_cached_tokens=msg.num_cached_tokens,
    )


def stats_to_proto(stats: EngineStats, **identity) -> pb.WorkerStats:
    return pb.WorkerStats(
        num_active_requests=stats.num_active_requests,
        num_running_requests=stats.num_running_requests,
        num_waiting_requests=stats.num_waiting_requests,
        kv_cache_usage=stats.kv_cache_usage,
        num_finished_requests=stats.num_finished_requests,
        **identity,
    )
