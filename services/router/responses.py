"""OpenAI response bodies and stream chunks for chat and text completions."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int = 0
    cached_tokens: int = 0

    def body(self) -> dict:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
        }


@dataclass(frozen=True, slots=True)
class ResponseShape:
    kind: str
    id: str
    model: str
    created: int

    def _head(self, object_name: str) -> dict:
        return {"id": self.id, "object": object_name, "created": self.created, "model": self.model}

    def full(self, text: str, finish_reason: str | None, usage: Usage) -> dict:
        if self.kind == "chat":
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                      "finish_reason": finish_reason}
            return {**self._head("chat.completion"), "choices": [choice], "usage": usage.body()}
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
        return {**self._head("text_completion"), "choices": [choice], "usage": usage.body()}

    def chunk(self, text: str | None, finish_reason: str | None, include_usage: bool, first: bool = False) -> dict:
        if self.kind == "chat":
            delta = {"role": "assistant", "content": ""} if first else ({"content": text} if text else {})
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
            body = {**self._head("chat.completion.chunk"), "choices": [choice]}
        else:
            choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish_reason}
            body = {**self._head("text_completion"), "choices": [choice]}
        if include_usage:
            body["usage"] = None
        return body

    def usage_chunk(self, usage: Usage) -> dict:
        object_name = "chat.completion.chunk" if self.kind == "chat" else "text_completion"
        return {**self._head(object_name), "choices": [], "usage": usage.body()}
