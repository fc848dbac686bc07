"""Log probabilities in the OpenAI response shapes, as vLLM 0.32's server writes them.

Workers report, per position, vLLM's entries in vLLM's order (the sampled or prompt token first, then
the most likely by rank; ``LogprobEntry``) with the engine's text of each token. These functions shape
them exactly as vllm/entrypoints/openai/{completion,chat_completion}/serving.py do, quirks included:
a completion's ``top_logprobs`` maps each token's text to its log probability over the first
``logprobs + 1`` entries (the sampled token among them), a chat position's ``top_logprobs`` lists the
first ``top_logprobs`` entries in that order, and every log probability is floored at -9999.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

from services.worker_api.types import LogprobEntry

FLOOR = -9999.0
Decode = Callable[[int], str]  # one token id's text, where the worker sent none


class CompletionLogprobs:
    """A completion choice's ``logprobs`` object, built chunk by chunk: ``text_offset`` goes on from the
    previous chunk's last token, as vLLM's stream does."""

    def __init__(self, num_top: int, decode: Decode) -> None:
        self._num_top = num_top
        self._decode = decode
        self._offset = 0

    def chunk(self, token_ids: Sequence[int], positions: Sequence[Sequence[LogprobEntry]]) -> dict:
        tokens: list[str] = []
        token_logprobs: list[float | None] = []
        top_logprobs: list[dict[str, float] | None] = []
        text_offset: list[int] = []
        for i, token_id in enumerate(token_ids):
            entries = positions[i] if i < len(positions) else ()
            own = _entry(entries, token_id)
            if own is None:
                token = self._decode(token_id)
                token_logprobs.append(None)
                top_logprobs.append(None)
            else:
                token = self._text(own)
                token_logprobs.append(max(own.logprob, FLOOR))
                top_logprobs.append({self._text(e): max(e.logprob, FLOOR) for k, e in enumerate(entries)
                                     if self._num_top >= k})
            tokens.append(token)
            text_offset.append(self._offset)
            self._offset += len(token)
        return {"text_offset": text_offset, "token_logprobs": token_logprobs, "tokens": tokens,
                "top_logprobs": top_logprobs}

    def _text(self, entry: LogprobEntry) -> str:
        return entry.token if entry.token is not None else self._decode(entry.token_id)


def chat_logprobs(token_ids: Sequence[int], positions: Sequence[Sequence[LogprobEntry]], num_top: int,
                  decode: Decode) -> dict:
    """A chat choice's (or chunk's) ``logprobs``: ``{"content": [...]}``."""
    content = []
    for i, token_id in enumerate(token_ids):
        entries = positions[i] if i < len(positions) else ()
        own = _entry(entries, token_id)
        if own is None:
            token = decode(token_id)
            content.append({"token": token, "logprob": FLOOR, "bytes": _bytes(token), "top_logprobs": []})
            continue
        token = own.token if own.token is not None else decode(token_id)
        content.append({
            "token": token,
            "logprob": max(own.logprob, FLOOR),
            "bytes": _bytes(own.token) if own.token is not None else None,
            "top_logprobs": [{"token": (text := e.token if e.token is not None else decode(e.token_id)),
                              "logprob": max(e.logprob, FLOOR), "bytes": _bytes(text)}
                             for k, e in enumerate(entries) if k < num_top],
        })
    return {"content": content}


def _entry(entries: Sequence[LogprobEntry], token_id: int) -> LogprobEntry | None:
    return next((e for e in entries if e.token_id == token_id), None)


def _bytes(text: str) -> list[int]:
    return list(text.encode("utf-8", errors="replace"))
