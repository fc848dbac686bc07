"""Routers as replicas: the same workload against 1 router and against 3 routers (requests spread
round-robin), on the same workers, in one run (`prfaas up --routers 3`).

Workers: one PD-P and two PD-D SmolLM2 engines (every request takes the PD path); role flips on
with short dwell times (sustain 1 s, dwell 10 s), so the decider (router 0) flips workers during
both phases. Workload per phase: prompt families sharing a 256-token prefix, each request its
family's prefix plus a short (32) or long (384) suffix of its own, 16 output tokens, sent at a fixed
rate in the same order and timing; the two phases use different families (no phase finds the other's
prefixes cached). A sampler reads every worker's stats and every router's /metrics every 0.25 s.

Pass: cached prompt tokens (usage) with 3 routers >= 0.95x those with 1; TTFT p50 and p90 within
10%; no prefill worker's hand-off peak (sampled at the worker) above its limit; every worker's role
the same at every router in every sample taken more than one stats interval after a flip.

A caveat on the first figure: on the PD path the decode engine counts the prompt tokens whose KV a
PD-P worker sent it as cached (vLLM's num_cached_tokens includes a connector's tokens), so usage's
cached tokens are close to the prompt length either way; the PD-P worker's own prefix-cache hits (what
cache-affine routing wins) are not in usage.

    python bench/router_replicas.py
"""
from __future__ import annotations

import random
import re
import statistics
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import _common  # noqa: F401  (puts the project and tests/support on sys.path)
import openai
from _common import results_dir
from support.deployment import Deployment, deployment_config
from support.ports import free_port, free_ports
from support.prose import corpus

MODEL = "smollm2-135m-instruct"
ROUTERS = 3
STATS_INTERVAL_S = 0.5
MAX_HANDOFFS = 2
FAMILIES, PREFIX, SHORT, LONG, OUTPUT = 6, 256, 32, 384, 16
REQUESTS, RATE = 36, 1.0            # per phase; requests per second
CACHED_TARGET, TTFT_TOLERANCE = 0.95, 0.10
PD = (("pd-p", "prefill", "0"), ("pd-d1", "decode", "1"), ("pd-d2", "decode", "0"))
FLIPS = {"enabled": True, "sustain_s": 1, "min_dwell_s": 10, "max_drain_s": 20, "prefill_queue_low": 0.5,
         "prefill_queue_high": 1, "decode_utilization_high": 0.25, "decode_utilization_low": 0.15,
         "min_workers_per_role": 1}


def workload(seed: int) -> list[list[int]]:
    text, rng = corpus(), random.Random(seed)
    families = [text[rng.randrange(0, len(text) - PREFIX - LONG):][:PREFIX] for _ in range(FAMILIES)]
    prompts = []
    for index in range(REQUESTS):
        length = LONG if index % 3 == 0 else SHORT
        start = rng.randrange(0, len(text) - length)
        prompts.append(families[index % FAMILIES] + text[start:start + length])
    return prompts


def one(url: str, prompt: list[int]) -> tuple[float, int]:
    """TTFT (s) and cached prompt tokens of one streamed request; raises if it failed."""
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=300)
    started, ttft, cached = time.perf_counter(), None, None
    for chunk in client.completions.create(model=MODEL, prompt=prompt, max_tokens=OUTPUT, temperature=0, stream=True,
                                           stream_options={"include_usage": True}, extra_body={"ignore_eos": True}):
        if ttft is None and chunk.choices and chunk.choices[0].text:
            ttft = time.perf_counter() - started
        if chunk.usage is not None:
            cached = chunk.usage.prompt_tokens_details.cached_tokens if chunk.usage.prompt_tokens_details else 0
    return ttft, cached or 0


def phase(urls: list[str], prompts: list[list[int]]) -> list[tuple[float, int]]:
    with ThreadPoolExecutor(16) as pool:
        futures = []
        for index, prompt in enumerate(prompts):
            futures.append(pool.submit(one, urls[index % len(urls)], prompt))
            time.sleep(1 / RATE)
        return [f.result() for f in futures]


