"""Parsing and validation of OpenAI request bodies into plain request objects."""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, replace
from typing import Any, Literal

from services.worker_api.types import MAX_TOP_LOGPROBS, Sampling, StructuredOutput
from services.router.errors import bad_request, model_not_found, unsupported

MESSAGE_ROLES = ("system", "developer", "user", "assistant", "tool")
MAX_LOGIT_BIAS_ENTRIES = 1024
MAX_LOGIT_BIAS = 100.0
# Parameters we refuse rather than silently ignore: (name, is_default(value), why). README.md's
# "OpenAI API reference" lists each as refused (tests/e2e/embedded/test_api_parity.py checks both).
UNSUPPORTED = (
    ("suffix", lambda v: v in (None, ""), "insertion (suffix) needs a fill-in-the-middle model; the served one is not"),
    ("functions", lambda v: not v, "the legacy 'functions' field is not supported; use 'tools'"),
    ("function_call", lambda v: v in (None, "none", "auto"),
     "the legacy 'function_call' field is not supported; use 'tool_choice'"),
    ("use_beam_search", lambda v: not v, "beam search is not supported"),
    *((name, lambda v: v is None, "removed in vLLM 0.32 (its server ignores it); use 'structured_outputs' or "
       "'response_format'") for name in ("guided_json", "guided_regex", "guided_choice", "guided_grammar")),
)
STRUCTURED_KEYS = ("json", "regex", "choice", "grammar", "json_object")


@dataclass(frozen=True, slots=True)
class ApiRequest:
    """A validated request; the prompt is still text/messages (tokenized later)."""

    kind: Literal["chat", "completion"]
    model: str
    messages: tuple[dict, ...] | None
    prompt: str | list[int] | None  # the first (for a completion batch: see ``prompts``)
    max_tokens: int | None
    sampling: Sampling
    stream: bool
    include_usage: bool
    prompts: tuple[str | list[int], ...] = ()  # a completion's prompts (one, or a batch)
    n: int = 1
    echo: bool = False  # completions: the prompt (and its logprobs) before the output
    logprobs: int | None = None  # completions: the int; chat: top_logprobs when logprobs is true, else None
    tools: tuple[dict, ...] = ()
    tool_choice: str | dict | None = None  # "none", "auto", "required" or {"type": "function", ...}
    body: dict | None = None  # a tool request's body, as vLLM's tool parsers read it

    @property
    def uses_tools(self) -> bool:
        return bool(self.tools) and self.tool_choice != "none"

    @property
    def num_sequences(self) -> int:
        return max(1, len(self.prompts)) * self.n


def parse_request(body: Any, kind: Literal["chat", "completion"], served_model: str,
                  vocab_size: int | None = None, max_structured_bytes: int = 64 << 10) -> ApiRequest:
    if not isinstance(body, dict):
        raise bad_request("The request body must be a JSON object")
    model = _require(body, "model", str)
    if model != served_model:
        raise model_not_found(model)
    for name, is_default, what in UNSUPPORTED:
        if not is_default(body.get(name)):
            raise unsupported(name, what)
    stream = _optional(body, "stream", bool, False)
    n = _bounded_int(body, "n", 1, 1, MAX_N)
    best_of = _optional(body, "best_of", int, None)
    if best_of is not None and best_of != n:
        raise unsupported("best_of", f"only best_of equal to n ({n}) is supported: vLLM 0.32 does not rank candidates")
    echo = _optional(body, "echo", bool, False)
    if echo and kind == "chat":
        raise unsupported("echo", "echo is honoured for /v1/completions only")
    max_tokens = _max_tokens(body, kind, allow_zero=echo)
    logprobs = _logprobs(body, kind)
    tools, tool_choice = _tools(body) if kind == "chat" else ((), None)
    prompts = _prompts(body, vocab_size) if kind == "completion" else ()
    sampling = _sampling(body, kind, logprobs, echo, vocab_size, max_structured_bytes)
    if n > 1 and sampling.temperature == 0:
        raise bad_request(f"'n' must be 1 when using greedy sampling (temperature 0), got {n}", param="n")
    if max_tokens is not None and sampling.min_tokens > max(max_tokens, 1):
        raise bad_request(f"'min_tokens' ({sampling.min_tokens}) must be at most 'max_tokens' ({max_tokens})",
                          param="min_tokens")
    if tool_choice not in (None, "none", "auto") and sampling.structured is not None:
        raise bad_request("'tool_choice' 'required' or a named function cannot be combined with "
                          "'response_format' or 'structured_outputs'", param="tool_choice")
    if tools and tool_choice is None:
        tool_choice = "auto"  # as vLLM's server reads tools without a tool_choice
    return ApiRequest(
        kind=kind,
        model=model,
        messages=_messages(body) if kind == "chat" else None,
        prompt=prompts[0] if prompts else None,
        max_tokens=max_tokens,
        sampling=sampling,
        stream=stream,
        include_usage=stream and _include_usage(body),
        prompts=prompts,
        n=n,
        echo=echo,
        logprobs=logprobs,
        tools=tools,
        tool_choice=tool_choice,
        body=body if tools else None,
    )


