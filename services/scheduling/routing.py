"""Where a request's prefill runs: the length-threshold rule of PrfaaS (paper, section 3.3)."""
from __future__ import annotations

from typing import Literal

PrefillSite = Literal["prfaas", "local"]


def choose_prefill_site(num_uncached_tokens: int | float, threshold_tokens: float,
                        prfaas_available: bool) -> PrefillSite:
    """``prfaas`` when the uncached part of the prompt is longer than the threshold and a PrfaaS
    prefill instance can take it; otherwise ``local`` (short prompts, or the PrfaaS cluster is
    down, full or cut off). Called by the router per request and by the simulator per arrival."""
    if prfaas_available and num_uncached_tokens > threshold_tokens:
        return "prfaas"
    return "local"
