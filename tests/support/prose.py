"""SmolLM2 token ids of English prose for token-identity tests (random token ids make near-ties in
the logits that any change of batch flips)."""
from __future__ import annotations

import functools


def tokenize(text: str) -> list[int]:
    from transformers import AutoTokenizer

    from services.models import smollm2

    return AutoTokenizer.from_pretrained(smollm2.prepare()).encode(text, add_special_tokens=False)


@functools.cache
def corpus() -> list[int]:
    """The docstrings of a few standard-library modules and their classes, tokenized."""
    import argparse as a
    import collections as c
    import inspect
    import json as j
    import logging as lg
    import subprocess as sp
    import threading as th

    text = "\n\n".join(inspect.getdoc(m) or "" for m in (a, c, j, lg, sp, th, inspect))
    text += "\n\n".join(inspect.getdoc(getattr(m, name)) or "" for m in (sp, th, c) for name in dir(m)
                          if not name.startswith("_") and inspect.isclass(getattr(m, name)))
    return tokenize(text)
