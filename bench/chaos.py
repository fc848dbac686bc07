"""Chaos and soak: the whole system under steady load while processes die, hang and links fail.

Topology (real processes, real vLLM engines with the embedded model, real TCP):
- ``prefill-0``, the PrfaaS cluster's prefill worker, and ``pool-prfaas``, its cache pool, in a
  network namespace made here, behind a WAN path (a delay line for the round trip, ``tbf`` caps in
  both directions: tests/support/wan.py);
- two local PD workers (``pd-0``, ``pd-1``, role both) and ``pool-local`` on the host;
- the router on loopback, started as `prfaas up` starts it (closed: generated token and secret).

Load: the project's load-generator client (services/loadgen/client.py) sends streaming completions
at a steady rate, a seeded mix of short prompts (local path) and long ones (PrfaaS path), greedy,
``max_tokens`` fixed and EOS ignored. Prompts are English prose (random token ids make near-ties
that any change of batch flips), each used once, and each prompt's expected text is computed before
the run by colocated vLLM engines built as the workers build theirs (tests/support/baseline.py):
for a long prompt, two texts are right, the one-chunk prefill's and the disaggregated one's; prompts
whose answer rests on a tie of two logits are not used (see ``checkable_prompts``).

Faults, seeded and scheduled one after another (``--faults`` picks; all by default):
kill_prefill (SIGKILL prefill-0, restart), kill_pd (SIGKILL pd-1, restart), kill_pool (SIGKILL
pool-local, restart), hang_prefill (SIGSTOP prefill-0 for 30 s, SIGCONT), link_drop (nftables in
the namespace drops everything for 20 s), bandwidth_cut (the cap / 10 for 60 s), router_restart
(SIGTERM the router, which drains, then start it again; clients see refused connections meanwhile),
kill_supervised (SIGKILL pd-1's main process; `prfaas up`'s own supervision, services/launcher/watch.py,
restarts it after its backoff, as under `prfaas up`).

kv_flood (300 unauthenticated connections, after a few garbage payloads, to each decode worker's KV port,
held 20 s: they have a handshake budget of their own and never crowd out the prefill worker).

Every answer is classified: right, wrong (text differs from the expected one), clear error (an
OpenAI-shaped HTTP error or stream error event, or a refused connection while the router is down),
hung (nothing within ``--deadline``), lost (the answer ended without completing or saying why).
Requests in flight inside a process when it was killed are "held". Those held by a decode (PD)
worker move to another worker with the tokens generated so far (router.max_migrations), so they count
with the others and must complete right; the rest must end right or with a clear error.
Targets (the last line, and the exit status): 0 wrong, 0 hung, 0 lost, 0 leaked KV
blocks, shared-memory files or listening sockets, pool accounting equal to its files, and >= 99% of
the requests not held by a killed prefill worker, pool or router (nor sent while the router was down)
completed right.

Writes ``<out>/chaos.json`` (every figure and every request) and ``<out>/chaos.png`` (TTFT over
time with the fault windows shaded, the offloaded fraction over time). Needs root (namespaces).

    python bench/chaos.py                      # 5 minutes, every fault
    python bench/chaos.py --minutes 30         # the soak: RSS slopes per service
    python bench/chaos.py --minutes 2 --faults kill_prefill,link_drop
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import resource
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import _common  # noqa: F401  (puts the project and tests/support on sys.path)
from _common import results_dir
from support.baseline import engine_identity, greedy_margins
from support.deployment import Deployment, deployment_config
from support.netns import available, run_command
from support.ports import free_port, free_ports
from support.procs import group_pids
from support.prose import corpus
from support.wan import wan_path

from services.engine import shm_ledger
from services.launcher import supervisor
from services.loadgen.client import CONNECTION_ERROR, TIMEOUT_ERROR, OpenAIClient, RequestOutcome

MODEL = "smollm2-135m-instruct"
FAULTS = ("kill_prefill", "kill_pd", "kill_pool", "hang_prefill", "link_drop", "bandwidth_cut", "router_restart",
          "kill_supervised", "kv_flood")
BUDGET = 2048                    # max_num_batched_tokens of every engine: a prompt is one chunk
SHORT = (24, 120)                # prompt tokens, below the offload threshold: a range
LONG = (449, 641, 833)           # above it: few lengths, one reference engine per N-1 chunk
THRESHOLD = 256
OUTPUT_TOKENS = 12
LONG_SHARE = 0.35
MIN_LEAD = 0.01                  # nats by which every answer token must beat the runner-up
CANDIDATES_PER_PROMPT = 1.7      # prompts drawn per prompt kept (about 1 in 3 has a tie somewhere)
NOMINAL_MBIT, RTT_MS = 400.0, 10.0
HANG_S, DROP_S, CUT_S, CUT_FACTOR = 30.0, 20.0, 60.0, 10.0
FLOOD_CONNECTIONS, FLOOD_S = 300, 20.0  # kv_flood: idle connections per KV port, and how long
# A request held by a killed decode worker moves to another one (the router's migration): it must
# complete right like a request no fault touched. "" stands for requests no killed process held.
MIGRATABLE = ("", "pd-0", "pd-1")
KILLED_DOWN_S = 5.0              # a killed process stays dead this long before its restart
GAP_S = 12.0                     # quiet time between two faults' windows
WARMUP_S = 15.0                  # load before the first fault
COOLDOWN_S = 20.0                # load after the last fault's window
MIN_COMPLETED = 0.99
RSS_SETTLE_S = 90.0              # an RSS slope leaves out a service's first seconds (start-up, warm-up)
RSS_SERIES_EVERY = 10             # samples (seconds) between two points of the RSS series in chaos.json
RSS_MIN_SPAN_S = 60.0            # and needs this much time after them


@dataclass
class Fault:
    name: str
    start: float = 0.0           # seconds since the load started
    end: float = 0.0             # when the system was whole again (a restarted service healthy)
    killed: str = ""             # the process killed, whose in-flight requests are "held"
    notes: str = ""


@dataclass
class Request:
    index: int
    kind: str                    # short | long
    prompt_tokens: int
    start: float = 0.0
    end: float = 0.0
    ttft: float | None = None
    verdict: str = ""            # right | wrong | error | refused | hung | lost
    held_by: str = ""            # the killed process it was in flight in, if any
    detail: str = ""
    router: int = 0              # the router it was sent to (--routers: round-robin)


@dataclass
class Run:
    args: argparse.Namespace
    origin: float = 0.0
    faults: list[Fault] = field(default_factory=list)
    requests: list[Request] = field(default_factory=list)
    samples: list[dict] = field(default_factory=list)
    router_down: list[tuple[float, float, int]] = field(default_factory=list)  # (from, to, which router)
    segments: set[str] = field(default_factory=set)  # shared-memory files the services mapped

    def now(self) -> float:
        return time.monotonic() - self.origin


# --- topology --------------------------------------------------------------------------------------

def make_config(link, shm_dir: Path, num_routers: int = 1) -> dict:
    engine = {"max_num_batched_tokens": BUDGET}
    config = deployment_config(
        [{"name": "prefill-0", "service": "prefill_worker", "cluster": "prfaas", "host": link.ns_addr,
          "engine": engine, "env": {"VLLM_CPU_OMP_THREADS_BIND": "0"}},
         {"name": "pd-0", "service": "decode_worker", "role": "both", "cluster": "local", "host": link.host_addr,
          "kv_port": free_port(), "engine": engine, "env": {"VLLM_CPU_OMP_THREADS_BIND": "1"}},
         {"name": "pd-1", "service": "decode_worker", "role": "both", "cluster": "local", "host": link.host_addr,
          "kv_port": free_port(), "engine": engine, "env": {"VLLM_CPU_OMP_THREADS_BIND": "0"}}],
        router={"connect_timeout_s": 2.0, "stats_interval_s": 0.5, "port": free_ports(num_routers)},
        scheduler={"offload_threshold_tokens": THRESHOLD, "cache_block_size": 128, "adaptive_threshold": True,
                   "link_capacity_gbps": NOMINAL_MBIT / 1000, "threshold_step": 2.0, "threshold_hold_s": 4.0},
        transport={"recv_idle_timeout_s": 8.0, "io_timeout_s": 10.0, "connect_timeout_s": 2.0},
    )
    config["cache_pools"] = [
        {"name": "pool-prfaas", "cluster": "prfaas", "host": link.ns_addr, "port": free_port(),
         "memory_budget_gib": 0.5, "shared_memory_dir": str(shm_dir), "kv_port": free_port()},
        {"name": "pool-local", "cluster": "local", "host": link.host_addr, "port": free_port(),
         "memory_budget_gib": 0.5, "shared_memory_dir": str(shm_dir), "kv_port": free_port(),
         "ssd_dir": str(shm_dir.parent / "ssd-local"), "ssd_budget_gib": 0.5}]
    return config


def ports_of(config: dict, num_routers: int = 1) -> list[int]:
    ports = [config["router"]["port"] + i for i in range(num_routers)]
    for entry in config["workers"] + config["cache_pools"]:
        ports += [entry[key] for key in ("port", "kv_port") if entry.get(key)]
    return ports


# --- prompts and their expected answers ------------------------------------------------------------

def make_prompts(count: int, seed: int) -> list[tuple[str, list[int]]]:
    """``count`` prose prompts, each starting at its own offset of the corpus (no shared prefix)."""
    rng, text = random.Random(seed), corpus()
    prompts, starts = [], set()
    while len(prompts) < count:
        kind = "long" if rng.random() < LONG_SHARE else "short"
        length = rng.choice(LONG) if kind == "long" else rng.randint(*SHORT)
        start = rng.randrange(0, len(text) - length)
        if start in starts:
            continue
        starts.add(start)
        prompts.append((kind, text[start:start + length]))
    return prompts


def checkable_prompts(model_path: str, count: int, seed: int) -> tuple[list, list[set[str]]]:
    """``count`` prompts whose answers can be checked token for token, and the answers a healthy
    system may give for each.

    A prompt prefilled where it is decoded is one chunk; one prefilled elsewhere (PrfaaS or PD path)
    reaches the decode engine as ``N-1`` computed tokens, and the engine computes the last one alone.
    A long prompt's answer is right when it equals either colocated reference: one chunk of ``N``, or
    a chunk of ``N-1`` then one token. A prompt is kept only if, in both references, every answer
    token beats the runner-up by ``MIN_LEAD``: about a third of the candidates rest somewhere on two
    logits equal in bf16, a tie broken by token index that any other batch or chunk may break the
    other way (measured: such a prompt, recomputed after a failed transfer, gave a third text).

    Two reference engines share the work, one per core. The answers are kept in the prfaas cache
    directory under a hash of everything that decides them (prompts, chunks, the checkpoint, vLLM's
    and torch's versions, the CPU and the dtype its engines run), so a run with the same seed on the
    same host skips this step."""
    candidates = make_prompts(int(count * CANDIDATES_PER_PROMPT) + 10, seed)
    answers = reference_answers(model_path, candidates)
    kept = [(prompt, {text for text, _ in pair}) for prompt, pair in zip(candidates, answers)
            if min(lead for _, lead in pair) >= MIN_LEAD]
    print(f"chaos: {len(kept)} of {len(candidates)} candidate prompts have answers decided by at least "
          f"{MIN_LEAD} nats at every token", flush=True)
    if len(kept) < count:
        raise SystemExit(f"chaos: only {len(kept)} checkable prompts for the {count} the run sends")
    return [prompt for prompt, _ in kept[:count]], [texts for _, texts in kept[:count]]


def answers_path(model_path: str, work: list) -> Path:
    """Where the references' answers to ``work`` (index, prompt, budget) are kept: a hash of it and of
    what decides the engines' numbers, the dtype ``auto`` runs here included."""
    import hashlib

    from services.engine.args import resolve_dtype
    from services.models.cache import cache_dir

    identity = {**engine_identity(model_path), "dtype": resolve_dtype("auto", model_path)}
    key = hashlib.sha256(json.dumps([work, model_path, identity, OUTPUT_TOKENS, "leads"], sort_keys=True).encode())
    return cache_dir() / "chaos" / f"expected-{key.hexdigest()[:24]}.json"


def reference_answers(model_path: str, prompts) -> list[list[tuple[str, float]]]:
    """Per prompt, its references' (text, smallest lead): one chunk of ``N``, and for a long prompt
    also ``N-1`` then one token."""
    ids = [p for _, p in prompts]
    longs = [i for i, (kind, _) in enumerate(prompts) if kind == "long"]
    work = [(i, ids[i], BUDGET) for i in range(len(ids))] + [(i, ids[i], len(ids[i]) - 1) for i in longs]
    cached = answers_path(model_path, work)
    if cached.exists():
        print(f"chaos: expected answers from {cached}", flush=True)
        rows = json.loads(cached.read_text())
    else:
        halves = [work[0::2], work[1::2]]
        results: list[list] = [[], []]

        def reference(half: int) -> None:
            part = halves[half]
            results[half] = greedy_margins(model_path, [w[1] for w in part], [w[2] for w in part],
                                           OUTPUT_TOKENS, cpu=half)

        threads = [threading.Thread(target=reference, args=(half,)) for half in (0, 1)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        if len(results[0]) != len(halves[0]) or len(results[1]) != len(halves[1]):
            raise RuntimeError("the reference engine failed; see the error above")
        rows = [[w[0], text, lead] for half in (0, 1) for w, (text, lead) in zip(halves[half], results[half])]
        cached.parent.mkdir(parents=True, exist_ok=True)
        cached.write_text(json.dumps(rows))
    answers: list[list[tuple[str, float]]] = [[] for _ in ids]
    for index, text, lead in rows:
        answers[index].append((text, lead))
    return answers


# --- faults ----------------------------------------------------------------------------------------

class Faults:
    def __init__(self, run: Run, deployment: Deployment, link) -> None:
        self.run, self.deployment, self.link = run, deployment, link

    def apply(self, fault: Fault) -> None:
        fault.start = self.run.now()
        getattr(self, fault.name)(fault)
        fault.end = self.run.now()
        print(f"[{fault.end:6.1f} s] {fault.name}: window {fault.start:.1f}-{fault.end:.1f} s {fault.notes}",
              flush=True)

    def kill_prefill(self, fault: Fault) -> None:
        self._kill_and_restart(fault, "prefill-0")

    def kill_pd(self, fault: Fault) -> None:
        self._kill_and_restart(fault, "pd-1")

    def kill_pool(self, fault: Fault) -> None:
        self._kill_and_restart(fault, "pool-local")

    def hang_prefill(self, fault: Fault) -> None:
        child = self.deployment.child("prefill-0")
        os.killpg(child.process.pid, signal.SIGSTOP)
        time.sleep(HANG_S)
        os.killpg(child.process.pid, signal.SIGCONT)

    def link_drop(self, fault: Fault) -> None:
        table = f"chaos{os.getpid()}"
        rules = (f"table inet {table} {{\n chain input {{ type filter hook input priority 0; policy accept;\n"
                 f"  iifname \"{self.link.ns_if}\" drop\n }}\n chain output {{ type filter hook output priority 0;"
                 f" policy accept;\n  oifname \"{self.link.ns_if}\" drop\n }}\n}}\n")
        run_command(*self.link.exec_argv(["nft", "-f", "-"]), stdin=rules)
        try:
            time.sleep(DROP_S)
        finally:
            run_command(*self.link.exec_argv(["nft", "delete", "table", "inet", table]))

    def bandwidth_cut(self, fault: Fault) -> None:
        for side in ("host", "ns"):
            self.link.set_rate(NOMINAL_MBIT / CUT_FACTOR, side=side, action="replace")
        try:
            time.sleep(CUT_S)
        finally:
            for side in ("host", "ns"):
                self.link.set_rate(NOMINAL_MBIT, side=side, action="replace")

    def router_restart(self, fault: Fault) -> None:
        """SIGTERM to the last router (the only one without --routers), then start it again; requests
        sent to the other routers meanwhile are counted like any other."""
        replica = self.deployment.routers - 1
        name = supervisor.router_names(self.deployment.routers)[replica]
        child = self.deployment.child(name)
        down = self.run.now()
        os.killpg(child.process.pid, signal.SIGTERM)
        child.process.wait(60)
        child.log_file.close()
        child.start()
        port = self.deployment.config["router"]["port"] + replica
        _wait(lambda: supervisor.router_healthy("127.0.0.1", port), 120, f"{name} after restart")
        self.run.router_down.append((down, self.run.now(), replica))
        fault.killed, fault.notes = name, "(drained, then restarted)"

    def kill_supervised(self, fault: Fault) -> None:
        """SIGKILL of pd-1's main process, restarted by the supervision `prfaas up` runs (not by this bench)."""
        from services.config import SupervisorConfig
        from services.launcher.watch import Watch

        child = self.deployment.child("pd-1")
        watch = Watch([child], SupervisorConfig(), self.run.args.out / "launcher-stats.json",
                      say=lambda line: print(line.splitlines()[0], flush=True))
        fault.killed, killed = "pd-1", child.process.pid
        os.kill(killed, signal.SIGKILL)

        def restarted() -> bool:
            if reason := watch.poll():
                raise RuntimeError(reason)
            return child.process.pid != killed

        _wait(restarted, 60, "pd-1's restart by the supervision")
        host, port = supervisor.grpc_endpoints(self.deployment.parsed)["pd-1"]
        _wait(lambda: supervisor.worker_serving(host, port, self.deployment.security), 300, "pd-1 after restart")
        fault.notes = f"(restarted by the supervision, {watch.stats_path.read_text()})"
        time.sleep(2.0)  # the router notices on its next health poll

    def kv_flood(self, fault: Fault) -> None:
        """Unauthenticated connections to each decode worker's KV port (a few with garbage first), held
        for ``FLOOD_S``: the receivers' handshake budget displaces and times them out, and the prefill
        worker's own connections still get in (issue 52)."""
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, min(hard, 4096)), hard))
        targets = [(w["host"], w["kv_port"]) for w in self.deployment.config["workers"] if w.get("kv_port")]
        flood = []
        try:
            for address in targets:
                for garbage in (b"GET / HTTP/1.1\r\n\r\n", os.urandom(64), b"\x00" * 4096):
                    sock = socket.create_connection(address, timeout=5)
                    sock.sendall(garbage)
                    flood.append(sock)
                flood += [socket.create_connection(address, timeout=5) for _ in range(FLOOD_CONNECTIONS)]
            fault.notes = f"({len(flood)} connections to {len(targets)} KV ports)"
            time.sleep(FLOOD_S)
        finally:
            for sock in flood:
                sock.close()

    def _kill_and_restart(self, fault: Fault, name: str) -> None:
        child = self.deployment.child(name)
        fault.killed = name
        os.killpg(child.process.pid, signal.SIGKILL)
        child.process.wait()
        child.log_file.close()
        time.sleep(KILLED_DOWN_S)
        child.start()
        host, port = supervisor.grpc_endpoints(self.deployment.parsed)[name]
        _wait(lambda: supervisor.worker_serving(host, port, self.deployment.security), 300, f"{name} after restart")
        # The router notices on its next health poll; the window ends when it routes there again.
        time.sleep(2.0)


