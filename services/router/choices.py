"""One choice of a response (a prompt's n-th sample) as the client sees it: echo, logprobs, text.

A request with ``n`` > 1, or a completion with a list of prompts, runs as one worker request per
choice (each routed, admitted and moved on its own), numbered as vLLM numbers them:
``prompt index x n + sample index``. A seeded request's choices get ``seed + sample index``, as
vLLM's parallel sampling gives its children.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

from services.router.logprobs import CompletionLogprobs, chat_logprobs
from services.router.openai_api import ApiRequest
from services.worker_api.types import LogprobEntry, Sampling, TokenDelta


def choice_sampling(sampling: Sampling, sample_index: int) -> Sampling:
    if sampling.seed is None or sample_index == 0:
        return sampling
    return dataclasses.replace(sampling, seed=sampling.seed + sample_index)


class ChoiceWriter:
    """Turns one choice's deltas into the text and ``logprobs`` the client is sent (per chunk when
    streaming; ``text``/``logprobs`` sum them up for a full response)."""

    def __init__(self, index: int, api_request: ApiRequest, prompt_ids: Sequence[int], prompt_text: str,
                 decode: Callable[[int], str]) -> None:
        self.index = index
        self._kind = api_request.kind
        self._decode = decode
        self._echo = api_request.echo
        self._echo_only = api_request.echo and api_request.max_tokens == 0
        self._prompt_ids = list(prompt_ids)
        self._prompt_text = prompt_text
        self._completion_logprobs = CompletionLogprobs(api_request.logprobs, decode) \
            if api_request.kind == "completion" and api_request.logprobs is not None else None
        self._chat_top = api_request.logprobs if api_request.kind == "chat" else None
        self.texts: list[str] = []
        self.token_ids: list[int] = []  # the generated ones
        self.finish_reason: str | None = None
        self._logprobs: dict | None = None

    @property
    def wants_logprobs(self) -> bool:
        return self._completion_logprobs is not None or self._chat_top is not None

    def piece(self, delta: TokenDelta) -> tuple[str, dict | None]:
        """The text and logprobs of ``delta`` as sent to the client; also kept for ``text``/``logprobs``."""
        text, token_ids, positions = delta.text, list(delta.token_ids), list(delta.top_logprobs)
        self.token_ids.extend(token_ids)
        if self._echo_only:  # max_tokens 0: the engine made one token, which is not the client's
            text, token_ids, positions = "", [], []
        if self._echo:
            self._echo = False
            prompt_positions = list(delta.prompt_logprobs)
            prompt_positions += [()] * (len(self._prompt_ids) - len(prompt_positions))
            text = self._prompt_text + text
            token_ids, positions = self._prompt_ids + token_ids, prompt_positions + positions
        logprobs = self._format(token_ids, positions)
        self.texts.append(text)
        self.finish_reason = delta.finish_reason or self.finish_reason
        if logprobs is not None:
            self._logprobs = _joined(self._logprobs, logprobs)
        return text, logprobs

    @property
    def text(self) -> str:
        return "".join(self.texts)

    @property
    def logprobs(self) -> dict | None:
        if not self.wants_logprobs:
            return None
        return self._logprobs or self._format([], [])

    def _format(self, token_ids: list[int], positions: list[Sequence[LogprobEntry]]) -> dict | None:
        if self._completion_logprobs is not None:
            return self._completion_logprobs.chunk(token_ids, positions)
        if self._chat_top is not None:
            return chat_logprobs(token_ids, positions, self._chat_top, self._decode)
        return None


def _joined(total: dict | None, chunk: dict) -> dict:
    if total is None:
        return {key: list(value) for key, value in chunk.items()}
    for key, value in chunk.items():
        total[key].extend(value)
    return total
