"""Tiny random-weight Qwen3 (dense) checkpoints: 2 layers, 4 query heads of 64, and 2 KV heads
(``tiny-qwen3-dense``) or 1 (``tiny-qwen3-mqa``).

The 2 KV heads divide by 2, so ``tiny-qwen3-dense`` runs at TP 1 and TP 2 (SmolLM2's 3 KV heads do
not); the e2e tests of KV head slicing between TP sizes use the tiny hybrid instead, whose attention
layers split the same way. ``tiny-qwen3-mqa``'s one KV head is
replicated on every rank at TP 2 (vLLM's rule for more ranks than KV heads): the tests of a head that
crosses the link once and is passed on between decode ranks use it. Deterministic for a given seed,
with the tiny hybrid's byte-level tokenizer.
"""
from __future__ import annotations

from functools import partial
from pathlib import Path

from services.models.cache import prepare_generated
from services.models.tiny_hybrid import SHARED_CONFIG, tokenizer

NAME = "tiny-qwen3-dense"
MQA_NAME = "tiny-qwen3-mqa"
KV_HEADS = {NAME: 2, MQA_NAME: 1}


def prepare(seed: int = 0, target: Path | None = None, name: str = NAME) -> Path:
    """Return the checkpoint directory of ``name`` for ``seed``, generating it on first use."""
    return prepare_generated(name, seed, target, partial(_generate, name))


def prepare_mqa(seed: int = 0, target: Path | None = None) -> Path:
    return prepare(seed, target, MQA_NAME)


def config(name: str = NAME):
    from transformers import Qwen3Config

    return Qwen3Config(**{**SHARED_CONFIG, "num_key_value_heads": KV_HEADS[name]}, num_hidden_layers=2)


def _generate(name: str, seed: int, out: Path) -> None:
    import torch
    from transformers import Qwen3ForCausalLM

    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(config(name)).to(torch.bfloat16)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer().save_pretrained(out)