def _wait(predicate, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not healthy within {timeout_s:.0f} s")
        time.sleep(0.5)


def schedule(names: list[str], seed: int) -> list[Fault]:
    order = list(names)
    random.Random(seed).shuffle(order)
    return [Fault(name) for name in order]


# --- load ------------------------------------------------------------------------------------------

async def drive_load(run: Run, base_urls: list[str], api_key: str | None, prompts, expected,
                     stop: threading.Event, held: dict[int, Request]) -> None:
    """Requests at ``--rate``, round-robin over the routers."""
    interval = 1.0 / run.args.rate
    tasks = []
    clients = [OpenAIClient(url, api_key, timeout_s=run.args.deadline, max_connections=0) for url in base_urls]
    try:
        for client in clients:
            await client.__aenter__()
        next_at = run.now()
        for index, (kind, ids) in enumerate(prompts):
            if stop.is_set():
                break
            await asyncio.sleep(max(0.0, next_at - run.now()))
            next_at += interval
            request = Request(index, kind, len(ids), start=run.now(), router=index % len(clients))
            run.requests.append(request)
            held[index] = request
            tasks.append(asyncio.create_task(_one(run, clients[request.router], request, ids, expected[index],
                                                  held)))
        await asyncio.gather(*tasks)
    finally:
        for client in clients:
            await client.__aexit__(None, None, None)


async def _one(run: Run, client: OpenAIClient, request: Request, ids: list[int], expected: set[str],
               held: dict[int, Request]) -> None:
    payload = {"model": MODEL, "prompt": ids, "max_tokens": OUTPUT_TOKENS, "temperature": 0, "stream": True,
               "ignore_eos": True, "stream_options": {"include_usage": True}}
    outcome = await client.stream("/v1/completions", payload, RequestOutcome(request.index, len(ids), OUTPUT_TOKENS))
    held.pop(request.index, None)
    request.end = run.now()
    request.ttft = outcome.ttft if outcome.num_chunks else None
    request.verdict, request.detail = classify(outcome, expected)


def classify(outcome: RequestOutcome, expected: set[str]) -> tuple[str, str]:
    if outcome.ok:
        if outcome.text in expected and outcome.output_len == OUTPUT_TOKENS:
            return "right", ""
        return "wrong", f"got {outcome.text!r} ({outcome.output_len} tokens), expected one of {sorted(expected)!r}"
    if outcome.status == TIMEOUT_ERROR:
        return "hung", outcome.error
    if outcome.status == CONNECTION_ERROR:
        return ("refused" if "cannot connect" in outcome.error else "lost"), outcome.error
    if isinstance(outcome.status, int) or outcome.error.startswith("error in stream"):
        clear = outcome.error and "Traceback" not in outcome.error and "(empty body)" not in outcome.error
        return ("error" if clear else "lost"), outcome.error
    return "lost", outcome.error


# --- sampling --------------------------------------------------------------------------------------

def process_figures(pgid: int) -> dict:
    """RSS (MiB), its private part (RssAnon) and its shared-memory part (RssShmem: the pool arena
    and KV segments a process has touched, bounded by their sizes), open fds and threads, summed
    over a service's process group."""
    kib = dict.fromkeys(("VmRSS", "RssAnon", "RssShmem"), 0)
    fds = threads = 0
    for pid in group_pids(pgid):
        try:
            for line in open(f"/proc/{pid}/status"):
                key, _, value = line.partition(":")
                if key in kib:
                    kib[key] += int(value.split()[0])
                elif key == "Threads":
                    threads += int(value.split()[0])
            fds += len(os.listdir(f"/proc/{pid}/fd"))
        except OSError:
            continue
    return {"rss_mib": kib["VmRSS"] / 1024, "anon_mib": kib["RssAnon"] / 1024, "shmem_mib": kib["RssShmem"] / 1024,
            "fds": fds, "threads": threads}


def sampler(run: Run, deployment: Deployment, stop: threading.Event) -> None:
    """Every second: each service's RSS, fds and threads, and the router's routing counters; every
    fifth, the shared-memory files the services' processes map (checked for leftovers at the end)."""
    while not stop.wait(1.0):
        sample = {"t": run.now(), "services": {}, "routed": router_routed(deployment)}
        for child in deployment.children:
            if child.process is not None and child.process.poll() is None:
                sample["services"][child.name] = {"pid": child.process.pid, **process_figures(child.process.pid)}
                if len(run.samples) % 5 == 0:
                    run.segments |= shm_ledger.mapped_segments(shm_ledger.descendants(child.process.pid))
        run.samples.append(sample)


def router_routed(deployment: Deployment) -> dict[str, float] | None:
    """Long-prompt routing decisions so far by path (None while the router is down)."""
    try:
        text = deployment.metrics_text()
    except OSError:
        return None
    counts = {}
    for path in ("local", "pd", "prfaas"):
        total = _sample(text, f'prfaas_scheduler_decision_prompt_tokens_count{{path="{path}"}}')
        bucket = f'prfaas_scheduler_decision_prompt_tokens_bucket{{le="{float(THRESHOLD)}",path="{path}"}}'
        short = _sample(text, bucket)
        counts[path] = total - short
    return counts


def _sample(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    return 0.0


# --- figures ---------------------------------------------------------------------------------------

def in_window(t: float, faults: list[Fault]) -> bool:
    return any(f.start <= t <= f.end for f in faults)


def _ttft(values: list[float]) -> dict:
    return {"p50": percentile(values, 0.5), "p99": percentile(values, 0.99), "n": len(values)}


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q * (len(values) - 1))))]