class Sampler(threading.Thread):
    """Every 0.25 s: each worker's role, generation and hand-off peak, and each router's view of the roles."""

    def __init__(self, deployment: Deployment) -> None:
        super().__init__(daemon=True)
        self.deployment, self.stop = deployment, threading.Event()
        self.samples: list[dict] = []
        self.flips: dict[str, float] = {}  # worker -> when its generation last changed (first seen)

    def run(self) -> None:
        generations: dict[str, int] = {}
        while not self.stop.wait(0.25):
            at = time.monotonic()
            workers = {name: self.deployment.worker_stats(name) for name, _, _ in PD}
            for name, stats in workers.items():
                if generations.get(name, stats.role_generation) != stats.role_generation:
                    self.flips[name] = at
                generations[name] = stats.role_generation
            views = [self._roles(url) for url in self.deployment.base_urls]
            self.samples.append({"at": at, "workers": workers, "views": views, "flips": dict(self.flips)})

    def _roles(self, url: str) -> dict[str, str]:
        text = self.deployment.metrics_text(url)
        found = re.findall(r'^prfaas_scheduler_worker_role\{role="([^"]+)",worker="([^"]+)"\} 1\.0$', text,
                           re.MULTILINE)
        return {worker: role for role, worker in found}

    def disagreements(self) -> tuple[int, int]:
        """(samples checked, samples where a router's role differs from the worker's)."""
        checked = bad = 0
        for sample in self.samples:
            if any(sample["at"] - t <= STATS_INTERVAL_S + 0.25 for t in sample["flips"].values()):
                continue  # within one stats interval (and one sampling period) of a flip
            checked += 1
            truth = {name: stats.role for name, stats in sample["workers"].items()}
            bad += any(view.get(name) != role for view in sample["views"] for name, role in truth.items())
        return checked, bad


def percentile(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1]


def main() -> int:
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
    try:
        sampler.start()
        one_router = phase(deployment.base_urls[:1], workload(1))
        replicas = phase(deployment.base_urls, workload(2))
        sampler.stop.set()
        sampler.join()
        peaks = {n: deployment.worker_stats(n).peak_handoffs for n, _, _ in PD}
    finally:
        sampler.stop.set()
        deployment.stop()
    return report(one_router, replicas, peaks, sampler)


def report(one_router, replicas, peaks: dict[str, int], sampler: Sampler) -> int:
    rows = {}
    for label, results in (("1 router", one_router), (f"{ROUTERS} routers", replicas)):
        ttfts = [t for t, _ in results if t is not None]
        rows[label] = (sum(c for _, c in results), percentile(ttfts, 50), percentile(ttfts, 90), len(results))
    print(f"\n{'':12s} {'requests':>8s} {'cached tokens':>14s} {'TTFT p50 (s)':>13s} {'TTFT p90 (s)':>13s}")
    for label, (cached, p50, p90, count) in rows.items():
        print(f"{label:12s} {count:8d} {cached:14d} {p50:13.3f} {p90:13.3f}")
    (c1, p50_1, p90_1, _), (cn, p50_n, p90_n, _) = rows.values()
    checked, bad = sampler.disagreements()
    num_flips = sum(1 for i in range(1, len(sampler.samples)) for n in sampler.samples[i]["workers"]
                    if sampler.samples[i]["workers"][n].role_generation
                    != sampler.samples[i - 1]["workers"][n].role_generation)
    print(f"hand-off peaks at the workers: {peaks} (limit {MAX_HANDOFFS})")
    print(f"role samples: {checked} checked, {bad} disagreeing; role changes seen at the workers: {num_flips}")
    ratio = cn / c1 if c1 else 0.0
    ok = (ratio >= CACHED_TARGET and abs(p50_n / p50_1 - 1) <= TTFT_TOLERANCE
          and abs(p90_n / p90_1 - 1) <= TTFT_TOLERANCE and max(peaks.values()) <= MAX_HANDOFFS and bad == 0)
    print(f"router_replicas: cached tokens {ROUTERS} routers / 1 = {ratio:.3f} (target >= {CACHED_TARGET}); TTFT p50 "
          f"x{p50_n / p50_1:.3f}, p90 x{p90_n / p90_1:.3f} (target within {TTFT_TOLERANCE:.0%}); hand-off peak "
          f"{max(peaks.values())} <= {MAX_HANDOFFS}; role disagreements {bad}/{checked}: {'PASS' if ok else 'FAIL'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
