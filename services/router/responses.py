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

    def full(self, choices: list[dict], usage: Usage) -> dict:
        """``choices``: from ``choice`` (in index order)."""
        object_name = "chat.completion" if self.kind == "chat" else "text_completion"
        return {**self._head(object_name), "choices": choices, "usage": usage.body()}

    def choice(self, index: int, text: str, finish_reason: str | None, logprobs: dict | None,
               message: dict | None = None) -> dict:
        """One choice of a full response; ``message`` replaces the chat message built from ``text``."""
        if self.kind == "chat":
            message = message or {"role": "assistant", "content": text}
            return {"index": index, "message": message, "logprobs": logprobs, "finish_reason": finish_reason}
        return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}

    def chunk(self, text: str | None, finish_reason: str | None, include_usage: bool, first: bool = False,
              index: int = 0, logprobs: dict | None = None, delta: dict | None = None) -> dict:
        """One stream chunk of choice ``index``; ``delta`` replaces the chat delta built from ``text``."""
        if self.kind == "chat":
            if delta is None:
                delta = {"role": "assistant", "content": ""} if first else ({"content": text} if text else {})
            choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
            body = {**self._head("chat.completion.chunk"), "choices": [choice]}
        else:
            choice = {"index": index, "text": text or "", "logprobs": logprobs, "finish_reason": finish_reason}
            body = {**self._head("text_completion"), "choices": [choice]}
        if include_usage:
            body["usage"] = None
        return body

    def usage_chunk(self, usage: Usage) -> dict:
        object_name = "chat.completion.chunk" if self.kind == "chat" else "text_completion"
        return {**self._head(object_name), "choices": [], "usage": usage.body()}
