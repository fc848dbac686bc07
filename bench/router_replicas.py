"""Routers as replicas: the same workload against 1 router and against 3 routers (requests spread
round-robin), on the same workers, in one run (`prfaas up --routers 3`).

Workers: one PD-P and two PD-D SmolLM2 engines (every request takes the PD path); role flips on
with short dwell times, so the decider (router 0) flips workers while both kinds of block run. The
PD-P engine has core 0 to itself and the two PD-D engines share core 1, so the two are alike: which
one a flip takes, or a request decodes on, changes nothing but the engine (on two cores, a PD-D
engine beside the PD-P one made each flip and each decode choice a coin toss of 2x in speed).

The workload comes in blocks, each sent through 1 router or through all 3, in the order 1, 3, 3, 1
(twice by default), after one block through all 3 that is not counted (the engines' first requests
are slow, and the first counted block would pay for them): whatever drifts over the run (the host's
other work, warm caches, a flip's aftermath) falls on both sides alike instead of on whichever phase
comes second. Every block has the same shape and timing with prompt families of its own (no block
finds another's prefixes cached): a burst of long prompts (the PD-P worker's queue grows while
decode idles: prefill binds, a PD-D worker is flipped to prefill), then short prompts with longer
answers at a steady rate (decode binds, the lent worker is flipped back), long enough that most of a
block's requests come after the burst's queue has drained: the median falls among them, not on the
edge between the two. The answers (48 tokens) keep two requests running on the one PD-D worker the
burst leaves, so decode binds and the flip back comes in every block, a few seconds after the lend:
with 24-token answers it came in some blocks and not in others, and a block without it ran its
steady part on one decode engine instead of two sharing a core, about a third faster, whatever the
router count. Each prompt is its family's 256-token prefix plus a suffix of its own.
Before each block the bench sets the configured roles again (SetRole, as an operator would): which
engine holds which role matters on this host (three engines on two cores) and flips leave it to
chance. A sampler reads every worker's stats and every router's /metrics every 0.25 s; a role change
counts as a flip of the block it happened in (the resets between blocks count for neither).

Pass: cached prompt tokens (usage) with 3 routers >= 0.95x those with 1; TTFT p50 and p90 within
10%; no prefill worker's hand-off peak (sampled at the worker) above its limit; at least one role
flip while 3 routers served, and every worker's role the same at every router in every sample taken
more than one stats interval after a flip (with no flip that check would be vacuous: it fails).
`--quick` (one 1-router and one 3-router block) gates on everything but TTFT, whose
percentiles over so few requests are noise; it prints them.

A caveat on the first figure: on the PD path the decode engine counts the prompt tokens whose KV a
PD-P worker sent it as cached (vLLM's num_cached_tokens includes a connector's tokens), so usage's
cached tokens are close to the prompt length either way; the PD-P worker's own prefix-cache hits (what
cache-affine routing wins) are not in usage.

    python bench/router_replicas.py [--quick]
"""
from __future__ import annotations

import argparse
import json
import random
import re
import statistics
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass

import _common  # noqa: F401  (puts the project and tests/support on sys.path)
import openai
from _common import results_dir
from prfaas.v1 import worker_pb2 as pb
from prfaas.v1 import worker_pb2_grpc as pb_grpc
from support.deployment import Deployment, deployment_config, wait_until
from support.ports import free_port, free_ports
from support.prose import corpus

MODEL = "smollm2-135m-instruct"
ROUTERS = 3
STATS_INTERVAL_S = 0.5
MAX_HANDOFFS = 2
FAMILIES, PREFIX, SHORT, LONG = 4, 256, 96, 384
# a block: a burst of long prompts, then short prompts with longer answers at a steady rate
BURST, BURST_RATE, BURST_OUTPUT = 4, 2.0, 16
STEADY, STEADY_RATE, STEADY_OUTPUT = 24, 1.0, 48
ORDER, QUICK_ORDER = (1, 3, 3, 1) * 2, (1, 3)
CACHED_TARGET, TTFT_TOLERANCE = 0.95, 0.10
PD = (("pd-p", "prefill", "0"), ("pd-d1", "decode", "1"), ("pd-d2", "decode", "1"))
FLIPS = {"enabled": True, "sustain_s": 0, "min_dwell_s": 5, "max_drain_s": 10, "prefill_queue_low": 0.5,
         "prefill_queue_high": 1, "decode_utilization_high": 0.25, "decode_utilization_low": 0.15,
         "min_workers_per_role": 1}


@dataclass(frozen=True, slots=True)
class Sent:
    block: int
    routers: int
    long: bool
    ttft_s: float | None
    cached_tokens: int


