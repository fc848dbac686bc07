"""Protobuf <-> domain conversions for the worker RPCs (the only place both meet)."""
from __future__ import annotations

from prfaas.v1 import worker_pb2 as pb

from services.worker_api.types import (EngineStats, GenerateInput, LinkStats, LogprobEntry, PrefixUpdate, Sampling,
                                      StructuredOutput, TokenDelta, WorkerStats)
from services.kv_connector.params import consume, produce
from services.kv_connector.snapshot import ConnectorSnapshot
from services.kv_transport import PeerSnapshot


def sampling_from_proto(msg: pb.SamplingParams) -> Sampling:
    structured = msg.structured_output
    return Sampling(
        max_tokens=msg.max_tokens,
        temperature=msg.temperature,
        top_p=msg.top_p or 1.0,
        seed=msg.seed if msg.HasField("seed") else None,
        stop=tuple(msg.stop),
        stop_token_ids=tuple(msg.stop_token_ids),
        ignore_eos=msg.ignore_eos,
        top_logprobs=msg.top_logprobs,
        logprobs=msg.logprobs,
        prompt_logprobs=msg.prompt_logprobs if msg.HasField("prompt_logprobs") else None,
        top_k=msg.top_k,
        min_p=msg.min_p,
        presence_penalty=msg.presence_penalty,
        frequency_penalty=msg.frequency_penalty,
        repetition_penalty=msg.repetition_penalty if msg.HasField("repetition_penalty") else 1.0,
        min_tokens=msg.min_tokens,
        logit_bias=tuple(sorted(msg.logit_bias.items())),
        structured=StructuredOutput(structured.kind, structured.spec) if structured.kind else None,
        num_output_prompt_tokens=msg.num_output_prompt_tokens,
    )


def sampling_to_proto(sampling: Sampling) -> pb.SamplingParams:
    structured = sampling.structured
    return pb.SamplingParams(
        max_tokens=sampling.max_tokens,
        temperature=sampling.temperature,
        top_p=sampling.top_p,
        seed=sampling.seed,
        stop=list(sampling.stop),
        stop_token_ids=list(sampling.stop_token_ids),
        ignore_eos=sampling.ignore_eos,
        top_logprobs=sampling.top_logprobs,
        logprobs=sampling.logprobs,
        prompt_logprobs=sampling.prompt_logprobs,
        top_k=sampling.top_k,
        min_p=sampling.min_p,
        presence_penalty=sampling.presence_penalty,
        frequency_penalty=sampling.frequency_penalty,
        repetition_penalty=None if sampling.repetition_penalty == 1.0 else sampling.repetition_penalty,
        min_tokens=sampling.min_tokens,
        logit_bias=dict(sampling.logit_bias),
        structured_output=pb.StructuredOutput(kind=structured.kind, spec=structured.spec) if structured else None,
        num_output_prompt_tokens=sampling.num_output_prompt_tokens,
    )


def generate_input_from_proto(msg: pb.GenerateRequest) -> GenerateInput:
    transfer_id = msg.kv_source.transfer_id
    return GenerateInput(
        request_id=msg.request_id,
        prompt_token_ids=list(msg.prompt_token_ids),
        sampling=sampling_from_proto(msg.sampling),
        kv_transfer=consume(transfer_id) if transfer_id else None,
    )


def generate_input_to_proto(request: GenerateInput) -> pb.GenerateRequest:
    consume = request.kv_transfer and request.kv_transfer.mode == "consume"
    return pb.GenerateRequest(
        request_id=request.request_id,
        prompt_token_ids=request.prompt_token_ids,
        sampling=sampling_to_proto(request.sampling),
        kv_source=pb.KvSource(transfer_id=request.kv_transfer.transfer_id) if consume else None,
    )


def prefill_input_from_proto(msg: pb.PrefillRequest) -> GenerateInput:
    """A prefill is a one-token generation; with a target, its KV streams there."""
    transfer = (produce(msg.transfer_id or msg.request_id, msg.kv_target, max(1, msg.kv_target_tp_size))
                if msg.kv_target else None)
    return GenerateInput(msg.request_id, list(msg.prompt_token_ids), Sampling(max_tokens=1, temperature=0.0),
                         kv_transfer=transfer)


def logprobs_to_proto(positions: tuple[tuple[LogprobEntry, ...], ...]) -> list[pb.TopLogprobs]:
    return [pb.TopLogprobs(token_ids=[e.token_id for e in entries], logprobs=[e.logprob for e in entries],
                           tokens=[e.token or "" for e in entries] if any(e.token is not None for e in entries)
                           else []) for entries in positions]


def logprobs_from_proto(positions) -> tuple[tuple[LogprobEntry, ...], ...]:
    return tuple(tuple(LogprobEntry(token_id, logprob, top.tokens[i] if top.tokens else None)
                       for i, (token_id, logprob) in enumerate(zip(top.token_ids, top.logprobs)))
                 for top in positions)


def delta_to_proto(delta: TokenDelta) -> pb.GenerateResponse:
    return pb.GenerateResponse(
        text=delta.text,
        token_ids=delta.token_ids,
        finish_reason=delta.finish_reason or "",
        num_prompt_tokens=delta.num_prompt_tokens,
        num_cached_tokens=delta.num_cached_tokens,
        top_logprobs=logprobs_to_proto(delta.top_logprobs),
        prompt_logprobs=logprobs_to_proto(delta.prompt_logprobs),
    )


