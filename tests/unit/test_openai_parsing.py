import json

import pytest

from services.router.errors import ApiError
from services.router.openai_api import parse_request

MODEL = "m"


def chat(**fields):
    return {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], **fields}


def test_chat_request_fields():
    request = parse_request(chat(max_completion_tokens=7, max_tokens=3, temperature=0, top_p=0.5, seed=3,
                                 stop=["x", ""], stream=True, stream_options={"include_usage": True}),
                            "chat", MODEL)
    assert request.max_tokens == 7
    assert (request.sampling.temperature, request.sampling.top_p, request.sampling.seed) == (0.0, 0.5, 3)
    assert request.sampling.stop == ("x",)
    assert request.stream and request.include_usage


def test_completion_prompt_forms():
    assert parse_request({"model": MODEL, "prompt": "a"}, "completion", MODEL).prompt == "a"
    assert parse_request({"model": MODEL, "prompt": ["a"]}, "completion", MODEL).prompt == "a"
    assert parse_request({"model": MODEL, "prompt": [1, 2]}, "completion", MODEL).prompt == [1, 2]


def test_message_content_parts_and_developer_role():
    request = parse_request({"model": MODEL, "messages": [
        {"role": "developer", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]},
        "chat", MODEL)
    assert request.messages == ({"role": "system", "content": "ab"},)


@pytest.mark.parametrize(
    "body, kind, status, param",
    [
        ([], "chat", 400, None),
        ({"messages": []}, "chat", 400, "model"),
        (chat(model="other"), "chat", 404, "model"),
        ({"model": MODEL}, "chat", 400, "messages"),
        ({"model": MODEL, "messages": []}, "chat", 400, "messages"),
        ({"model": MODEL, "messages": [{"role": "wizard", "content": "x"}]}, "chat", 400, "messages[0].role"),
        ({"model": MODEL, "messages": [{"role": "user", "content": 5}]}, "chat", 400, "messages[0].content"),
        ({"model": MODEL}, "completion", 400, "prompt"),
        ({"model": MODEL, "prompt": ["a", 5]}, "completion", 400, "prompt"),
        ({"model": MODEL, "prompt": []}, "completion", 400, "prompt"),
        ({"model": MODEL, "prompt": [[1], []]}, "completion", 400, "prompt"),
        ({"model": MODEL, "prompt": "a", "suffix": "b"}, "completion", 400, "suffix"),
        ({"model": MODEL, "prompt": "a", "logprobs": 21}, "completion", 400, "logprobs"),
        ({"model": MODEL, "prompt": "a", "max_tokens": 0}, "completion", 400, "max_tokens"),
        (chat(n=0), "chat", 400, "n"),
        (chat(n=17), "chat", 400, "n"),
        (chat(n=2, best_of=3), "chat", 400, "best_of"),
        (chat(echo=True), "chat", 400, "echo"),
        (chat(max_tokens=4, min_tokens=8), "chat", 400, "min_tokens"),
        (chat(top_logprobs=2), "chat", 400, "top_logprobs"),
        (chat(logprobs=True, top_logprobs=21), "chat", 400, "top_logprobs"),
        (chat(presence_penalty=2.5), "chat", 400, "presence_penalty"),
        (chat(frequency_penalty=-3), "chat", 400, "frequency_penalty"),
        (chat(repetition_penalty=0), "chat", 400, "repetition_penalty"),
        (chat(logit_bias={"5": 101}), "chat", 400, "logit_bias"),
        (chat(logit_bias={"x": 1}), "chat", 400, "logit_bias"),
        (chat(logit_bias={"-1": 1}), "chat", 400, "logit_bias"),
        (chat(logit_bias={str(i): 1 for i in range(1025)}), "chat", 400, "logit_bias"),
        (chat(stop_token_ids=["a"]), "chat", 400, "stop_token_ids"),
        (chat(response_format={"type": "yaml"}), "chat", 400, "response_format"),
        (chat(response_format={"type": "json_schema", "json_schema": {"schema": []}}), "chat", 400, "response_format"),
        (chat(response_format={"type": "json_schema", "json_schema": {"schema": {"x": "y" * 70000}}}), "chat", 400,
         "response_format"),
        (chat(structured_outputs={"regex": "a", "choice": ["b"]}), "chat", 400, "structured_outputs"),
        (chat(structured_outputs={"choice": []}), "chat", 400, "structured_outputs.choice"),
        (chat(structured_outputs={"json": "{"}), "chat", 400, "structured_outputs.json"),
        (chat(tools=[{"type": "function"}]), "chat", 400, "tools[0]"),
        (chat(tools=[{"type": "function", "function": {"name": "f"}}], tool_choice="sometimes"), "chat", 400,
         "tool_choice"),
        (chat(tools=[{"type": "function", "function": {"name": "f"}}],
              tool_choice={"type": "function", "function": {"name": "g"}}), "chat", 400, "tool_choice"),
        (chat(tool_choice="required"), "chat", 400, "tool_choice"),
        (chat(functions=[{"name": "f"}]), "chat", 400, "functions"),
        (chat(temperature="hot"), "chat", 400, "temperature"),
        (chat(temperature=3), "chat", 400, "temperature"),
        (chat(top_p=0), "chat", 400, "top_p"),
        (chat(max_tokens=0), "chat", 400, "max_tokens"),
        (chat(max_tokens=True), "chat", 400, "max_tokens"),
        (chat(stop=[1]), "chat", 400, "stop"),
        (chat(stream=True, stream_options={"include_usage": "yes"}), "chat", 400, "stream_options.include_usage"),
    ],
)
def test_bad_requests(body, kind, status, param):
    with pytest.raises(ApiError) as excinfo:
        parse_request(body, kind, MODEL)
    assert (excinfo.value.status, excinfo.value.param) == (status, param)
    assert excinfo.value.body()["error"]["message"]


def test_an_empty_stop_string_stops_nothing():
    """vLLM refuses "" as a stop string; schemathesis sent one, and the worker answered UNKNOWN."""
    assert parse_request(chat(stop=""), "chat", MODEL).sampling.stop == ()


def test_the_sampling_fields_vllm_honours():
    request = parse_request(chat(n=3, presence_penalty=0.5, frequency_penalty=-0.5, repetition_penalty=1.2,
                                 logit_bias={"7": -100, "3": 2.5}, min_tokens=2, stop_token_ids=[5], top_k=4,
                                 min_p=0.1, logprobs=True, top_logprobs=3, seed=9), "chat", MODEL, vocab_size=10)
    sampling = request.sampling
    assert request.n == 3 and request.num_sequences == 3 and request.logprobs == 3
    assert (sampling.presence_penalty, sampling.frequency_penalty, sampling.repetition_penalty) == (0.5, -0.5, 1.2)
    assert sampling.logit_bias == ((3, 2.5), (7, -100.0))
    assert (sampling.min_tokens, sampling.stop_token_ids, sampling.top_k, sampling.min_p) == (2, (5,), 4, 0.1)
    assert sampling.logprobs and sampling.top_logprobs == 3 and sampling.prompt_logprobs is None
    with pytest.raises(ApiError, match="outside the model's vocabulary"):
        parse_request(chat(logit_bias={"10": 1}), "chat", MODEL, vocab_size=10)


def test_completion_logprobs_echo_and_batches():
    request = parse_request({"model": MODEL, "prompt": ["a", [1, 2]], "n": 2, "logprobs": 0, "echo": True,
                             "max_tokens": 0}, "completion", MODEL)
    assert request.prompts == ("a", [1, 2]) and request.num_sequences == 4
    assert request.logprobs == 0 and request.sampling.logprobs and request.sampling.top_logprobs == 0
    assert request.sampling.prompt_logprobs == 0 and request.echo and request.max_tokens == 0
    plain = parse_request({"model": MODEL, "prompt": "a"}, "completion", MODEL)
    assert plain.logprobs is None and not plain.sampling.wants_logprobs


def test_structured_outputs_and_response_formats():
    def structured(**fields):
        return parse_request(chat(**fields), "chat", MODEL).sampling.structured

    assert structured(response_format={"type": "text"}) is None
    assert structured(response_format={"type": "json_object"}).kind == "json_object"
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    json_schema = structured(response_format={"type": "json_schema", "json_schema": {"name": "s", "schema": schema}})
    assert json_schema.kind == "json" and json.loads(json_schema.spec) == schema
    assert json.loads(structured(structured_outputs={"json": json.dumps(schema)}).spec) == schema
    assert structured(structured_outputs={"regex": "[ab]+"}).spec == "[ab]+"
    assert json.loads(structured(structured_outputs={"choice": ["x", "y"]}).spec) == ["x", "y"]
    assert structured(structured_outputs={"grammar": "root ::= \"a\""}).kind == "grammar"


def test_tools_and_tool_choice():
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    request = parse_request(chat(tools=tools, tool_choice={"type": "function", "function": {"name": "f"}}), "chat",
                            MODEL)
    assert request.tools == tuple(tools) and request.tool_choice == {"type": "function", "function": {"name": "f"}}
    assert parse_request(chat(tools=tools, tool_choice="none"), "chat", MODEL).tool_choice == "none"
    assert parse_request(chat(tools=tools, tool_choice="required"), "chat", MODEL).tool_choice == "required"


def test_greedy_sampling_has_one_choice_and_removed_guided_fields_are_refused():
    with pytest.raises(ApiError, match="greedy") as excinfo:
        parse_request(chat(n=2, temperature=0), "chat", MODEL)
    assert excinfo.value.param == "n"
    with pytest.raises(ApiError, match="removed in vLLM 0.32") as excinfo:
        parse_request(chat(guided_choice=["a", "b"]), "chat", MODEL)
    assert excinfo.value.param == "guided_choice"
    tools = [{"type": "function", "function": {"name": "f"}}]
    assert parse_request(chat(tools=tools), "chat", MODEL).tool_choice == "auto"
