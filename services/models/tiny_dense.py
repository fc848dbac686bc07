"""A tiny random-weight Qwen3 (dense) checkpoint: 2 layers, 4 query and 2 KV heads of 64.

Its head counts divide by 2, so it runs at TP 1 and TP 2 (SmolLM2's 3 KV heads do not); the tests of
KV head slicing between TP sizes use it. Deterministic for a given seed, with the tiny hybrid's
byte-level tokenizer.
"""
from __future__ import annotations

from pathlib import Path

from services.models.cache import prepare_generated
from services.models.tiny_hybrid import SHARED_CONFIG, tokenizer

NAME = "tiny-qwen3-dense"


def prepare(seed: int = 0, target: Path | None = None) -> Path:
    """Return the checkpoint directory for ``seed``, generating it on first use."""
    return prepare_generated(NAME, seed, target, _generate)


def config():
    from transformers import Qwen3Config

    return Qwen3Config(**SHARED_CONFIG, num_hidden_layers=2)


def _generate(seed: int, out: Path) -> None:
    import torch
    from transformers import Qwen3ForCausalLM

    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(config()).to(torch.bfloat16)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer().save_pretrained(out)