MAX_N = 16


def with_max_tokens(sampling: Sampling, max_tokens: int) -> Sampling:
    return replace(sampling, max_tokens=max_tokens)


def _sampling(body: dict, kind: str, logprobs: int | None, echo: bool, vocab_size: int | None,
              max_structured_bytes: int) -> Sampling:
    temperature = _number(body, "temperature", 1.0, 0.0, 2.0)
    top_p = _number(body, "top_p", 1.0, 0.0, 1.0)
    if top_p == 0.0:
        raise bad_request("'top_p' must be greater than 0", param="top_p")
    repetition_penalty = _number(body, "repetition_penalty", 1.0, 0.0, 100.0)
    if repetition_penalty == 0.0:
        raise bad_request("'repetition_penalty' must be greater than 0", param="repetition_penalty")
    prompt_logprobs = body.get("prompt_logprobs")
    if prompt_logprobs is not None:
        prompt_logprobs = _bounded_int(body, "prompt_logprobs", 0, 0, MAX_TOP_LOGPROBS)
    elif echo and logprobs is not None:
        prompt_logprobs = logprobs
    top_k = _bounded_int(body, "top_k", 0, -1, 1 << 20)
    return Sampling(
        max_tokens=0,
        temperature=temperature,
        top_p=top_p,
        seed=_optional(body, "seed", int, None),
        stop=_stop(body),
        stop_token_ids=tuple(_token_ids(body, "stop_token_ids", vocab_size)),
        ignore_eos=_optional(body, "ignore_eos", bool, False),
        top_logprobs=logprobs or 0,
        logprobs=logprobs is not None,
        prompt_logprobs=prompt_logprobs,
        top_k=max(top_k, 0),
        min_p=_number(body, "min_p", 0.0, 0.0, 1.0),
        presence_penalty=_number(body, "presence_penalty", 0.0, -2.0, 2.0),
        frequency_penalty=_number(body, "frequency_penalty", 0.0, -2.0, 2.0),
        repetition_penalty=repetition_penalty,
        min_tokens=_bounded_int(body, "min_tokens", 0, 0, 1 << 30),
        logit_bias=_logit_bias(body, vocab_size),
        structured=structured_output(body, max_structured_bytes),
    )


def _logprobs(body: dict, kind: str) -> int | None:
    """Completions: ``logprobs`` (0 to 20, the most likely tokens besides the sampled one); chat:
    ``top_logprobs`` when ``logprobs`` is true. None: no log probabilities."""
    if kind == "completion":
        value = body.get("logprobs")
        if value is None:
            return None
        return _bounded_int(body, "logprobs", 0, 0, MAX_TOP_LOGPROBS)
    wanted = _optional(body, "logprobs", bool, False)
    top = _bounded_int(body, "top_logprobs", 0, 0, MAX_TOP_LOGPROBS)
    if top and not wanted:
        raise bad_request("'top_logprobs' requires 'logprobs' to be true", param="top_logprobs")
    return top if wanted else None


def _logit_bias(body: dict, vocab_size: int | None) -> tuple[tuple[int, float], ...]:
    bias = body.get("logit_bias")
    if bias is None:
        return ()
    if not isinstance(bias, dict):
        raise bad_request("'logit_bias' must be an object of token ids to numbers", param="logit_bias")
    if len(bias) > MAX_LOGIT_BIAS_ENTRIES:
        raise bad_request(f"'logit_bias' has {len(bias)} entries; at most {MAX_LOGIT_BIAS_ENTRIES}", param="logit_bias")
    entries = []
    for key, value in bias.items():
        try:
            token = int(key)
        except (TypeError, ValueError):
            raise bad_request(f"'logit_bias' key {key!r} is not a token id", param="logit_bias") from None
        if token < 0 or (vocab_size is not None and token >= vocab_size):
            raise bad_request(f"'logit_bias' holds token id {token}, outside the model's vocabulary (0 to "
                              f"{(vocab_size or 1) - 1})", param="logit_bias")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
                or not -MAX_LOGIT_BIAS <= value <= MAX_LOGIT_BIAS:
            raise bad_request(f"'logit_bias' value for token {token} must be a number between -100 and 100",
                              param="logit_bias")
        entries.append((token, float(value)))
    return tuple(sorted(entries))