def offload_series(run: Run) -> list[tuple[float, float, float]]:
    """(time, long decisions offloaded since the previous sample, long decisions since then): counters
    restart with the router, so a drop starts a new baseline."""
    series, previous = [], None
    for sample in run.samples:
        routed = sample["routed"]
        if routed is None:
            continue
        if previous is not None and all(routed[p] >= previous[p] for p in routed):
            offloaded = routed["prfaas"] - previous["prfaas"]
            total = sum(routed.values()) - sum(previous.values())
            series.append((sample["t"], offloaded, total))
        previous = routed
    return series


def reaction_times(run: Run) -> dict[str, dict]:
    """For faults that take the PrfaaS path away or squeeze it: seconds from the fault to the first
    long prompt kept local, and from the end of the window to the first long prompt offloaded again."""
    series = offload_series(run)
    reactions = {}
    for fault in run.faults:
        if fault.name not in ("kill_prefill", "hang_prefill", "link_drop", "bandwidth_cut"):
            continue
        off = next((t for t, offloaded, total in series if fault.start < t and total > offloaded), None)
        back = next((t for t, offloaded, total in series if t > fault.end and offloaded > 0), None)
        reactions[fault.name] = {"moved_off_s": None if off is None else round(off - fault.start, 1),
                                 "moved_back_s": None if back is None else round(back - fault.end, 1)}
    return reactions