def delta_from_proto(msg: pb.GenerateResponse) -> TokenDelta:
    return TokenDelta(
        text=msg.text,
        token_ids=tuple(msg.token_ids),
        finish_reason=msg.finish_reason or None,
        num_prompt_tokens=msg.num_prompt_tokens,
        num_cached_tokens=msg.num_cached_tokens,
        top_logprobs=logprobs_from_proto(msg.top_logprobs),
        prompt_logprobs=logprobs_from_proto(msg.prompt_logprobs),
    )


def stats_to_proto(stats: EngineStats, **identity: object) -> pb.WorkerStats:
    connector = stats.kv_connector or ConnectorSnapshot()
    transport, pool = connector.transport, connector.pool
    return pb.WorkerStats(
        num_active_requests=stats.num_active_requests,
        num_running_requests=stats.num_running_requests,
        num_waiting_requests=stats.num_waiting_requests,
        kv_cache_usage=stats.kv_cache_usage,
        num_finished_requests=stats.num_finished_requests,
        kv_links=[_link_to_proto(peer) for peer in transport.peers],
        kv_bytes_received=transport.bytes_received,
        kv_frames_rejected=transport.frames_rejected,
        kv_connections_refused=transport.connections_refused,
        kv_transfers_receiving=transport.transfers_receiving,
        kv_transfers_sending=transport.transfers_sending,
        kv_pool_tokens_loaded=pool.tokens_loaded,
        kv_pool_tokens_stored=pool.tokens_stored,
        kv_pool_loads_failed=pool.loads_failed,
        kv_pool_stores_failed=pool.stores_failed,
        **identity,
    )


def _link_to_proto(peer: PeerSnapshot) -> pb.KvLinkStats:
    return pb.KvLinkStats(peer=peer.peer, connections=peer.connections, bytes_sent=peer.bytes_sent,
                          transfers_sent=peer.transfers_sent, transfers_failed=peer.transfers_failed,
                          goodput_bps=peer.goodput_bps, retransmits=peer.retransmits, rtt_ms=peer.rtt_us / 1000,
                          cwnd_segments=peer.cwnd_segments, delivery_rate_bps=peer.delivery_rate_bps,
                          send_cpu_seconds=peer.cpu_s)


def stats_from_proto(msg: pb.WorkerStats) -> WorkerStats:
    """A worker's ``GetStats`` answer as the router keeps it."""
    links = tuple(LinkStats(link.peer, link.connections, link.bytes_sent, link.transfers_sent, link.transfers_failed,
                            link.goodput_bps, link.retransmits, link.rtt_ms, link.cwnd_segments,
                            link.delivery_rate_bps, link.send_cpu_seconds) for link in msg.kv_links)
    return WorkerStats(
        worker_name=msg.worker_name, service=msg.service, role=msg.role, model=msg.model,
        max_model_len=msg.max_model_len, num_running_requests=msg.num_running_requests,
        num_waiting_requests=msg.num_waiting_requests, kv_cache_usage=msg.kv_cache_usage,
        num_finished_requests=msg.num_finished_requests, num_active_requests=msg.num_active_requests,
        kv_links=links, kv_bytes_received=msg.kv_bytes_received, kv_frames_rejected=msg.kv_frames_rejected,
        kv_connections_refused=msg.kv_connections_refused, kv_pool_tokens_loaded=msg.kv_pool_tokens_loaded,
        kv_pool_tokens_stored=msg.kv_pool_tokens_stored, kv_pool_loads_failed=msg.kv_pool_loads_failed,
        kv_pool_stores_failed=msg.kv_pool_stores_failed, grpc_rejected=dict(msg.grpc_rejected),
        layout_spec=msg.layout_spec, kv_protocol_version=msg.kv_protocol_version,
        kv_transfers_receiving=msg.kv_transfers_receiving, kv_transfers_sending=msg.kv_transfers_sending,
        draining=msg.draining, role_generation=msg.role_generation, num_handoffs=msg.num_handoffs,
        max_handoffs=msg.max_handoffs, peak_handoffs=msg.peak_handoffs, num_handoffs_queued=msg.num_handoffs_queued)


def set_role_request(expected_generation: int, role: str, draining: bool) -> pb.SetRoleRequest:
    return pb.SetRoleRequest(expected_generation=expected_generation, role=role, draining=draining)


def prefill_request_to_proto(request: GenerateInput, kv_target: str, kv_target_tp_size: int = 1,
                             handoff_reservation: str = "") -> pb.PrefillRequest:
    """The PrfaaS prefill of ``request``, streaming its KV to ``kv_target`` (an engine of
    ``kv_target_tp_size`` ranks) under the request's id, in the slot ``handoff_reservation`` holds."""
    return pb.PrefillRequest(request_id=request.request_id, prompt_token_ids=request.prompt_token_ids,
                             kv_target=kv_target, transfer_id=request.request_id, kv_target_tp_size=kv_target_tp_size,
                             handoff_reservation=handoff_reservation)


def reserve_handoff_request(request_id: str, wait_s: float) -> pb.ReserveHandoffRequest:
    return pb.ReserveHandoffRequest(request_id=request_id, wait_s=wait_s)


def stats_request() -> pb.StatsRequest:
    return pb.StatsRequest()


def prefix_update_to_proto(update: PrefixUpdate) -> pb.PrefixCacheUpdate:
    return pb.PrefixCacheUpdate(reset=update.reset, block_size=update.block_size, stored=update.stored,
                                removed=update.removed)


def prefix_update_from_proto(msg: pb.PrefixCacheUpdate) -> PrefixUpdate:
    return PrefixUpdate(msg.reset, msg.block_size, tuple(msg.stored), tuple(msg.removed))


def watch_prefix_cache_request() -> pb.WatchPrefixCacheRequest:
    return pb.WatchPrefixCacheRequest()
