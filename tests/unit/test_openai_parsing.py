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
        ({"model": MODEL, "prompt": ["a", "b"]}, "completion", 400, "prompt"),
        (chat(n=2), "chat", 400, "n"),
        (chat(min_tokens=8), "chat", 400, "min_tokens"),
        (chat(logprobs=True), "chat", 400, "logprobs"),
        (chat(tools=[{"type": "function"}]), "chat", 400, "tools"),
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