def block_prompts(seed: int) -> list[tuple[list[int], int, float]]:
    """(prompt, output tokens, seconds until the next) for one block."""
    text, rng = corpus(), random.Random(seed)
    families = [text[rng.randrange(0, len(text) - PREFIX):][:PREFIX] for _ in range(FAMILIES)]
    requests = []
    for index in range(BURST + STEADY):
        long = index < BURST
        length = LONG if long else SHORT
        start = rng.randrange(0, len(text) - length)
        prompt = families[index % FAMILIES] + text[start:start + length]
        requests.append((prompt, BURST_OUTPUT if long else STEADY_OUTPUT, 1 / (BURST_RATE if long else STEADY_RATE)))
    return requests


def one(url: str, prompt: list[int], max_tokens: int) -> tuple[float | None, int]:
    """TTFT (s) and cached prompt tokens of one streamed request; raises if it failed."""
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=300)
    started, ttft, cached = time.perf_counter(), None, None
    for chunk in client.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                           stream=True, stream_options={"include_usage": True},
                                           extra_body={"ignore_eos": True}):
        if ttft is None and chunk.choices and chunk.choices[0].text:
            ttft = time.perf_counter() - started
        if chunk.usage is not None:
            cached = chunk.usage.prompt_tokens_details.cached_tokens if chunk.usage.prompt_tokens_details else 0
    return ttft, cached or 0


def block(index: int, urls: list[str]) -> list[Sent]:
    with ThreadPoolExecutor(32) as pool:
        futures = []
        for number, (prompt, max_tokens, gap_s) in enumerate(block_prompts(100 + index)):
            future = pool.submit(one, urls[number % len(urls)], prompt, max_tokens)
            futures.append((len(prompt) > PREFIX + SHORT, future))
            time.sleep(gap_s)
        return [Sent(index, len(urls), long, *future.result()) for long, future in futures]


class Sampler(threading.Thread):
    """Every 0.25 s: each worker's role, generation, queue and hand-off peak, and each router's view of the roles."""

    def __init__(self, deployment: Deployment) -> None:
        super().__init__(daemon=True)
        self.deployment, self.stop = deployment, threading.Event()
        self.samples: list[dict] = []
        self.routers = 0  # routers the running block sends through (0 between blocks)
        self.flips: list[tuple[float, str, str, int]] = []  # (when first seen, worker, new role, routers then)

    def run(self) -> None:
        """Each sample reads the workers, then the routers' views, then the workers again: a flip between
        the first read and a view (the deciding router shows its own flip at once) changes a generation
        between the two reads, and the sample counts as taken at that flip instead of as a disagreement."""
        generations: dict[str, int] = {}
        roles: dict[str, str] = {}
        last_flip: dict[str, float] = {}
        while not self.stop.wait(0.25):
            at = time.monotonic()
            before = {name: self.deployment.worker_stats(name).role_generation for name, _, _ in PD}
            views = [self._roles(url) for url in self.deployment.base_urls]
            workers = {name: self.deployment.worker_stats(name) for name, _, _ in PD}
            for name, stats in workers.items():
                if generations.get(name, before[name]) != stats.role_generation:
                    last_flip[name] = at
                    if stats.role != roles.get(name, stats.role):
                        self.flips.append((at, name, stats.role, self.routers))
                generations[name], roles[name] = stats.role_generation, stats.role
            self.samples.append({"at": at, "routers": self.routers, "roles": dict(roles),
                                 "waiting": {n: s.num_waiting_requests for n, s in workers.items()},
                                 "running": {n: s.num_running_requests for n, s in workers.items()},
                                 "views": views, "last_flip": dict(last_flip)})

    def _roles(self, url: str) -> dict[str, str]:
        text = self.deployment.metrics_text(url)
        found = re.findall(r'^prfaas_scheduler_worker_role\{role="([^"]+)",worker="([^"]+)"\} 1\.0$', text,
                           re.MULTILINE)
        return {worker: role for role, worker in found}

    def disagreements(self) -> tuple[int, int]:
        """(samples checked, samples where a router's role differs from the worker's)."""
        checked = bad = 0
        for sample in self.samples:
            if any(sample["at"] - t <= STATS_INTERVAL_S + 0.25 for t in sample["last_flip"].values()):
                continue  # within one stats interval (and one sampling period) of a generation change
            checked += 1
            bad += any(view.get(name) != role for view in sample["views"] for name, role in sample["roles"].items())
        return checked, bad


def reset_roles(deployment: Deployment) -> None:
    """Every block starts from the configured roles, as an operator would set them (SetRole, compare-and-set):
    which engine holds which role matters here (three engines share two cores), and flips leave it to chance."""
    assert wait_until(lambda: not any(deployment.worker_stats(n).draining for n, _, _ in PD), 30), "a drain never ended"
    for name, role, _ in PD:
        worker = next(w for w in deployment.config["workers"] if w["name"] == name)
        with deployment.security.channel(f"127.0.0.1:{worker['port']}") as channel:
            stub = pb_grpc.DecodeWorkerStub(channel)
            stats = stub.GetStats(pb.StatsRequest(), timeout=5)
            if stats.role != role or stats.draining:
                stub.SetRole(pb.SetRoleRequest(expected_generation=stats.role_generation, role=role), timeout=5)


