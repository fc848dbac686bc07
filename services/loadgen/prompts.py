"""Prompts of an exact token length, synthesized from a tokenizer's own vocabulary."""
from __future__ import annotations

import functools
import logging
from pathlib import Path

import numpy as np

from services.loadgen.config import EMBEDDED_TOKENIZER

logger = logging.getLogger(__name__)

MAX_ADJUSTMENTS = 32


def tokenizer_source(name_or_path: str | None, model: str | None = None) -> str:
    """`name_or_path`, else the model if it names a local directory, else the embedded model's directory."""
    if name_or_path is None:
        if model and Path(model).expanduser().is_dir():
            name_or_path = str(Path(model).expanduser())
        else:
            from services.models.registry import prepare

            name_or_path = str(prepare(EMBEDDED_TOKENIZER))
    return name_or_path


@functools.lru_cache(maxsize=4)
def prompt_builder(source: str) -> "PromptBuilder":
    """A (cached) builder for the tokenizer at `source`; loading it and its stable vocabulary takes seconds."""
    from transformers import AutoTokenizer

    logger.info("tokenizer: %s", source)
    return PromptBuilder(AutoTokenizer.from_pretrained(source))


class PromptBuilder:
    """Builds text that re-encodes to exactly the wanted number of tokens (`encode(..., add_special_tokens=False)`).

    Random ids are drawn from the 'stable' vocabulary: tokens that decode to text which encodes back to
    themselves. Concatenations still merge at token boundaries, so the builder decodes, re-encodes and
    adds or drops ids at the end until the count matches.
    """

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.stable_ids = _stable_ids(tokenizer)

    def count(self, text: str) -> int:
        return len(self.tokenizer.encode(text, add_special_tokens=False))

    def build(self, num_tokens: int, rng: np.random.Generator, prefix: str = "") -> str:
        """`prefix` followed by random text; the whole re-encodes to `num_tokens` tokens (or as close as it gets)."""
        base = self.count(prefix) if prefix else 0
        wanted = num_tokens - base
        if wanted <= 0:
            return prefix
        ids = list(rng.choice(self.stable_ids, size=wanted))
        best_text, best_error = prefix, num_tokens
        for _ in range(MAX_ADJUSTMENTS):
            text = prefix + self.tokenizer.decode(ids)
            error = self.count(text) - num_tokens
            if abs(error) < abs(best_error):
                best_text, best_error = text, error
            if error == 0:
                return text
            if error > 0:
                ids = ids[: max(1, len(ids) - error)]
            else:
                ids.extend(rng.choice(self.stable_ids, size=-error))
        logger.debug("prompt of %d tokens is %+d off after %d adjustments", num_tokens, best_error, MAX_ADJUSTMENTS)
        return best_text


def _stable_ids(tokenizer) -> np.ndarray:
    special = set(tokenizer.all_special_ids) | set(tokenizer.get_added_vocab().values())
    candidates = [i for i in range(len(tokenizer)) if i not in special]
    texts = tokenizer.batch_decode([[i] for i in candidates])
    encoded = tokenizer(texts, add_special_tokens=False)["input_ids"]
    stable = [i for i, text, ids in zip(candidates, texts, encoded)
              if ids == [i] and text.strip() and text.isprintable()]
    return np.array(stable or candidates, dtype=np.int64)
