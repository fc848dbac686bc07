"""A request's progress on its decode worker, kept so that another worker can go on from there.

When a decode worker fails mid-stream, the router sends the prompt plus the tokens generated so far
(as token ids) to another worker, with the remaining token budget and the same sampling settings
(``Continuation.next_input``); the client's stream goes on. Two things do not carry over by
themselves, and this module carries them:

- *Text the engine held back.* vLLM's detokenizer keeps the last ``len(longest stop string) - 1``
  characters of output (and an incomplete UTF-8 character) until it knows they are not a stop
  string, so tokens the router has already counted may have text it never received. That text is
  recovered by detokenizing the generated ids in the context of the prompt (``Continuation.held_text``).
- *Stop strings that straddle the move.* The new worker sees the old output as prompt, so a stop
  string that began before the move and ends after it is not its to find: ``StopScan`` looks for stop
  strings in the held text plus the new worker's output, holding back the same margin vLLM does.

Greedy requests continue token-exact. The new worker counts the moved tokens as output for
penalties, ``min_tokens`` and structured outputs (``Sampling.num_output_prompt_tokens``,
services/worker_api/resume.py); a request whose settings cannot go on exactly (presence penalty,
frequency penalty with a repetition penalty, seeded sampling) does not move: its stream ends with an
error event naming the reason (``resume_problem``).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

from services.worker_api.types import GenerateInput, TokenDelta

# detokenize(context ids, new ids) -> the text of ``new ids`` when they follow ``context ids``
Detokenize = Callable[[Sequence[int], Sequence[int]], str]


class Continuation:
    def __init__(self, request: GenerateInput, detokenize: Detokenize | None = None) -> None:
        self.request = request
        self._detokenize = detokenize
        self.token_ids: list[int] = []
        self.emitted_text = ""
        self.num_prompt_tokens = len(request.prompt_token_ids)
        self.num_cached_tokens = 0
        self.num_moves = 0

    def record(self, delta: TokenDelta) -> None:
        """A delta the client was sent."""
        if not self.token_ids and not self.emitted_text:
            self.num_cached_tokens = delta.num_cached_tokens
        self.token_ids.extend(delta.token_ids)
        self.emitted_text += delta.text

    @property
    def num_remaining_tokens(self) -> int:
        return self.request.sampling.max_tokens - len(self.token_ids)

    def next_input(self) -> GenerateInput | None:
        """The request another worker goes on with (None: the budget is spent). Its id names the
        move, so a worker that still knows the old id cannot confuse the two."""
        if self.num_remaining_tokens <= 0:
            return None
        self.num_moves += 1
        sampling = dataclasses.replace(self.request.sampling, max_tokens=self.num_remaining_tokens,
                                       prompt_logprobs=None, num_output_prompt_tokens=len(self.token_ids))
        return GenerateInput(f"{self.request.request_id}-m{self.num_moves}",
                             list(self.request.prompt_token_ids) + self.token_ids, sampling)

    def held_text(self) -> str:
        """Text of the generated tokens that the failed worker had not sent yet ("" when it cannot be
        told: no detokenizer, or the engine's text is not a prefix of the tokens' text)."""
        if self._detokenize is None or not self.token_ids:
            return ""
        context = self.request.prompt_token_ids[-8:]  # enough for a tokenizer to place the first new token
        full = self._detokenize(context, self.token_ids)
        return full[len(self.emitted_text):] if full.startswith(self.emitted_text) else ""

    def resumed(self, delta: TokenDelta) -> TokenDelta:
        """A delta of the new worker as the client's request sees it: the original prompt's counts."""
        return dataclasses.replace(delta, num_prompt_tokens=self.num_prompt_tokens,
                                   num_cached_tokens=self.num_cached_tokens)


class StopScan:
    """Stop strings over text that began on another worker: ``pending`` (held back there) followed
    by the new worker's deltas. Holds back ``len(longest stop) - 1`` characters until the stream ends,
    as vLLM does; ``feed`` returns the delta to send on, cut at the first stop string found."""

    def __init__(self, stops: Sequence[str], pending: str) -> None:
        self._stops = [s for s in stops if s]
        self._hold = max((len(s) for s in self._stops), default=1) - 1
        self._buffer = pending
        self.stopped = False

    def feed(self, delta: TokenDelta) -> TokenDelta:
        self._buffer += delta.text
        cut = min((i for i in (self._buffer.find(s) for s in self._stops) if i >= 0), default=-1)
        if cut >= 0:
            self.stopped = True
            text, self._buffer = self._buffer[:cut], ""
            return dataclasses.replace(delta, text=text, finish_reason="stop")
        if delta.finish_reason is not None:
            text, self._buffer = self._buffer, ""
        else:
            keep = min(self._hold, len(self._buffer))
            text, self._buffer = self._buffer[:len(self._buffer) - keep], self._buffer[len(self._buffer) - keep:]
        return dataclasses.replace(delta, text=text)