def rss_slopes(run: Run) -> dict[str, dict]:
    """Per service: RSS slope (MiB/hour, least squares over its last incarnation's samples from
    ``RSS_SETTLE_S`` after its first one; none when fewer than ``RSS_MIN_SPAN_S`` remain), the same over
    the second half of those samples (warm-up, such as an engine's first touch of its KV cache, shows
    in the first; a leak in both), the RSS series, fds and threads at its first and last sample."""
    figures = {}
    names = {name for sample in run.samples for name in sample["services"]}
    for name in sorted(names):
        points = [(s["t"], s["services"][name]) for s in run.samples if name in s["services"]]
        last_pid = points[-1][1]["pid"]
        points = [(t, p) for t, p in points if p["pid"] == last_pid]
        steady = [(t, p) for t, p in points if t >= points[0][0] + RSS_SETTLE_S]
        late = [(t, p) for t, p in steady if t >= (steady[0][0] + steady[-1][0]) / 2] if steady else []
        figures[name] = {"rss_slope_mib_per_h": _slope_per_h(steady),
                         "rss_slope_second_half_mib_per_h": _slope_per_h(late, RSS_MIN_SPAN_S / 2),
                         "private_slope_second_half_mib_per_h": _slope_per_h(late, RSS_MIN_SPAN_S / 2, "anon_mib"),
                         "rss_series": [[round(t), round(p["rss_mib"]), round(p.get("anon_mib", 0)),
                                         round(p.get("shmem_mib", 0))] for t, p in points[::RSS_SERIES_EVERY]],
                         "rss_mib": [round(points[0][1]["rss_mib"]), round(points[-1][1]["rss_mib"])],
                         "shmem_mib": [round(points[0][1].get("shmem_mib", 0)),
                                       round(points[-1][1].get("shmem_mib", 0))],
                         "fds": [points[0][1]["fds"], points[-1][1]["fds"]],
                         "threads": [points[0][1]["threads"], points[-1][1]["threads"]],
                         "restarted": any(s["services"].get(name, {}).get("pid") not in (None, last_pid)
                                          for s in run.samples)}
    return figures