def percentile(values: list[float], q: int) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one block each (the suite's short check; TTFT not gated)")
    args = parser.parse_args()
    order = QUICK_ORDER if args.quick else ORDER
    workers = [{"name": n, "service": "decode_worker", "role": r, "kv_port": free_port(),
                "engine": {"max_num_batched_tokens": 256, "max_num_seqs": 8}, "env": {"VLLM_CPU_OMP_THREADS_BIND": c}}
               for n, r, c in PD]
    config = deployment_config(workers, router={"port": free_ports(ROUTERS), "stats_interval_s": STATS_INTERVAL_S,
                                                "max_handoffs_per_prefill_worker": MAX_HANDOFFS},
                               scheduler={"role_flips": FLIPS})
    out = results_dir("router_replicas")
    corpus()
    deployment = Deployment(config, out, launcher="up", routers=ROUTERS)
    print(f"router_replicas: starting 3 engines and {ROUTERS} routers (logs in {out}) ...", flush=True)
    deployment.start()
    sampler = Sampler(deployment)
    sent: list[Sent] = []
    try:
        sampler.start()
        if not args.quick:  # the engines' first requests are slow: a block through all routers, not counted
            block(len(order), deployment.base_urls)
        for index, routers in enumerate(order):
            reset_roles(deployment)
            time.sleep(STATS_INTERVAL_S * 2)  # every router has seen the roles
            sampler.routers = routers
            sent += block(index, deployment.base_urls[:routers])
            sampler.routers = 0
            print(f"  block {index}: {routers} router(s), TTFT p50 "
                  f"{statistics.median(s.ttft_s for s in sent if s.block == index):.3f} s", flush=True)
            time.sleep(1)
        sampler.stop.set()
        sampler.join()
        peaks = {n: deployment.worker_stats(n).peak_handoffs for n, _, _ in PD}
    finally:
        sampler.stop.set()
        deployment.stop()
    (out / "router_replicas.json").write_text(json.dumps(
        {"requests": [asdict(s) for s in sent], "flips": sampler.flips, "peaks": peaks,
         "samples": sampler.samples}))
    return report(sent, peaks, sampler, gate_ttft=not args.quick)


def report(sent: list[Sent], peaks: dict[str, int], sampler: Sampler, gate_ttft: bool) -> int:
    rows = {}
    for routers in (1, ROUTERS):
        mine = [s for s in sent if s.routers == routers]
        ttfts = [s.ttft_s for s in mine if s.ttft_s is not None]
        long = [s.ttft_s for s in mine if s.long and s.ttft_s is not None]
        rows[routers] = (len(mine), sum(s.cached_tokens for s in mine), percentile(ttfts, 50), percentile(ttfts, 90),
                         statistics.median(long), sum(1 for f in sampler.flips if f[3] == routers))
    print(f"\n{'':10s} {'requests':>8s} {'cached tokens':>14s} {'TTFT p50 (s)':>13s} {'TTFT p90 (s)':>13s} "
          f"{'long p50 (s)':>13s} {'flips':>6s}")
    for routers, (count, cached, p50, p90, long, flips) in rows.items():
        print(f"{routers} router{'s' if routers > 1 else ' '} {count:8d} {cached:14d} {p50:13.3f} {p90:13.3f} "
              f"{long:13.3f} {flips:6d}")
    (_, c1, p50_1, p90_1, _, _), (_, cn, p50_n, p90_n, _, flips_n) = rows.values()
    checked, bad = sampler.disagreements()
    print(f"hand-off peaks at the workers: {peaks} (limit {MAX_HANDOFFS})")
    print(f"role flips at the workers: {len(sampler.flips)} ({flips_n} while {ROUTERS} routers served); "
          f"role samples: {checked} checked, {bad} disagreeing")
    ratio = cn / c1 if c1 else 0.0
    ttft_ok = abs(p50_n / p50_1 - 1) <= TTFT_TOLERANCE and abs(p90_n / p90_1 - 1) <= TTFT_TOLERANCE
    ok = (ratio >= CACHED_TARGET and (ttft_ok or not gate_ttft) and max(peaks.values()) <= MAX_HANDOFFS
          and flips_n > 0 and bad == 0)
    print(f"router_replicas: cached tokens {ROUTERS} routers / 1 = {ratio:.3f} (target >= {CACHED_TARGET}); TTFT p50 "
          f"x{p50_n / p50_1:.3f}, p90 x{p90_n / p90_1:.3f} (target within {TTFT_TOLERANCE:.0%}"
          f"{'' if gate_ttft else ', not gated in --quick'}); hand-off peak {max(peaks.values())} <= {MAX_HANDOFFS}; "
          f"flips with {ROUTERS} routers {flips_n} (target > 0); role disagreements {bad}/{checked}: "
          f"{'PASS' if ok else 'FAIL'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
