"""The OpenAI response shapes the router builds from worker deltas: logprobs as vLLM's server writes
them, echo, choices' numbering and seeds, tool calls read without a tool parser, and a moved request's
carried settings (services/worker_api/resume.py)."""
from __future__ import annotations

import json

from services.router.choices import ChoiceWriter, choice_sampling
from services.router.logprobs import CompletionLogprobs, chat_logprobs
from services.router.openai_api import parse_request
from services.router.tools import ToolCalls, forced_schema
from services.worker_api.types import LogprobEntry, Sampling, TokenDelta

E = LogprobEntry


def decode(token_id: int) -> str:
    return f"<{token_id}>"


def test_completion_logprobs_take_the_sampled_token_and_logprobs_more_in_vllms_order():
    positions = [(E(5, -0.5, "a"), E(7, -0.4, "bb"), E(9, -2.0, "c")), (E(1, -1e6, "dd"),)]
    shaped = CompletionLogprobs(1, decode)
    first = shaped.chunk([5, 1], positions)
    assert first["tokens"] == ["a", "dd"]
    assert first["token_logprobs"] == [-0.5, -9999.0]  # floored as vLLM floors
    assert first["top_logprobs"] == [{"a": -0.5, "bb": -0.4}, {"dd": -9999.0}]  # logprobs + 1 entries
    assert first["text_offset"] == [0, 1]
    assert shaped.chunk([3], [()])["text_offset"] == [3]  # goes on from the last token of the chunk before
    assert shaped.chunk([3], [()]) == {"text_offset": [6], "token_logprobs": [None], "tokens": ["<3>"],
                                       "top_logprobs": [None]}


def test_chat_logprobs_list_the_first_top_logprobs_entries_with_bytes():
    shaped = chat_logprobs([5], [(E(5, -0.5, "é"), E(7, -0.4, "b"))], 1, decode)
    assert shaped == {"content": [{"token": "é", "logprob": -0.5, "bytes": [195, 169],
                                   "top_logprobs": [{"token": "é", "logprob": -0.5, "bytes": [195, 169]}]}]}
    assert chat_logprobs([5], [(E(5, -0.5, "x"),)], 0, decode)["content"][0]["top_logprobs"] == []


def completion(**fields):
    return parse_request({"model": "m", "prompt": "p", **fields}, "completion", "m")


def test_echo_puts_the_prompt_and_its_logprobs_first_and_max_tokens_0_drops_the_engines_token():
    prompt_logprobs = ((), (E(2, -3.0, "q"), E(4, -1.0, "r")))
    delta = TokenDelta("X", (8,), "length", 2, 0, ((E(8, -0.1, "X"),),), prompt_logprobs)
    writer = ChoiceWriter(0, completion(echo=True, logprobs=0, max_tokens=1), [1, 2], "pq", decode)
    text, logprobs = writer.piece(delta)
    assert text == "pqX" and logprobs["tokens"] == ["<1>", "q", "X"]
    assert logprobs["token_logprobs"] == [None, -3.0, -0.1] and logprobs["top_logprobs"][0] is None
    only = ChoiceWriter(0, completion(echo=True, logprobs=0, max_tokens=0), [1, 2], "pq", decode)
    assert only.piece(delta)[0] == "pq" and only.logprobs["tokens"] == ["<1>", "q"]
    assert only.finish_reason == "length"


def test_choices_are_seeded_as_vllms_parallel_sampling_seeds_its_children():
    sampling = Sampling(max_tokens=4, seed=10)
    assert [choice_sampling(sampling, i).seed for i in range(3)] == [10, 11, 12]
    assert choice_sampling(Sampling(max_tokens=4), 2).seed is None


def test_forced_tool_choices_without_a_parser():
    tools = ({"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}},
             {"type": "function", "function": {"name": "g"}})
    named = {"type": "function", "function": {"name": "g"}}
    assert json.loads(forced_schema(tools, named).spec) == {"type": "object", "properties": {}}
    required = json.loads(forced_schema(tools, "required").spec)
    assert required["type"] == "array" and len(required["items"]["anyOf"]) == 2
    calls = ToolCalls(None, None)
    content, found, finish = calls.parse('{"x": 1}', [], "stop", {}, named, tools)
    assert (content, [(c.name, c.arguments) for c in found], finish) == ("", [("g", '{"x": 1}')], "stop")
    content, found, finish = calls.parse('[{"name": "f", "parameters": {"a": "é"}}]', [], "stop", {}, "required", tools)
    assert [(c.name, c.arguments) for c in found] == [("f", '{"a": "é"}')] and finish == "tool_calls"
    assert calls.parse("hello", [], "stop", {}, "auto", tools) == ("hello", [], "stop")  # no parser: content
