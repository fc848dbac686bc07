"""Multi-turn state: each turn waits for the previous answer and carries the whole conversation so far."""
from __future__ import annotations

import asyncio

from services.loadgen.prompts import PromptBuilder
from services.loadgen.workloads import RequestSpec


class Conversations:
    """Histories of (question, answer) per conversation; single-turn specs pass straight through."""

    def __init__(self, endpoint: str, builder: PromptBuilder) -> None:
        self.endpoint = endpoint
        self.builder = builder
        self._turns: dict[tuple[int, int], asyncio.Future] = {}
        self._histories: dict[int, list[tuple[str, str]]] = {}

    async def history(self, spec: RequestSpec) -> list[tuple[str, str]] | None:
        """The earlier turns of the spec's conversation, once the previous one has finished."""
        if spec.conversation is None:
            return None
        if spec.turn > 0:
            await asyncio.shield(self._future(spec.conversation, spec.turn - 1))
        return list(self._histories.get(spec.conversation, ()))

    def finish(self, spec: RequestSpec, answer: str) -> None:
        if spec.conversation is None:
            return
        self._histories.setdefault(spec.conversation, []).append((spec.prompt, answer))
        future = self._future(spec.conversation, spec.turn)
        if not future.done():
            future.set_result(None)
        self._turns.pop((spec.conversation, spec.turn - 1), None)

    def prompt(self, spec: RequestSpec, history: list[tuple[str, str]] | None) -> tuple[dict, int]:
        """The payload's prompt fields and the input length in tokens (of the message contents, for chat)."""
        if self.endpoint == "chat":
            messages = [{"role": "system", "content": spec.system}] if spec.system else []
            for question, answer in history or ():
                messages += [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
            messages.append({"role": "user", "content": spec.prompt})
            length = spec.input_len if not history else sum(self.builder.count(m["content"]) for m in messages)
            return {"messages": messages}, length
        if not history:
            return {"prompt": spec.system + spec.prompt}, spec.input_len
        text = "".join(f"{question}\n{answer}\n" for question, answer in history) + spec.prompt
        return {"prompt": text}, self.builder.count(text)

    def _future(self, conversation: int, turn: int) -> asyncio.Future:
        key = (conversation, turn)
        if key not in self._turns:
            self._turns[key] = asyncio.get_running_loop().create_future()
        return self._turns[key]
