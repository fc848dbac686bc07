"""One link, many controllers: the same offered load on the cross-cluster link through 1 router and
through 3 (requests spread round-robin), on the same workers, in one run; 3 routers' threshold
controllers together must not load the link or its queue more than one router's does.

One machine, two clusters (as tests/e2e/test_link_degradation.py): the PrfaaS prefill worker runs in
a network namespace made here, joined to the host by a veth pair whose namespace → host direction
(the KV stream to the local worker) is capped with ``tbf`` at 100 Mbit/s and a 20 ms queue; the
routers' link capacity says the same. Long prompts (600 tokens, ~14 MB of KV each) arrive at 0.3
per second, more than the link carries if every one were offloaded, with short ones (48) at 1 per
second; every router runs the adaptive threshold (base 400 tokens, x2 steps, 2 s hold). Phases of
30 s through 1 router and through 3 alternate 1, 3, 3, 1 so that drift falls on both alike.
The PrfaaS worker's own telemetry is sampled every 0.5 s: bytes sent (link utilization = egress /
cap, over 1 s windows), RTT (the tbf queue's delay adds to it) and its queued requests.

Pass: with 3 routers the mean and p90 link utilization and the p90 RTT are at most 1.10x those with
1 (RTT with 1 ms of slack: a shallow queue's RTT is a few ms and jitters by one), the sender's
queued requests' p90 at most one more, and no request failed. Needs root.

    python bench/router_replicas_wan.py
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
from support import netns
from support.deployment import Deployment, deployment_config
from support.ports import free_port, free_ports

MODEL = "smollm2-135m-instruct"
ROUTERS, ORDER, PHASE_S = 3, (1, 3, 3, 1), 30.0
CAP_MBIT, BUFFER_MS = 100, 20
LONG, SHORT, OUTPUT = 600, 48, 4
LONG_RATE, SHORT_RATE = 0.3, 1.0
TOLERANCE, RTT_SLACK_MS = 0.10, 1.0
SAMPLE_S = 0.5


def schedule(seed: int) -> list[tuple[float, int, int]]:
    """(send at, prompt length, seed of its tokens) over one phase: both kinds at fixed rates."""
    sends = [(i / LONG_RATE, LONG) for i in range(int(PHASE_S * LONG_RATE))]
    sends += [(0.5 + i / SHORT_RATE, SHORT) for i in range(int(PHASE_S * SHORT_RATE))]
    return [(at, length, seed * 1000 + i) for i, (at, length) in enumerate(sorted(sends))]


def one(url: str, length: int, seed: int) -> str | None:
    """None if the request completed, else what went wrong."""
    prompt = random.Random(seed).choices(range(1000, 40000), k=length)  # no two share a prefix
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)
    try:
        reply = client.completions.create(model=MODEL, prompt=prompt, max_tokens=OUTPUT, temperature=0,
                                          extra_body={"ignore_eos": True})
    except openai.APIError as exc:
        return f"{type(exc).__name__}: {exc}"
    return None if reply.usage.completion_tokens == OUTPUT else f"short reply {reply.usage}"


def phase(index: int, urls: list[str]) -> list[str]:
    started = time.monotonic()
    with ThreadPoolExecutor(32) as pool:
        futures = []
        for number, (at, length, seed) in enumerate(schedule(index)):
            time.sleep(max(0.0, started + at - time.monotonic()))
            futures.append(pool.submit(one, urls[number % len(urls)], length, seed))
        return [error for f in futures if (error := f.result()) is not None]


class LinkSampler(threading.Thread):
    """The PrfaaS worker's bytes sent, RTT and queued requests every ``SAMPLE_S``, tagged with the phase."""

    def __init__(self, deployment: Deployment) -> None:
        super().__init__(daemon=True)
        self.deployment, self.stop = deployment, threading.Event()
        self.routers = 0
        self.rows: list[tuple[float, int, int, float, int]] = []  # (at, routers, bytes sent, rtt ms, queued)

    def run(self) -> None:
        while not self.stop.wait(SAMPLE_S):
            stats = self.deployment.worker_stats("prefill-0")
            self.rows.append((time.monotonic(), self.routers, sum(link.bytes_sent for link in stats.kv_links),
                              max((link.rtt_ms for link in stats.kv_links), default=0.0),
                              stats.num_waiting_requests + stats.num_running_requests))

    def of(self, routers: int) -> dict[str, float]:
        utilizations, rtts, queued = [], [], []
        rows = self.rows
        for i in range(2, len(rows)):
            if rows[i][1] == routers and rows[i - 2][1] == routers:  # a 1 s window inside a phase
                seconds = rows[i][0] - rows[i - 2][0]
                utilizations.append((rows[i][2] - rows[i - 2][2]) * 8 / seconds / (CAP_MBIT * 1e6))
            if rows[i][1] == routers:
                rtts.append(rows[i][3])
                queued.append(rows[i][4])
        return {"utilization mean": statistics.fmean(utilizations), "utilization p90": p90(utilizations),
                "rtt p90 (ms)": p90(rtts), "queued p90": p90(queued)}


