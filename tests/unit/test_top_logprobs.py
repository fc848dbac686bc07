"""The worker API's optional top log probabilities (for bench/wire_codec_quality.py): carried through
the protobuf conversions, taken from vLLM's per-position dicts most likely first, and bounded at the
RPC edge; and the per-tensor anchor switch of the fp8 codec, read from a worker's environment."""
from __future__ import annotations

import asyncio
from types import SimpleNamespace

import grpc
import pytest
from prfaas.v1 import worker_pb2 as pb

from services.engine.args import SCALE_PER_TENSOR_ENV, codec_scale_per_tensor
from services.engine.engine import _top_logprobs
from services.worker_api import convert
from services.worker_api.types import MAX_TOP_LOGPROBS, TokenDelta


def test_top_logprobs_cross_the_conversions():
    sampling = convert.sampling_from_proto(pb.SamplingParams(max_tokens=4, top_logprobs=5))
    assert sampling.top_logprobs == 5 and convert.sampling_to_proto(sampling).top_logprobs == 5
    delta = TokenDelta("ab", (7, 9), None, 10, 9, (((7, -0.5), (3, -1.5)), ((9, -0.25),)))
    message = convert.delta_to_proto(delta)
    assert [list(t.token_ids) for t in message.top_logprobs] == [[7, 3], [9]]
    assert convert.delta_from_proto(message) == delta
    assert convert.delta_from_proto(convert.delta_to_proto(TokenDelta("", (), "stop", 1, 0))).top_logprobs == ()


def test_vllm_logprobs_become_pairs_most_likely_first():
    entry = lambda logprob: SimpleNamespace(logprob=logprob, rank=1, decoded_token="")  # noqa: E731
    assert _top_logprobs([{4: entry(-2.0), 8: entry(-0.1)}, {1: entry(-0.3)}]) == (((8, -0.1), (4, -2.0)), ((1, -0.3),))
    assert _top_logprobs(None) == ()


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
