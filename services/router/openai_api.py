"""Parsing and validation of OpenAI request bodies into plain request objects."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from services.worker_api.types import Sampling
from services.router.errors import bad_request, model_not_found, unsupported

MESSAGE_ROLES = ("system", "developer", "user", "assistant", "tool")
# Parameters we refuse rather than silently ignore: (name, is_default(value), why).
UNSUPPORTED = (
    ("n", lambda v: v in (None, 1), "only n=1 is supported"),
    ("best_of", lambda v: v in (None, 1), "only best_of=1 is supported"),
    ("echo", lambda v: not v, "echoing the prompt is not supported"),
    ("logprobs", lambda v: v in (None, False), "log probabilities are not supported"),
    ("top_logprobs", lambda v: v in (None, 0), "log probabilities are not supported"),
    ("suffix", lambda v: v in (None, ""), "insertion (suffix) is not supported"),
    ("logit_bias", lambda v: not v, "logit bias is not supported"),
    ("presence_penalty", lambda v: v in (None, 0), "only 0 is supported"),
    ("frequency_penalty", lambda v: v in (None, 0), "only 0 is supported"),
    ("tools", lambda v: not v, "tool calling is not supported"),
    ("functions", lambda v: not v, "function calling is not supported"),
    ("response_format", lambda v: v in (None, {"type": "text"}), "only the text format is supported"),
    ("min_tokens", lambda v: v in (None, 0), "min_tokens is not supported (use ignore_eos with max_tokens)"),
)


@dataclass(frozen=True, slots=True)
class ApiRequest:
    """A validated request; the prompt is still text/messages (tokenized later)."""

    kind: Literal["chat", "completion"]
    model: str
    messages: tuple[dict, ...] | None
    prompt: str | list[int] | None
    max_tokens: int | None
    sampling: Sampling
    stream: bool
    include_usage: bool


def parse_request(body: Any, kind: Literal["chat", "completion"], served_model: str) -> ApiRequest:
    if not isinstance(body, dict):
        raise bad_request("The request body must be a JSON object")
    model = _require(body, "model", str)
    if model != served_model:
        raise model_not_found(model)
    for name, is_default, what in UNSUPPORTED:
        if not is_default(body.get(name)):
            raise unsupported(name, what)
    stream = _optional(body, "stream", bool, False)
    return ApiRequest(
        kind=kind,
        model=model,
        messages=_messages(body) if kind == "chat" else None,
        prompt=_prompt(body) if kind == "completion" else None,
        max_tokens=_max_tokens(body, kind),
        sampling=_sampling(body),
        stream=stream,
        include_usage=stream and _include_usage(body),
    )


def with_max_tokens(sampling: Sampling, max_tokens: int) -> Sampling:
    from dataclasses import replace

    return replace(sampling, max_tokens=max_tokens)


def _sampling(body: dict) -> Sampling:
    temperature = _number(body, "temperature", 1.0, 0.0, 2.0)
    top_p = _number(body, "top_p", 1.0, 0.0, 1.0)
    if top_p == 0.0:
        raise bad_request("'top_p' must be greater than 0", param="top_p")
    return Sampling(
        max_tokens=0,
        temperature=temperature,
        top_p=top_p,
        seed=_optional(body, "seed", int, None),
        stop=_stop(body),
        ignore_eos=_optional(body, "ignore_eos", bool, False),
    )


def _messages(body: dict) -> tuple[dict, ...]:
    messages = _require(body, "messages", list)
    if not messages:
        raise bad_request("'messages' must contain at least one message", param="messages")
    return tuple(_message(m, i) for i, m in enumerate(messages))


def _message(message: Any, index: int) -> dict:
    param = f"messages[{index}]"
    if not isinstance(message, dict):
        raise bad_request(f"'{param}' must be an object", param=param)
    role = message.get("role")
    if role not in MESSAGE_ROLES:
        raise bad_request(f"'{param}.role' must be one of {', '.join(MESSAGE_ROLES)}", param=f"{param}.role")
    return {"role": "system" if role == "developer" else role, "content": _content(message.get("content"), param)}


def _content(content: Any, param: str) -> str:
    if isinstance(content, str):
        return content
    if content is None:
        return ""
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text" for p in content):
        return "".join(str(p.get("text", "")) for p in content)
    raise bad_request(f"'{param}.content' must be a string or a list of text parts", param=f"{param}.content")


def _prompt(body: dict) -> str | list[int]:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return prompt
    if prompt is None:
        raise bad_request("'prompt' is a required property", param="prompt")
    raise bad_request("'prompt' must be a string, a list of token ids, or a list of one of those "
                      "(batches of prompts are not supported)", param="prompt")


def _max_tokens(body: dict, kind: str) -> int | None:
    names = ("max_completion_tokens", "max_tokens") if kind == "chat" else ("max_tokens",)
    for name in names:
        value = _optional(body, name, int, None)
        if value is not None:
            if value < 1:
                raise bad_request(f"'{name}' must be at least 1", param=name)
            return value
    return None


def _stop(body: dict) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    if isinstance(stop, str):
        return (stop,) if stop else ()  # an empty stop string stops nothing (vLLM refuses it)
    if isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        return tuple(s for s in stop if s)
    raise bad_request("'stop' must be a string or a list of strings", param="stop")


def _include_usage(body: dict) -> bool:
    options = body.get("stream_options")
    if options is None:
        return False
    if not isinstance(options, dict):
        raise bad_request("'stream_options' must be an object", param="stream_options")
    return _optional(options, "include_usage", bool, False, param="stream_options.include_usage")


def _require(body: dict, name: str, kind: type) -> Any:
    if name not in body or body[name] is None:
        raise bad_request(f"'{name}' is a required property", param=name)
    return _optional(body, name, kind, None)


def _optional(body: dict, name: str, kind: type, default: Any, param: str | None = None) -> Any:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise bad_request(f"'{param or name}' must be of type {kind.__name__}", param=param or name)
    return value


def _number(body: dict, name: str, default: float, low: float, high: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise bad_request(f"'{name}' must be a number", param=name)
    if not low <= value <= high:
        raise bad_request(f"'{name}' must be between {low:g} and {high:g}", param=name)
    return float(value)