def _slope_per_h(points, min_span_s: float = 0.0, key: str = "rss_mib") -> float | None:
    """Least-squares slope of ``key`` in MiB/hour; none when fewer than three points or too short a span."""
    if len(points) < 3 or points[-1][0] - points[0][0] < (min_span_s or RSS_MIN_SPAN_S):
        return None
    return round(statistics.linear_regression([t for t, _ in points], [p.get(key, 0.0) for _, p in points]).slope
                 * 3600, 1)


def kv_usage(deployment: Deployment) -> dict[str, float]:
    return {name: deployment.worker_stats(name).kv_cache_usage for name in ("prefill-0", "pd-0", "pd-1")}


def pool_accounting(deployment: Deployment, config: dict, shm_dir: Path) -> dict[str, dict]:
    """What each pool says it holds against what is really there: block bytes within the slots its
    arena holds for them (each block fills whole slots, its last one partly), no lease left once the
    load has stopped, the arena file resident in full, and the SSD tier's accounted bytes equal to
    its files'."""
    from prfaas.v1 import cache_pool_pb2, cache_pool_pb2_grpc

    figures = {}
    for pool in config["cache_pools"]:
        with deployment.security.channel(f"{pool['host']}:{pool['port']}") as channel:
            stub = cache_pool_pb2_grpc.CachePoolStub(channel)
            stats = stub.GetStats(cache_pool_pb2.CachePoolStatsRequest(), timeout=10)
            deadline = time.monotonic() + 40  # a dead client's lease expires (lease_timeout_s, 30 s)
            while stats.leased_slots and time.monotonic() < deadline:
                time.sleep(1.0)
                stats = stub.GetStats(cache_pool_pb2.CachePoolStatsRequest(), timeout=10)
        stored = stats.arena_slots - stats.arena_free_slots - stats.leased_slots
        slot = stats.arena_slot_bytes
        in_slots = slot == 0 or (stored - stats.memory_blocks) * slot < stats.memory_bytes <= stored * slot \
            or stats.memory_bytes == stored == 0
        arena = sorted(shm_dir.glob(f"prfaas-arena-*{pool['name']}*"))
        resident = sum(a.stat().st_blocks * 512 for a in arena)
        ssd_dir = pool.get("ssd_dir")
        on_disk = sum(p.stat().st_size for p in Path(ssd_dir).rglob("*") if p.is_file()) if ssd_dir else 0
        figures[pool["name"]] = {
            "memory_bytes": stats.memory_bytes, "memory_blocks": stats.memory_blocks,
            "memory_budget_bytes": stats.memory_budget_bytes, "arena_slots_stored": stored, "arena_slot_bytes": slot,
            "leased_slots": stats.leased_slots, "arena_files": [a.name for a in arena],
            "arena_resident_bytes": resident,
            "ssd_bytes": stats.ssd_bytes, "ssd_bytes_on_disk": on_disk,
            "ok": (stats.memory_bytes <= stats.memory_budget_bytes and in_slots and stats.leased_slots == 0
                   and stats.ssd_bytes == on_disk)}
    return figures