def _token_ids(body: dict, name: str, vocab_size: int | None) -> list[int]:
    value = body.get(name)
    if value is None:
        return []
    if not isinstance(value, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        raise bad_request(f"'{name}' must be a list of token ids", param=name)
    bad = next((t for t in value if t < 0 or (vocab_size is not None and t >= vocab_size)), None)
    if bad is not None:
        raise bad_request(f"'{name}' holds token id {bad}, outside the model's vocabulary", param=name)
    return value


def structured_output(body: dict, max_bytes: int) -> StructuredOutput | None:
    """``response_format`` (OpenAI's ``json_object`` and ``json_schema``) or vLLM's ``structured_outputs``
    (exactly one of json, regex, choice, grammar, json_object) as the worker's StructuredOutput."""
    response_format = body.get("response_format")
    structured = body.get("structured_outputs")
    found = None
    if response_format is not None:
        if not isinstance(response_format, dict) or response_format.get("type") not in ("text", "json_object",
                                                                                       "json_schema"):
            raise bad_request("'response_format.type' must be one of text, json_object, json_schema",
                              param="response_format")
        kind = response_format["type"]
        if kind == "json_object":
            found = StructuredOutput("json_object")
        elif kind == "json_schema":
            schema = response_format.get("json_schema")
            if not isinstance(schema, dict) or not isinstance(schema.get("schema", {}), dict):
                raise bad_request("'response_format.json_schema' must be an object with a 'schema' object",
                                  param="response_format")
            found = StructuredOutput("json", json.dumps(schema.get("schema", {})))
    if structured is not None:
        if not isinstance(structured, dict):
            raise bad_request("'structured_outputs' must be an object", param="structured_outputs")
        given = [k for k in STRUCTURED_KEYS if structured.get(k) not in (None, False)]
        if len(given) != 1 or found is not None:
            raise bad_request("'structured_outputs' must set exactly one of json, regex, choice, grammar, json_object "
                              "(and not together with 'response_format')", param="structured_outputs")
        key, value = given[0], structured[given[0]]
        if key == "json_object":
            found = StructuredOutput("json_object")
        elif key == "json":
            if isinstance(value, str):
                value = _json_text(value, "structured_outputs.json")
            if not isinstance(value, dict):
                raise bad_request("'structured_outputs.json' must be a JSON schema object",
                                  param="structured_outputs.json")
            found = StructuredOutput("json", json.dumps(value))
        elif key == "choice":
            if not isinstance(value, list) or not value or not all(isinstance(c, str) for c in value):
                raise bad_request("'structured_outputs.choice' must be a non-empty list of strings",
                                  param="structured_outputs.choice")
            found = StructuredOutput("choice", json.dumps(value))
        else:
            if not isinstance(value, str) or not value:
                raise bad_request(f"'structured_outputs.{key}' must be a non-empty string",
                                  param=f"structured_outputs.{key}")
            found = StructuredOutput(key, value)
    if found is not None and len(found.spec.encode()) > max_bytes:
        param = "response_format" if response_format is not None else "structured_outputs"
        raise bad_request(f"The structured-output spec is {len(found.spec.encode())} bytes; at most {max_bytes} "
                          "(router.max_structured_output_bytes)", param=param)
    return found


def _json_text(text: str, param: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise bad_request(f"'{param}' is not valid JSON: {exc}", param=param) from None


def _tools(body: dict) -> tuple[tuple[dict, ...], str | dict | None]:
    tools = body.get("tools")
    if tools is None:
        tools = []
    if not isinstance(tools, list):
        raise bad_request("'tools' must be a list", param="tools")
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type", "function") != "function" or not isinstance(function, dict) \
                or not isinstance(function.get("name"), str) or not function["name"]:
            raise bad_request(f"'tools[{i}]' must be {{\"type\": \"function\", \"function\": {{\"name\": ...}}}}",
                              param=f"tools[{i}]")
        if not isinstance(function.get("parameters", {}), dict):
            raise bad_request(f"'tools[{i}].function.parameters' must be a JSON schema object",
                              param=f"tools[{i}].function.parameters")
    choice = body.get("tool_choice")
    names = [t["function"]["name"] for t in tools]
    if choice is None:
        return tuple(tools), None
    if isinstance(choice, str):
        if choice not in ("none", "auto", "required"):
            raise bad_request("'tool_choice' must be none, auto, required or a named function", param="tool_choice")
        if choice == "required" and not tools:
            raise bad_request("'tool_choice' 'required' needs 'tools'", param="tool_choice")
        return tuple(tools), choice
    name = choice.get("function", {}).get("name") if isinstance(choice, dict) and isinstance(choice.get("function"),
                                                                                             dict) else None
    if not isinstance(name, str):
        raise bad_request("'tool_choice' must be none, auto, required or {\"type\": \"function\", \"function\": "
                          "{\"name\": ...}}", param="tool_choice")
    if name not in names:
        raise bad_request(f"'tool_choice' names function {name!r}, which is not in 'tools'", param="tool_choice")
    return tuple(tools), {"type": "function", "function": {"name": name}}


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
    out = {"role": "system" if role == "developer" else role, "content": _content(message.get("content"), param)}
    if role == "assistant" and message.get("tool_calls"):
        out["tool_calls"] = _tool_calls(message["tool_calls"], param)
    if role == "tool" and message.get("tool_call_id") is not None:
        out["tool_call_id"] = str(message["tool_call_id"])
    if isinstance(message.get("name"), str):
        out["name"] = message["name"]
    return out


def _tool_calls(calls: Any, param: str) -> list[dict]:
    """An assistant message's tool calls as chat templates take them (arguments as an object where they
    are JSON text, as vLLM's server passes them)."""
    if not isinstance(calls, list):
        raise bad_request(f"'{param}.tool_calls' must be a list", param=f"{param}.tool_calls")
    out = []
    for i, call in enumerate(calls):
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise bad_request(f"'{param}.tool_calls[{i}].function.name' is required",
                              param=f"{param}.tool_calls[{i}]")
        arguments = function.get("arguments", "{}")
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError:
                pass
        out.append({"id": call.get("id"), "type": "function",
                    "function": {"name": function["name"], "arguments": arguments}})
    return out


def _content(content: Any, param: str) -> str:
    if isinstance(content, str):
        return content
    if content is None:
        return ""
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text" for p in content):
        return "".join(str(p.get("text", "")) for p in content)
    raise bad_request(f"'{param}.content' must be a string or a list of text parts", param=f"{param}.content")


def _prompts(body: dict, vocab_size: int | None) -> tuple[str | list[int], ...]:
    """A completion's prompts: a string, a list of token ids, or a list of either (a batch)."""
    prompt = body.get("prompt")
    if prompt is None:
        raise bad_request("'prompt' is a required property", param="prompt")
    if isinstance(prompt, str) or _is_token_list(prompt):
        prompts = [prompt]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, str) or _is_token_list(p) for p in prompt):
        prompts = prompt
    else:
        raise bad_request("'prompt' must be a string, a list of token ids, or a non-empty list of either",
                          param="prompt")
    if any(p == "" or p == [] for p in prompts):
        raise bad_request("'prompt' must not be empty", param="prompt")
    return tuple(prompts)


def _is_token_list(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(t, int) and not isinstance(t, bool)
                                                           for t in value)


def _max_tokens(body: dict, kind: str, allow_zero: bool = False) -> int | None:
    """None: as many as the context leaves. 0 only with ``echo`` (the prompt alone)."""
    names = ("max_completion_tokens", "max_tokens") if kind == "chat" else ("max_tokens",)
    for name in names:
        value = _optional(body, name, int, None)
        if value is not None:
            if value < (0 if allow_zero else 1):
                raise bad_request(f"'{name}' must be at least {0 if allow_zero else 1}", param=name)
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


def _bounded_int(body: dict, name: str, default: int, low: int, high: int) -> int:
    value = _optional(body, name, int, None)
    if value is None:
        return default
    if not low <= value <= high:
        raise bad_request(f"'{name}' must be between {low} and {high}", param=name)
    return value


def _number(body: dict, name: str, default: float, low: float, high: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise bad_request(f"'{name}' must be a number", param=name)
    if not low <= value <= high:
        raise bad_request(f"'{name}' must be between {low:g} and {high:g}", param=name)
    return float(value)
