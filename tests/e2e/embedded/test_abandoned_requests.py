"""A client that goes away frees everything its request held, on every hop: the prefill worker's
work, the KV transfer on both ends and the decode worker's blocks, whether it leaves during the
remote prefill, while the KV arrives, or while the answer decodes (tests/support/abandon.py), within
5 s beyond the engine step in progress (a prefill engine sees the abort once its step ends: about
3.7 s for this prompt in bfloat16 on AVX-512, 7.5 s in float32 on AVX2).
bench/cancellation.py does the same 100 times per moment."""
from __future__ import annotations

import pytest

from support.abandon import MOMENTS, abandon, moment, settled, step_seconds
from support.embedded import API_KEY, MODEL

pytestmark = pytest.mark.e2e

WORKERS = ("prefill-0", "decode-0")
# Long enough for the PrfaaS path (deploy/local.yaml offloads past 256 tokens) and for a prefill that
# lasts long enough to be caught in the act; random-looking ids, so no prefix cache shortens it.
PROMPT = [(i * 7919) % 30000 + 100 for i in range(1800)]
SETTLE_S = 5.0  # beyond the engine step in progress when the client left (``step_seconds``)


@pytest.fixture(scope="module")
def step_s(embedded):
    body = {"model": MODEL, "prompt": [t + 1 for t in PROMPT]}  # ids no case uses: nothing cached
    return step_seconds(embedded.base_url, API_KEY, body)


@pytest.mark.parametrize("when", MOMENTS)
def test_an_abandoned_request_leaves_nothing_held(embedded, step_s, when):
    stats = embedded.worker_stats
    idle, _, held = settled(stats, WORKERS, timeout_s=30)
    assert idle, f"the workers were busy before the test: {held}"
    body = {"model": MODEL, "prompt": [t + len(when) for t in PROMPT], "max_tokens": 200, "stream": True,
            "ignore_eos": True}
    assert abandon(embedded.base_url, API_KEY, body, moment(when, stats, *WORKERS)), "the request ended first"
    idle, seconds, held = settled(stats, WORKERS, timeout_s=SETTLE_S + step_s)
    assert idle, (f"{seconds:.1f} s after the client left during {when} ({SETTLE_S:.0f} s allowed beyond a "
                  f"{step_s:.1f} s prefill of the prompt), the workers still hold {held}")
