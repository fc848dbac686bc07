"""Tool calling, as vLLM 0.32's server does it with a tool parser configured (``model.tool_parser``,
vLLM's ``--enable-auto-tool-choice --tool-call-parser``).

- ``tool_choice`` a named function: the output is constrained to that function's parameters schema
  (vLLM's structured outputs) and returned as one call of it, ``finish_reason`` as the engine ends.
- ``required``: the output is constrained to a JSON list of ``{"name", "parameters"}`` objects, one per
  call, each of a listed function (vllm/tool_parsers/utils.py ``get_json_schema_from_tools``), and
  returned as those calls; ``finish_reason`` "tool_calls" where the engine stopped.
- ``auto`` (or no ``tool_choice``): the model's own tool-call syntax is parsed by vLLM's tool parser
  (vllm/tool_parsers/, e.g. ``hermes`` for ``<tool_call>{...}</tool_call>``); the rest is content.
  Without ``model.tool_parser`` the text is returned as content, as vLLM's server does.
- ``none``: the chat template still gets the tools; the text is content.

A streamed tool-call request sends its calls (and any content) when its output is complete: the
parse needs the whole output (vLLM streams partial arguments instead; the assembled result is the same).
"""
from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from services.worker_api.types import StructuredOutput


@dataclass(frozen=True, slots=True)
class ToolCall:
    name: str
    arguments: str  # JSON text
    id: str = ""

    def body(self, index: int | None = None) -> dict:
        call = {"id": self.id or f"chatcmpl-tool-{uuid.uuid4().hex}", "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}
        return call if index is None else {"index": index, **call}


def forced_schema(tools: tuple[dict, ...], tool_choice: str | dict | None) -> StructuredOutput | None:
    """The constraint a named or ``required`` tool choice puts on the output (None for the others)."""
    if isinstance(tool_choice, dict):
        name = tool_choice["function"]["name"]
        params = next(t["function"].get("parameters") for t in tools if t["function"]["name"] == name)
        return StructuredOutput("json", json.dumps(_params_or_empty_object(params)))
    if tool_choice == "required":
        defs: dict[str, Any] = {}
        schemas = []
        for tool in tools:
            params = dict(tool["function"].get("parameters") or {})
            defs.update(params.pop("$defs", {}) or {})
            schemas.append({"properties": {"name": {"type": "string", "enum": [tool["function"]["name"]]},
                                           "parameters": _params_or_empty_object(params)},
                            "required": ["name", "parameters"]})
        schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": schemas}}
        if defs:
            schema["$defs"] = defs
        return StructuredOutput("json", json.dumps(schema))
    return None


def _params_or_empty_object(params: dict | None) -> dict:
    return params if params else {"type": "object", "properties": {}}


class ToolCalls:
    """Tool-call requests: the constraint on their output, and their finished output as (content, calls).

    With ``model.tool_parser`` both come from vLLM's own parser (``vllm.parser.ParserManager``), exactly as
    vLLM's server computes them: the parser's structural tag constrains the call syntax (for ``auto`` too)
    and the parser reads the calls. Without one, named and ``required`` choices are constrained to JSON
    (``forced_schema``) and read here; ``auto`` returns the text."""

    def __init__(self, parser_name: str | None, model_path: Path) -> None:
        self._parser_name = parser_name
        self._model_path = model_path
        self._parser_cls = None
        self._tokenizer = None

    def check(self) -> None:
        """Raises ValueError when the configured parser is not one this vLLM offers."""
        if self._parser_name is None:
            return
        from vllm.tool_parsers import ToolParserManager

        offered = ToolParserManager.list_registered()
        if self._parser_name not in offered:
            raise ValueError(f"model.tool_parser {self._parser_name!r} is not a tool parser of this vLLM; it offers: "
                             f"{', '.join(sorted(offered))}")

    def structured(self, body: dict, tools: tuple[dict, ...],
                   tool_choice: str | dict | None) -> StructuredOutput | None:
        """The constraint on a tool request's output (None: none beyond what the request asked)."""
        if self._parser_name is None:
            return forced_schema(tools, tool_choice)
        request = self._request(body)
        request = self._parser(request).adjust_request(request)
        return _from_vllm(request.structured_outputs)

    def parse(self, text: str, token_ids: list[int], finish_reason: str | None, body: dict,
              tool_choice: str | dict | None, tools: tuple[dict, ...]) -> tuple[str | None, list[ToolCall], str | None]:
        """(content, calls, finish_reason) of a finished output, as vLLM's chat server builds its message."""
        if not tools or tool_choice == "none":
            return text, [], finish_reason
        if self._parser_name is None:
            return _parse_forced(text, finish_reason, tool_choice)
        request = self._request(body)
        parser = self._parser(request)
        _, content, calls = parser.parse(text, request, enable_auto_tools=True, model_output_token_ids=token_ids)
        found = [ToolCall(c.name, c.arguments, getattr(c, "id", None) or "") for c in calls or []]
        if isinstance(tool_choice, dict) or tool_choice == "required":
            finish = "tool_calls" if tool_choice == "required" and finish_reason == "stop" else finish_reason
            return content or "", found, finish
        return content, found, "tool_calls" if found else finish_reason

    def streaming(self, body: dict, prompt_ids: list[int], tool_choice: str | dict | None) -> ToolStream | None:
        """A stream's tool-call deltas as vLLM's server streams them (its parser's ``parse_delta``); None
        without a tool parser (the calls are then sent whole once the output is complete)."""
        if self._parser_name is None:
            return None
        request = self._request(body)
        return ToolStream(self._parser(request), request, prompt_ids, isinstance(tool_choice, dict))

    def _request(self, body: dict):
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

        return ChatCompletionRequest.model_validate(body)

    def _parser(self, request):
        if self._parser_cls is None:
            from vllm.parser import ParserManager
            from vllm.tokenizers import get_tokenizer

            self._tokenizer = get_tokenizer(str(self._model_path))
            self._parser_cls = ParserManager.get_parser(tool_parser_name=self._parser_name, enable_auto_tools=True,
                                                        tokenizer=self._tokenizer)
        return self._parser_cls(self._tokenizer, request.tools)


class ToolStream:
    """One streamed choice of a tool request: each delta's message as vLLM's chat server sends it."""

    def __init__(self, parser, request, prompt_ids: list[int], named: bool) -> None:
        self._parser = parser
        self._request = request
        self._prompt_ids = prompt_ids
        self._named = named
        self._called = False

    def feed(self, text: str, token_ids: list[int], finish_reason: str | None) -> tuple[dict | None, str | None]:
        """(the chunk's delta, None: nothing to send yet; the chunk's finish_reason)."""
        message = self._parser.parse_delta(delta_text=text, delta_token_ids=token_ids, request=self._request,
                                           prompt_token_ids=self._prompt_ids, finished=finish_reason is not None)
        if message is not None and message.tool_calls:
            self._called = True
        if finish_reason == "stop" and self._called and not self._named:
            finish_reason = "tool_calls"
        delta = message.model_dump(mode="json", exclude_unset=True) if message is not None else None
        return delta, finish_reason


def _parse_forced(text: str, finish_reason: str | None,
                  tool_choice: str | dict | None) -> tuple[str | None, list[ToolCall], str | None]:
    if isinstance(tool_choice, dict):
        if not text.strip():
            return "", [], finish_reason
        return "", [ToolCall(tool_choice["function"]["name"], text)], finish_reason
    if tool_choice == "required":
        calls = []
        try:
            parsed = json.loads(text)
        except json.JSONDecodeError:
            parsed = []
        for item in parsed if isinstance(parsed, list) else []:
            if isinstance(item, dict) and isinstance(item.get("name"), str):
                calls.append(ToolCall(item["name"], json.dumps(item.get("parameters"), ensure_ascii=False)))
        return "", calls, "tool_calls" if finish_reason == "stop" else finish_reason
    return text, [], finish_reason


def _from_vllm(params) -> StructuredOutput | None:
    """vLLM's ``StructuredOutputsParams`` (as its parser set them) as the worker API's StructuredOutput."""
    if params is None:
        return None
    if params.structural_tag is not None:
        return StructuredOutput("structural_tag", params.structural_tag)
    if params.json is not None:
        return StructuredOutput("json", params.json if isinstance(params.json, str) else json.dumps(params.json))
    if params.json_object:
        return StructuredOutput("json_object")
    if params.regex is not None:
        return StructuredOutput("regex", params.regex)
    if params.choice is not None:
        return StructuredOutput("choice", json.dumps(params.choice))
    if params.grammar is not None:
        return StructuredOutput("grammar", params.grammar)
    return None