def p90(values: list[float]) -> float:
    return statistics.quantiles(values, n=10, method="inclusive")[8]


def routed(deployment: Deployment) -> dict[str, float]:
    totals = {"prfaas": 0.0, "local": 0.0}
    for url in deployment.base_urls:
        for path, value in re.findall(r'^prfaas_router_routed_requests_total\{path="(\w+)"\} (\S+)$',
                                      deployment.metrics_text(url), re.MULTILINE):
            if path in totals:
                totals[path] += float(value)
    return totals


def main() -> int:
    if (reason := netns.available()) is not None:
        print(f"router_replicas_wan: {reason}")
        return 1
    out = results_dir("router_replicas_wan")
    with netns.veth_link(subnet="10.213.95", rate_mbit=CAP_MBIT, side="ns", buffer_ms=BUFFER_MS) as link:
        config = deployment_config(
            [{"name": "prefill-0", "service": "prefill_worker", "cluster": "prfaas", "host": link.ns_addr,
              "env": {"VLLM_CPU_OMP_THREADS_BIND": "0"}},
             {"name": "local-0", "service": "decode_worker", "role": "both", "host": link.host_addr,
              "kv_port": free_port(), "env": {"VLLM_CPU_OMP_THREADS_BIND": "1"}}],
            router={"connect_timeout_s": 1.0, "stats_interval_s": 0.5, "port": free_ports(ROUTERS)},
            scheduler={"offload_threshold_tokens": 400, "adaptive_threshold": True,
                       "link_capacity_gbps": CAP_MBIT / 1000, "threshold_step": 2.0, "threshold_hold_s": 2.0},
            transport={"secret": "bench-wan-secret"})
        deployment = Deployment(config, out, prefixes={"prefill-0": link.exec_argv([])}, routers=ROUTERS)
        print(f"router_replicas_wan: 2 engines, {ROUTERS} routers, link capped at {CAP_MBIT} Mbit/s (logs in {out})",
              flush=True)
        deployment.start()
        sampler = LinkSampler(deployment)
        errors: dict[int, list[str]] = {1: [], ROUTERS: []}
        decisions: dict[int, dict[str, float]] = {1: {"prfaas": 0, "local": 0}, ROUTERS: {"prfaas": 0, "local": 0}}
        try:
            sampler.start()
            for index, routers in enumerate(ORDER):
                before = routed(deployment)
                sampler.routers = routers
                errors[routers] += phase(index, deployment.base_urls[:routers])
                sampler.routers = 0
                after = routed(deployment)
                for path in before:
                    decisions[routers][path] += after[path] - before[path]
                print(f"  phase {index}: {routers} router(s) done", flush=True)
                time.sleep(2)
        finally:
            sampler.stop.set()
            deployment.stop()
    return report(sampler, errors, decisions)


def report(sampler: LinkSampler, errors: dict[int, list[str]], decisions: dict[int, dict[str, float]]) -> int:
    rows = {routers: sampler.of(routers) for routers in (1, ROUTERS)}
    print(f"\n{'':10s} {'util mean':>9s} {'util p90':>9s} {'RTT p90 ms':>10s} {'queued p90':>10s} {'offloaded':>9s} "
          f"{'local':>6s} {'failed':>6s}")
    for routers, row in rows.items():
        label = f"{routers} router{'s' if routers > 1 else ''}"
        print(f"{label:10s} {row['utilization mean']:9.3f} {row['utilization p90']:9.3f} {row['rtt p90 (ms)']:10.2f}"
              f" {row['queued p90']:10.1f} {decisions[routers]['prfaas']:9.0f} "
              f"{decisions[routers]['local']:6.0f} {len(errors[routers]):6d}")
    for problem in (errors[1] + errors[ROUTERS])[:5]:
        print("  failed:", problem)
    one, many = rows[1], rows[ROUTERS]
    mean_ratio = many["utilization mean"] / one["utilization mean"]
    p90_ratio = many["utilization p90"] / one["utilization p90"]
    ok = (mean_ratio <= 1 + TOLERANCE and p90_ratio <= 1 + TOLERANCE
          and many["rtt p90 (ms)"] <= one["rtt p90 (ms)"] * (1 + TOLERANCE) + RTT_SLACK_MS
          and many["queued p90"] <= one["queued p90"] + 1 and not errors[1] and not errors[ROUTERS])
    print(f"router_replicas_wan: {ROUTERS} routers / 1: link utilization mean x{mean_ratio:.3f}, p90 x{p90_ratio:.3f}, "
          f"RTT p90 {many['rtt p90 (ms)']:.2f} vs {one['rtt p90 (ms)']:.2f} ms, sender queue p90 "
          f"{many['queued p90']:.1f} vs {one['queued p90']:.1f}"
          f" (target: at most x{1 + TOLERANCE:.2f}, RTT +{RTT_SLACK_MS:g} ms, queue +1; "
          f"no failed request): {'PASS' if ok else 'FAIL'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