def shm_files(shm_dir: Path) -> list[str]:
    return sorted(p.name for p in shm_dir.iterdir()) if shm_dir.exists() else []


def leftovers(run: Run, shm_dir: Path) -> list[str]:
    """Files in the pools' directory, and shared-memory files any service mapped, that still exist."""
    return shm_files(shm_dir) + sorted(Path(p).name for p in run.segments if os.path.exists(p))


def listening(ports: list[int]) -> list[str]:
    out = subprocess.run(["ss", "-Hltn"], capture_output=True, text=True).stdout
    return [line for line in out.splitlines() if any(line.split()[3].endswith(f":{port}") for port in ports)]


def _held(request: Request, fault: Fault) -> bool:
    """Whether ``request`` was in flight in the process that ``fault`` killed or restarted (a router
    holds only the requests sent to it)."""
    if fault.killed.startswith("router") and fault.killed != _router_name(request.router):
        return False
    return bool(fault.killed) and request.start < fault.start < (request.end or float("inf"))


def _router_name(replica: int) -> str:
    return supervisor.router_names(replica + 1)[replica]


def _to_other_routers(run: Run) -> list[Request]:
    """Requests sent to a router other than the one restarting, while it was down (--routers)."""
    return [r for r in run.requests if any(a <= r.start <= b and r.router != replica
                                           for a, b, replica in run.router_down)]


def summarize(run: Run, after: dict) -> dict:
    requests = run.requests
    counts = {v: sum(r.verdict == v for r in requests) for v in ("right", "wrong", "error", "refused", "hung", "lost")}
    counts["unfinished"] = sum(not r.verdict for r in requests)
    for request in requests:
        request.held_by = next((f.killed for f in run.faults if _held(request, f)), "")
    during_router_down = [r for r in requests if any(a <= r.start <= b and r.router == replica
                                                     for a, b, replica in run.router_down)]
    eligible = [r for r in requests if r.held_by in MIGRATABLE and r not in during_router_down]
    held = [r for r in requests if r.held_by and r.held_by not in MIGRATABLE]
    moved = [r for r in requests if r.held_by in MIGRATABLE and r.held_by]
    ttft_in = [r.ttft for r in requests if r.ttft is not None and in_window(r.start, run.faults)]
    ttft_out = [r.ttft for r in requests if r.ttft is not None and not in_window(r.start, run.faults)]
    return {
        "requests": {"sent": len(requests), **counts, "held_by_a_killed_decode_worker": len(moved),
                     "held_by_a_killed_decode_worker_right": sum(r.verdict == "right" for r in moved),
                     "held_by_another_killed_process": len(held),
                     "held_ended_badly": sum(r.verdict not in ("right", "error", "refused") for r in held),
                     "sent_while_router_down": len(during_router_down),
                     "router_restarts_beside_others": len(run.router_down) if len({r.router for r in requests}) > 1
                     else 0,
                     "sent_to_other_routers_meanwhile": len(_to_other_routers(run)),
                     "sent_to_other_routers_meanwhile_right": sum(r.verdict == "right" for r in _to_other_routers(run)),
                     "eligible": len(eligible), "eligible_right": sum(r.verdict == "right" for r in eligible)},
        "completed_share": (sum(r.verdict == "right" for r in eligible) / len(eligible)) if eligible else 0.0,
        "ttft_s": {"inside_faults": _ttft(ttft_in), "outside_faults": _ttft(ttft_out)},
        "scheduler_reaction": reaction_times(run),
        "services": rss_slopes(run),
        **after,
    }


def verdict_line(summary: dict) -> tuple[bool, str]:
    r = summary["requests"]
    leaks = (summary["kv_blocks_leaked"] + len(summary["shm_files_left"]) + len(summary["listening_left"])
             + sum(not p["ok"] for p in summary["pools"].values()))
    ok = (r["wrong"] == 0 and r["hung"] == 0 and r["lost"] == 0 and r["unfinished"] == 0 and leaks == 0
          and r["held_ended_badly"] == 0 and summary["completed_share"] >= MIN_COMPLETED
          and r["sent_to_other_routers_meanwhile_right"] == r["sent_to_other_routers_meanwhile"]
          # a router restarted beside others with no request sent to them meanwhile would pass vacuously
          and (r["router_restarts_beside_others"] == 0 or r["sent_to_other_routers_meanwhile"] > 0))
    line = (f"chaos: completed {summary['completed_share']:.3f} of {r['eligible']} requests not held by a killed "
            f"prefill worker, pool or router (of them {r['held_by_a_killed_decode_worker_right']}/"
            f"{r['held_by_a_killed_decode_worker']} moved off a killed decode worker), wrong {r['wrong']}, "
            f"hung {r['hung']}, lost {r['lost'] + r['unfinished']}, leaks {leaks}; "
            f"target >= {MIN_COMPLETED} and 0 wrong/hung/lost/leaked: {'PASS' if ok else 'FAIL'}")
    return ok, line


