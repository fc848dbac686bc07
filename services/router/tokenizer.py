"""The model's tokenizer and chat template, as the router uses them."""
from __future__ import annotations

import asyncio
from collections.abc import Sequence
from pathlib import Path

from services.engine.args import checkpoint_config
from services.router.errors import bad_request
from services.router.openai_api import ApiRequest


class PromptTokenizer:
    def __init__(self, model_path: Path) -> None:
        from transformers import AutoTokenizer

        self._tokenizer = AutoTokenizer.from_pretrained(model_path)
        self.vocab_size = _embedding_rows(model_path) or len(self._tokenizer)

    async def encode(self, request: ApiRequest) -> list[int]:
        """Token ids of the request's prompt (chat template applied for chat requests); token ids
        given by the client must be in the vocabulary (400 otherwise)."""
        if isinstance(request.prompt, list):
            check_token_ids(request.prompt, self.vocab_size)
            return list(request.prompt)
        return await asyncio.to_thread(self._encode_sync, request)

    def decode(self, token_ids: Sequence[int]) -> str:
        """The text of a prompt given as token ids (an echoed prompt), special tokens kept."""
        return self._tokenizer.decode(list(token_ids))

    def token_text(self, token_id: int) -> str:
        """One token's text, where a worker sent none (vLLM's server decodes it the same way)."""
        return self._tokenizer.decode([token_id])

    def continuation_text(self, context_ids: Sequence[int], new_ids: Sequence[int]) -> str:
        """The text of ``new_ids`` when they follow ``context_ids`` (as the engine's detokenizer writes
        it, special tokens skipped): what a decode worker that failed mid-stream may not have sent."""
        prefix = self._tokenizer.decode(list(context_ids), skip_special_tokens=True)
        full = self._tokenizer.decode(list(context_ids) + list(new_ids), skip_special_tokens=True)
        if full.startswith(prefix):
            return full[len(prefix):]
        return self._tokenizer.decode(list(new_ids), skip_special_tokens=True)

    def _encode_sync(self, request: ApiRequest) -> list[int]:
        if request.kind == "chat":
            text = self._tokenizer.apply_chat_template(
                list(request.messages), tokenize=False, add_generation_prompt=True, tools=list(request.tools) or None
            )
            return self._tokenizer.encode(text, add_special_tokens=False)
        return self._tokenizer.encode(request.prompt)


def _embedding_rows(model_path: Path) -> int | None:
    """The model's own vocabulary size (rows of its embedding table), which may exceed the
    tokenizer's: any id below it is a valid input to the engine."""
    size = checkpoint_config(model_path).get("vocab_size")
    return int(size) if size else None


def check_token_ids(token_ids: list[int], vocab_size: int) -> None:
    bad = next((t for t in token_ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise bad_request(f"'prompt' holds token id {bad}, outside the model's vocabulary (0 to {vocab_size - 1})",
                          param="prompt", code="invalid_token_id")
