"""The worker API's log probabilities: carried through the protobuf conversions (with the engine's token
texts, and the prompt's), taken from vLLM's per-position dicts in vLLM's order, and bounded at the RPC
edge; and the per-tensor anchor switch of the fp8 codec, read from a worker's environment."""
from __future__ import annotations

import asyncio
from types import SimpleNamespace

import grpc
import pytest
from prfaas.v1 import worker_pb2 as pb

from services.engine.args import SCALE_PER_TENSOR_ENV, codec_scale_per_tensor
from services.engine.engine import _logprobs
from services.worker_api import convert
from services.worker_api.types import MAX_TOP_LOGPROBS, LogprobEntry, TokenDelta


def test_top_logprobs_cross_the_conversions():
    sampling = convert.sampling_from_proto(pb.SamplingParams(max_tokens=4, top_logprobs=5))
    assert sampling.top_logprobs == 5 and convert.sampling_to_proto(sampling).top_logprobs == 5
    delta = TokenDelta("ab", (7, 9), None, 10, 9,
                       ((LogprobEntry(7, -0.5, "a"), LogprobEntry(3, -1.5, "c")), (LogprobEntry(9, -0.25, "b"),)),
                       prompt_logprobs=((), (LogprobEntry(4, -3.0, "x"),)))
    message = convert.delta_to_proto(delta)
    assert [list(t.token_ids) for t in message.top_logprobs] == [[7, 3], [9]]
    assert convert.delta_from_proto(message) == delta
    untexted = TokenDelta("a", (7,), None, 1, 0, ((LogprobEntry(7, -0.5),),))
    assert convert.delta_from_proto(convert.delta_to_proto(untexted)) == untexted
    assert convert.delta_from_proto(convert.delta_to_proto(TokenDelta("", (), "stop", 1, 0))).top_logprobs == ()


def test_vllm_logprobs_keep_vllms_order_sampled_token_first():
    entry = lambda logprob, text="": SimpleNamespace(logprob=logprob, rank=1, decoded_token=text)  # noqa: E731
    assert _logprobs([{4: entry(-2.0, "d"), 8: entry(-0.1, "e")}, {1: entry(-0.3)}]) == (
        (LogprobEntry(4, -2.0, "d"), LogprobEntry(8, -0.1, "e")), (LogprobEntry(1, -0.3, ""),))
    assert _logprobs([None, {1: entry(-0.3)}]) == ((), (LogprobEntry(1, -0.3, ""),))  # a prompt's first position
    assert _logprobs(None) == ()


class _Aborted(Exception):
    pass


class _Context:
    code = None

    async def abort(self, code, details):
        self.code, self.details = code, details
        raise _Aborted(details)


def test_too_many_top_logprobs_is_invalid_argument_before_the_engine():
    from services.decode_worker.server import DecodeWorkerServicer

    servicer = DecodeWorkerServicer(engine=None, identity=None, guard=None)
    request = pb.GenerateRequest(request_id="r", prompt_token_ids=[1, 2],
                                 sampling=pb.SamplingParams(max_tokens=1, top_logprobs=MAX_TOP_LOGPROBS + 1))
    context = _Context()

    async def run():
        async for _ in servicer.Generate(request, context):
            pass

    with pytest.raises(_Aborted, match="at most 20"):
        asyncio.run(run())
    assert context.code == grpc.StatusCode.INVALID_ARGUMENT


@pytest.mark.parametrize("value, expected", [(None, False), ("0", False), ("1", True), ("", False)])
def test_the_per_tensor_anchor_is_off_unless_asked(monkeypatch, value, expected):
    if value is not None:
        monkeypatch.setenv(SCALE_PER_TENSOR_ENV, value)
    assert codec_scale_per_tensor() is expected


def test_a_bad_per_tensor_switch_names_the_variable(monkeypatch):
    monkeypatch.setenv(SCALE_PER_TENSOR_ENV, "yes")
    with pytest.raises(ValueError, match=f"{SCALE_PER_TENSOR_ENV}: 'yes' is not 0 or 1"):
        codec_scale_per_tensor()