def print_table(summary: dict, run: Run) -> None:
    r = summary["requests"]
    print("\nrequests: " + ", ".join(f"{k} {v}" for k, v in r.items()))
    for where, figures in summary["ttft_s"].items():
        p50, p99 = figures["p50"], figures["p99"]
        print(f"TTFT {where:15s} p50 {_ms(p50)}  p99 {_ms(p99)}  (n={figures['n']})")
    print(f"{'fault':16s} {'window (s)':>14s}  held  ended badly")
    for fault in run.faults:
        held = [q for q in run.requests if _held(q, fault)]
        print(f"{fault.name:16s} {fault.start:6.1f}-{fault.end:6.1f}  {len(held):4d}  "
              f"{sum(q.verdict not in ('right', 'error', 'refused') for q in held)}")
    for name, reaction in summary["scheduler_reaction"].items():
        print(f"scheduler on {name}: long prompts moved off the PrfaaS path after {reaction['moved_off_s']} s, "
              f"back {reaction['moved_back_s']} s after recovery")
    print(f"{'service':12s} {'RSS MiB start/end':>18s} {'slope MiB/h':>12s} {'2nd half':>9s} {'private':>8s} "
          f"{'shmem MiB':>11s} {'fds':>9s} {'threads':>9s}")
    for name, s in summary["services"].items():
        print(f"{name:12s} {s['rss_mib'][0]:>8d}/{s['rss_mib'][1]:<9d} {str(s['rss_slope_mib_per_h']):>12s} "
              f"{str(s['rss_slope_second_half_mib_per_h']):>9s} {str(s['private_slope_second_half_mib_per_h']):>8s} "
              f"{s['shmem_mib'][0]:>5d}/{s['shmem_mib'][1]:<5d} "
              f"{s['fds'][0]:>4d}/{s['fds'][1]:<4d} {s['threads'][0]:>4d}/{s['threads'][1]:<4d}"
              f"{'  (restarted: last incarnation)' if s['restarted'] else ''}")
    print(f"KV usage idle before/after the load: {summary['kv_usage_before']} / {summary['kv_usage_after']}")
    for name, pool in summary["pools"].items():
        print(f"{name}: {pool['memory_blocks']} blocks, {pool['memory_bytes']} B of {pool['memory_budget_bytes']} B "
              f"budget in {pool['arena_slots_stored']} arena slots of {pool['arena_slot_bytes']} B "
              f"({pool['leased_slots']} leased; arena resident {pool['arena_resident_bytes']} B), SSD accounted "
              f"{pool['ssd_bytes']} B, on disk {pool['ssd_bytes_on_disk']} B: {'ok' if pool['ok'] else 'MISMATCH'}")
    print(f"left after the run: shared-memory files {summary['shm_files_left']} (of {len(run.segments)} the "
          f"services mapped, and the pools' directory), "
          f"listening sockets {summary['listening_left']}")
    bad = [q for q in run.requests if q.verdict in ("wrong", "hung", "lost", "")]
    for q in bad[:10]:
        print(f"  request {q.index} ({q.kind}, {q.prompt_tokens} tokens, {q.start:.1f}-{q.end:.1f} s): "
              f"{q.verdict or 'unfinished'} {q.detail[:200]}")


def _ms(seconds: float | None) -> str:
    return "   -   " if seconds is None else f"{seconds * 1000:7.0f} ms"


def plot(run: Run, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, bottom, memory) = plt.subplots(3, 1, figsize=(11, 9), sharex=True)
    for axis in (top, bottom, memory):
        for fault in run.faults:
            axis.axvspan(fault.start, fault.end, color="tab:red", alpha=0.12)
    for fault in run.faults:
        top.annotate(fault.name, (fault.start, 1.0), xycoords=("data", "axes fraction"), fontsize=7,
                     rotation=90, va="top")
    for kind, color in (("short", "tab:blue"), ("long", "tab:orange")):
        points = [(r.start, r.ttft) for r in run.requests if r.kind == kind and r.ttft is not None]
        if points:
            top.scatter(*zip(*points), s=9, color=color, label=f"{kind} prompts")
    failed = [r.start for r in run.requests if r.verdict not in ("right", "")]
    if failed:
        top.scatter(failed, [0] * len(failed), marker="x", color="black", s=16, label="not completed")
    top.set_ylabel("TTFT (s)")
    top.set_yscale("symlog", linthresh=1.0)
    top.legend(loc="upper right", fontsize=8)
    series = offload_series(run)
    window = 15.0
    xs, ys = [], []
    for t, _, _ in series:
        recent = [(o, n) for u, o, n in series if t - window < u <= t]
        total = sum(n for _, n in recent)
        if total:
            xs.append(t)
            ys.append(sum(o for o, _ in recent) / total)
    bottom.plot(xs, ys, color="tab:green")
    bottom.set_ylabel(f"long prompts offloaded\n(last {window:.0f} s)")
    bottom.set_ylim(-0.05, 1.05)
    for name, figures in rss_slopes(run).items():
        memory.plot([point[0] for point in figures["rss_series"]], [point[1] for point in figures["rss_series"]],
                    label=name)
    memory.set_ylabel("RSS (MiB, last\nincarnation)")
    memory.legend(loc="lower right", fontsize=7, ncol=3)
    memory.set_xlabel("seconds since the load started (shaded: fault windows)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# --- main ------------------------------------------------------------------------------------------

def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, default=5.0, help="load duration at least (default 5); the "
                        "faults are spread over it, and it is stretched when they do not fit")
    parser.add_argument("--seed", type=int, default=0, help="orders the faults and picks the prompts (default 0)")
    parser.add_argument("--faults", default=",".join(FAULTS),
                        help=f"comma-separated, from: {', '.join(FAULTS)} (default: all)")
    parser.add_argument("--rate", type=float, default=0.4, help="requests per second (default 0.4)")
    parser.add_argument("--deadline", type=float, default=150.0,
                        help="seconds after which an unanswered request counts as hung (default 150)")
    parser.add_argument("--routers", type=int, default=1,
                        help="routers in front of the same workers (prfaas up --routers), requests spread over them "
                        "round-robin; router_restart restarts the last one, and requests sent to the others while it "
                        "is down count as any other (they must all be right) (default 1)")
    parser.add_argument("--out", type=Path, default=None,
                        help="directory for chaos.json and chaos.png (default bench/results/chaos-<time>)")
    args = parser.parse_args(argv)
    names = [n.strip() for n in args.faults.split(",") if n.strip()]
    unknown = sorted(set(names) - set(FAULTS))
    if unknown:
        parser.error(f"--faults: unknown {', '.join(unknown)} (choose from {', '.join(FAULTS)})")
    if not 1 <= args.routers <= 8:
        parser.error("--routers must be between 1 and 8")
    if args.minutes <= 0 or args.rate <= 0 or args.deadline <= 0:
        parser.error("--minutes, --rate and --deadline must be positive")
    args.fault_names = names
    args.out = args.out or results_dir("chaos")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if (reason := available()) is not None:
        sys.exit(f"chaos: {reason}")
    for tool, package in (("nft", "nftables"), ("gcc", "gcc"), ("ss", "iproute2")):
        _common.require(tool, package)
    args.out.mkdir(parents=True, exist_ok=True)
    run = Run(args)
    run.faults = schedule(args.fault_names, args.seed)
    count = int(args.rate * (max(args.minutes * 60, _schedule_length(run.faults)) + 60)) + 10
    print(f"chaos: {count} prompts; computing the expected answers of candidates with two colocated engines ...",
          flush=True)
    from services.models import smollm2

    started = time.monotonic()
    prompts, expected = checkable_prompts(str(smollm2.prepare()), count, args.seed)
    print(f"chaos: expected answers in {time.monotonic() - started:.0f} s", flush=True)
    shm_dir = Path(f"/dev/shm/prfaas-chaos-{os.getpid()}")
    shm_dir.mkdir()
    try:
        with wan_path(NOMINAL_MBIT, RTT_MS, subnet="10.213.97") as link:
            link.set_rate(NOMINAL_MBIT, side="ns", action="replace")  # the KV direction is capped too
            return _run(run, link, shm_dir, prompts, expected)
    finally:
        shutil.rmtree(shm_dir, ignore_errors=True)
        shutil.rmtree(shm_dir.parent / "ssd-local", ignore_errors=True)


