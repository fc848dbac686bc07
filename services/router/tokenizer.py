"""The model's tokenizer and chat template, as the router uses them."""
from __future__ import annotations

import asyncio
from pathlib import Path

from services.router.openai_api import ApiRequest


class PromptTokenizer:
    def __init__(self, model_path: Path) -> None:
        from transformers import AutoTokenizer

        self._tokenizer = AutoTokenizer.from_pretrained(model_path)

    async def encode(self, request: ApiRequest) -> list[int]:
        """Token ids of the request's prompt (chat template applied for chat requests)."""
        if isinstance(request.prompt, list):
            return list(request.prompt)
        return await asyncio.to_thread(self._encode_sync, request)

    def _encode_sync(self, request: ApiRequest) -> list[int]:
        if request.kind == "chat":
            text = self._tokenizer.apply_chat_template(
                list(request.messages), tokenize=False, add_generation_prompt=True
            )
            return self._tokenizer.encode(text, add_special_tokens=False)
        return self._tokenizer.encode(request.prompt)
