"""Abandoned requests free every hop: 100 requests whose client goes away at each of three moments.

The embedded default as `prfaas up` runs it (deploy/local.yaml on free ports: the router, prefill-0
for the PrfaaS cluster, decode-0 for the local PD cluster, SmolLM2). Each request is a long prompt
(the PrfaaS path) streamed with a large token budget; its client resets the connection while the
prompt is prefilled remotely (the prefill worker has it), while its KV arrives at the decode worker
(the decode worker's received bytes grew), or while it decodes (the client has its first chunk)
(tests/support/abandon.py). After each batch, every worker must be back at rest within 5 s beyond
the engine step in progress: no request active, KV cache usage at its idle value, and no KV transfer
pending in either direction. An engine sees an abort only once the step it is computing ends, and
until then the prefill worker's KV send is pending; that step is at most a whole prefill of the
prompt, timed (warm) before the first batch (about 3.7 s in bfloat16 on AVX-512, 7.5 s in float32 on
AVX2 for these 1,800 tokens).

The baseline is the idle state measured before the first request. Exit status 0 only when every
batch settled in time; the last line gives the slowest settle time beyond that step against the 5 s
target.

    python bench/cancellation.py [--requests 100] [--concurrency 1]
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import _common  # noqa: F401  (puts the project and tests/ on sys.path)
from _common import verdict

from support.abandon import MOMENTS, abandon, moment, settled, step_seconds
from support.deployment import Deployment
from support.embedded import API_KEY, MODEL, embedded_default_on_free_ports

WORKERS = ("prefill-0", "decode-0")
TARGET_S = 5.0
PROMPT_TOKENS = 1800
MAX_TOKENS = 200  # with the prompt, within the embedded model's 2,048 tokens


def _prompt(index: int) -> list[int]:
    """A prompt no other request shares a prefix with (no prefix cache shortens its prefill)."""
    return [(i * 7919 + index * 104729) % 30000 + 100 for i in range(PROMPT_TOKENS)]


def _batch(deployment: Deployment, when: str, first: int, count: int, concurrency: int) -> int:
    """Abandons ``count`` requests at ``when``; how many were caught at that moment. The moments are
    read off the workers' stats, which do not say whose request they see: only with one request at
    a time (the default) is each caught at its own moment."""
    def one(index: int) -> bool:
        body = {"model": MODEL, "prompt": _prompt(index), "max_tokens": MAX_TOKENS, "stream": True,
                "ignore_eos": True}
        return abandon(deployment.base_url, API_KEY, body, moment(when, deployment.worker_stats, *WORKERS))

    with ThreadPoolExecutor(concurrency) as pool:
        return sum(pool.map(one, range(first, first + count)))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=100, help="requests abandoned per moment (default 100)")
    parser.add_argument("--concurrency", type=int, default=1,
                        help="requests in flight at once (default 1; with more, a request may be abandoned at "
                        "another's moment, since the workers' stats do not say whose request they see)")
    args = parser.parse_args()
    directory = Path(tempfile.mkdtemp(prefix="prfaas-cancellation-"))
    print(f"starting the embedded default in {directory} (about a minute)", flush=True)
    deployment = Deployment(embedded_default_on_free_ports(), directory, launcher="up",
                            env={"PRFAAS_API_KEYS": API_KEY}).start()
    try:
        idle, _, rest = settled(deployment.worker_stats, WORKERS, timeout_s=60)
        if not idle:
            print(f"the workers never came to rest before the first request: {rest}")
            return 1
        print(f"at rest: {rest}")
        # the second of two prefills: the first also pays the engines' warm-up
        step_s = [step_seconds(deployment.base_url, API_KEY, {"model": MODEL, "prompt": _prompt(-index)})
                  for index in (1, 2)][-1]
        print(f"a prefill of one {PROMPT_TOKENS}-token prompt: {step_s:.2f} s (allowed on top of {TARGET_S:.0f} s)")
        print(f"{'moment':<9} {'requests':>8} {'caught':>6} {'settled':>8} {'seconds':>8}  left held")
        worst, failures = 0.0, 0
        for number, when in enumerate(MOMENTS):
            started = time.monotonic()
            caught = _batch(deployment, when, number * args.requests, args.requests, args.concurrency)
            ok, seconds, held = settled(deployment.worker_stats, WORKERS, timeout_s=TARGET_S + step_s)
            worst = max(worst, seconds - step_s)
            failures += not ok
            busy = {name: h for name, h in held.items() if not h.idle}
            print(f"{when:<9} {args.requests:>8} {caught:>6} {str(ok):>8} {seconds:>8.2f}  {busy or '-'}"
                  f"  ({time.monotonic() - started:.0f} s)", flush=True)
    finally:
        deployment.stop()
    detail = f"{args.requests} requests abandoned at each of {', '.join(MOMENTS)}; {failures} batch(es) left work held"
    status = verdict("slowest return to rest after abandoned requests, beyond the step in progress, s",
                     max(0.0, worst) if not failures else float("inf"),
                     TARGET_S, detail, higher_is_better=False)
    return status


if __name__ == "__main__":
    sys.exit(main())