def _schedule_length(faults: list[Fault]) -> float:
    durations = {"kill_prefill": 60, "kill_pd": 60, "kill_pool": 15, "hang_prefill": HANG_S, "link_drop": DROP_S,
                 "bandwidth_cut": CUT_S, "router_restart": 15, "kv_flood": FLOOD_S, "kill_supervised": 60}
    return WARMUP_S + sum(durations[f.name] + GAP_S for f in faults) + COOLDOWN_S


def _run(run: Run, link, shm_dir: Path, prompts, expected) -> int:
    args = run.args
    config = make_config(link, shm_dir, args.routers)
    (shm_dir.parent / "ssd-local").mkdir(exist_ok=True)
    prefixes = {"prefill-0": link.exec_argv([]), "pool-prfaas": link.exec_argv([])}
    deployment = Deployment(config, args.out, prefixes=prefixes, routers=args.routers)
    print(f"chaos: starting the deployment (logs in {args.out}) ...", flush=True)
    deployment.start()
    from services.config import load_config

    deployment.parsed = load_config(deployment.config_path)
    stop_load, stop_sampling = threading.Event(), threading.Event()
    held: dict[int, Request] = {}
    try:
        kv_before = kv_usage(deployment)
        run.origin = time.monotonic()
        sampling = threading.Thread(target=sampler, args=(run, deployment, stop_sampling), daemon=True)
        sampling.start()
        api_key = None
        load = threading.Thread(target=lambda: asyncio.run(drive_load(run, deployment.base_urls, api_key, prompts,
                                                                      expected, stop_load, held)), daemon=True)
        load.start()
        faults = Faults(run, deployment, link)
        spare = max(0.0, args.minutes * 60 - _schedule_length(run.faults))
        gap = GAP_S + spare / max(1, len(run.faults))
        time.sleep(WARMUP_S)
        for fault in run.faults:
            print(f"[{run.now():6.1f} s] {fault.name} ...", flush=True)
            faults.apply(fault)
            time.sleep(gap)
        remaining = args.minutes * 60 - run.now()
        time.sleep(max(COOLDOWN_S, remaining))
        stop_load.set()
        print(f"[{run.now():6.1f} s] load stopped; waiting for {len(held)} requests in flight ...", flush=True)
        load.join(args.deadline + 30)
        stop_sampling.set()
        sampling.join()
        time.sleep(3.0)  # the engines free finished requests' blocks on their next step
        after = {"kv_usage_before": kv_before, "kv_usage_after": kv_usage(deployment),
                 "pools": pool_accounting(deployment, config, shm_dir)}
        after["kv_blocks_leaked"] = sum(after["kv_usage_after"][n] > kv_before[n] + 1e-9 for n in kv_before)
    finally:
        stop_load.set()
        stop_sampling.set()
        deployment.stop()
    deadline = time.monotonic() + 10.0  # resource trackers unlink what their parents left, just after
    while time.monotonic() < deadline and leftovers(run, shm_dir):
        time.sleep(0.5)
    after["shm_files_left"] = leftovers(run, shm_dir)
    after["listening_left"] = listening(ports_of(config, args.routers))
    summary = summarize(run, after)
    print_table(summary, run)
    report = {"args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
              "faults": [asdict(f) for f in run.faults], "summary": summary,
              "requests": [asdict(r) for r in run.requests]}
    (args.out / "chaos.json").write_text(json.dumps(report, indent=1))
    plot(run, args.out / "chaos.png")
    print(f"report: {args.out / 'chaos.json'}, plot: {args.out / 'chaos.png'}")
    ok, line = verdict_line(summary)
    print(line)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
