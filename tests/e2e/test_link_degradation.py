"""The short-timescale scheduler on a degraded and on a cut PrfaaS link, end to end.

One machine, two clusters: the PrfaaS prefill worker runs inside a network namespace made here,
joined to the host by a veth pair (10.213.93.1 here, .2 there). Its KV stream to the local worker
(which listens on the host end of the pair) leaves the namespace through a ``tbf`` cap; the router
reaches the prefill worker over the same pair, uncapped in that direction. Everything else stays on
loopback. While closed-loop clients (the official ``openai`` client) send long prompts above the
threshold and short ones below it, the test squeezes the cap, lifts it, takes the link down and up,
and reads the controller's reaction from the router's ``/metrics``. Every request must complete or
be refused with 429/503: none lost, none hung. Needs root (skipped otherwise).
"""
from __future__ import annotations

import itertools
import random
import re
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

from support import netns
from support.deployment import Deployment, deployment_config, wait_until
from support.ports import free_port

pytestmark = pytest.mark.e2e

MODEL = "smollm2-135m-instruct"
SECRET = "e2e-link-secret"
LONG, SHORT = 600, 48           # prompt tokens; the KV of a long one is ~14 MB (~110 Mbit)
BASE_THRESHOLD = 400            # one raise (x2) keeps long prompts local
OUTPUT_TOKENS = 4
NUM_LONG_CLIENTS = 2
SHORT_PAUSE_S = 0.5
# Each phase's offloaded share is counted over this many routing decisions for long prompts (read
# from the decision histogram, so short prompts, always local, do not dilute it), however long they
# take on this machine: a long request took 2-4 s on one CPU and ~8 s on another.
LONG_DECISIONS = 4
LONG_BUCKET = 512               # SHORT <= 512 < LONG: the histogram bucket that separates them
NOMINAL_MBIT, DEGRADED_MBIT = 1000, 30
RTT_RISE_MS = 8.0               # the veth's RTT is ~1-4 ms; a full tbf queue adds 20 ms
REQUEST_TIMEOUT_S = 90.0
REACT_S = 30.0                  # the controller's reaction, stats interval and hold time included
PHASE_S = 60.0                  # the longest wait for a phase's LONG_DECISIONS
WINDOW_S = 8.0                  # how long routing is counted while the link is down
POLL_S = 0.25                   # how often the degraded phase reads the decisions and the threshold
SETTLE_S = 3.0                  # link telemetry's staleness bound (scheduling/link_signals.py STALE_S)


@pytest.fixture(scope="module")
def link():
    if (reason := netns.available()) is not None:
        pytest.skip(f"link degradation test {reason}")
    with netns.veth_link(subnet="10.213.93", rate_mbit=NOMINAL_MBIT, side="ns") as link:
        yield link


@pytest.fixture(scope="module")
def cluster(link, tmp_path_factory):
    config = deployment_config(
        [{"name": "prefill-0", "service": "prefill_worker", "cluster": "prfaas", "host": link.ns_addr,
          "env": {"VLLM_CPU_OMP_THREADS_BIND": "0"}},
         {"name": "local-0", "service": "decode_worker", "role": "both", "host": link.host_addr,
          "kv_port": free_port(), "env": {"VLLM_CPU_OMP_THREADS_BIND": "1"}}],
        router={"connect_timeout_s": 1.0, "stats_interval_s": 0.5},
        scheduler={"offload_threshold_tokens": BASE_THRESHOLD, "adaptive_threshold": True,
                   "link_capacity_gbps": NOMINAL_MBIT / 1000, "threshold_step": 2.0, "threshold_hold_s": 4.0,
                   "congestion_rtt_increase_ms": RTT_RISE_MS},
        transport={"secret": SECRET, "recv_idle_timeout_s": 8.0, "io_timeout_s": 10.0, "connect_timeout_s": 2.0},
    )
    deployment = Deployment(config, tmp_path_factory.mktemp("link"), prefixes={"prefill-0": link.exec_argv([])})
    deployment.start()
    try:
        yield deployment
    finally:
        deployment.stop()


@pytest.fixture(autouse=True)
def nominal_link(link):
    """Each test starts, and leaves the next one, on an intact link (also after a failure)."""
    yield
    link.set_up(True)
    link.set_rate(NOMINAL_MBIT, side="ns")


class Load:
    """Closed-loop clients until the ``with`` block ends: ``NUM_LONG_CLIENTS`` of long prompts, one of
    short ones. ``outcomes`` counts completed and rejected (429/503) requests; ``lost`` says what
    went wrong with the others, hung ones included."""

    def __init__(self, base_url: str, seed: int) -> None:
        self._client = openai.OpenAI(base_url=base_url + "/v1", api_key="none", max_retries=0,
                                     timeout=REQUEST_TIMEOUT_S)
        self._seeds = itertools.count(seed)
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self.outcomes: Counter = Counter()
        self.lost: list[str] = []
        lengths = [LONG] * NUM_LONG_CLIENTS + [SHORT]
        self._threads = [threading.Thread(target=self._loop, args=(n,), daemon=True) for n in lengths]

    def __enter__(self) -> "Load":
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(REQUEST_TIMEOUT_S + 10)
        self.lost += [f"{t.name} still waiting" for t in self._threads if t.is_alive()]

    def _loop(self, length: int) -> None:
        while not self._stop.is_set():
            outcome = self._request(length)
            with self._lock:
                if outcome in ("completed", "rejected"):
                    self.outcomes[outcome] += 1
                else:
                    self.lost.append(outcome)
            if length == SHORT:
                self._stop.wait(SHORT_PAUSE_S)

    def _request(self, length: int) -> str:
        with self._lock:
            seed = next(self._seeds)
        prompt = random.Random(seed).choices(range(1000, 40000), k=length)  # no two share a prefix
        try:
            reply = self._client.completions.create(model=MODEL, prompt=prompt, max_tokens=OUTPUT_TOKENS,
                                                    temperature=0, extra_body={"ignore_eos": True})
        except openai.APIStatusError as exc:
            return "rejected" if exc.status_code in (429, 503) else f"HTTP {exc.status_code}: {exc.message}"
        except openai.APIError as exc:
            return f"{type(exc).__name__}: {exc}"
        return "completed" if reply.usage.completion_tokens == OUTPUT_TOKENS else f"short reply: {reply.usage}"


class Timeline:
    """The controller's and the link's metrics every half second, for the failure messages."""

    SERIES = {"threshold": "prfaas_scheduler_threshold_tokens", "util": "prfaas_scheduler_link_utilization_ratio",
              "congested": "prfaas_scheduler_link_congested", "rtt_s": "prfaas_kv_link_rtt_seconds",
              "retrans": "prfaas_kv_link_retransmits", "prfaas": 'prfaas_router_routed_requests_total{path="prfaas"}',
              "local": 'prfaas_router_routed_requests_total{path="local"}'}

    def __init__(self, deployment: Deployment) -> None:
        self._deployment = deployment
        self._start = time.monotonic()
        self.rows: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def mark(self, event: str) -> None:
        self.rows.append(f"{time.monotonic() - self._start:6.1f} --- {event}")

    def close(self) -> str:
        self._stop.set()
        self._thread.join()
        return "\n".join(self.rows)

    def _run(self) -> None:
        while not self._stop.wait(0.5):
            try:
                text = self._deployment.metrics_text()
            except OSError as exc:
                self.rows.append(f"{time.monotonic() - self._start:6.1f} /metrics: {exc}")
                continue
            values = []
            for name, series in self.SERIES.items():
                match = re.search(rf"^{re.escape(series)}(?:\{{[^}}]*\}})? (\S+)$", text, re.MULTILINE)
                values.append(f"{name}={float(match.group(1)):.3g}" if match else f"{name}=-")
            self.rows.append(f"{time.monotonic() - self._start:6.1f} {' '.join(values)}")


def threshold(cluster: Deployment) -> float:
    return cluster.metric("prfaas_scheduler_threshold_tokens")


def routed(cluster: Deployment) -> tuple[float, float]:
    return cluster.routed("prfaas"), cluster.routed("local")


def offloaded_fraction(cluster: Deployment, seconds: float) -> float:
    """Share of the routing decisions in the next ``seconds`` that went to the PrfaaS cluster."""
    before = routed(cluster)
    time.sleep(seconds)
    prfaas, local = (after - b for after, b in zip(routed(cluster), before))
    return prfaas / max(prfaas + local, 1)


def sample(text: str, series: str) -> float:
    match = re.search(rf"^{re.escape(series)} (\S+)$", text, re.MULTILINE)
    return float(match.group(1)) if match else 0.0


def long_decisions(cluster: Deployment, text: str | None = None) -> dict[str, float]:
    """Routing decisions so far for prompts above ``LONG_BUCKET`` uncached tokens, by path (from one
    read of /metrics: the count and the bucket must be of the same moment)."""
    text = cluster.metrics_text() if text is None else text
    histogram = "prfaas_scheduler_decision_prompt_tokens"
    return {path: sample(text, f'{histogram}_count{{path="{path}"}}')
            - sample(text, f'{histogram}_bucket{{le="{LONG_BUCKET}.0",path="{path}"}}')
            for path in ("prfaas", "local", "pd")}


def offloaded_long_fraction_while_raised(cluster: Deployment, timeline: "Timeline") -> tuple[float, int]:
    """Share of the long-prompt decisions that went to PrfaaS while the threshold stayed raised above
    the long prompts' length, and how many there were, counted until ``LONG_DECISIONS`` of them (or
    ``PHASE_S``).

    On a link that stays squeezed the controller lowers t after its hold time, probes the link with
    the next long prompt and raises t again; how many decisions fall in a fixed window, and on which
    side of a probe, depends on how long the long requests take on this machine. So the decisions are
    read every ``POLL_S`` with the threshold from the same read, and only those made between two reads
    that both saw t at or above ``LONG`` are counted. Lowering t takes several steps once the link has
    drained (2048, 1024, 512, then the base): a long prompt routed at t = 512 is the next probe, not
    a decision of the raised threshold, though 512 is above the base (on a host where a long request
    took ~8 s, two of the four decisions counted were such probes)."""
    raised: Counter = Counter()
    previous = cluster.metrics_text()
    deadline = time.monotonic() + PHASE_S
    while sum(raised.values()) < LONG_DECISIONS and time.monotonic() < deadline:
        time.sleep(POLL_S)
        current = cluster.metrics_text()
        thresholds = [sample(t, "prfaas_scheduler_threshold_tokens") for t in (previous, current)]
        if min(thresholds) >= LONG:  # the router offloads a prompt of more than t uncached tokens
            before, after = long_decisions(cluster, previous), long_decisions(cluster, current)
            raised.update({path: after[path] - before[path] for path in after})
        previous = current
    timeline.mark(f"long-prompt decisions while t was raised {dict(raised)}")
    total = int(sum(raised.values()))
    return raised["prfaas"] / max(total, 1), total


def offloaded_long_fraction(cluster: Deployment, timeline: "Timeline") -> float:
    """Share of the next ``LONG_DECISIONS`` decisions for long prompts (those made when ``PHASE_S``
    runs out, if fewer) that went to PrfaaS."""
    before = long_decisions(cluster)

    def since() -> dict[str, float]:
        return {path: n - before[path] for path, n in long_decisions(cluster).items()}

    wait_until(lambda: sum(since().values()) >= LONG_DECISIONS, PHASE_S)
    counts = since()
    timeline.mark(f"long-prompt decisions {counts}")
    return counts["prfaas"] / max(sum(counts.values()), 1)


def assert_none_lost(load: Load, timeline: Timeline) -> None:
    assert not load.lost, f"lost requests: {load.lost}\n{timeline.close()}"
    assert load.outcomes["completed"] > 0


def test_link_telemetry_flows_while_the_kv_is_on_the_wire_and_the_prefill_engine_idles(cluster, link):
    """One long prompt on a squeezed link, nothing else: its prefill takes a fraction of a second,
    its KV seconds on the wire, during which the prefill engine takes no step. The worker's link
    figures must move during the transfer (they once rode on engine steps only, so a slow link went
    unreported until the next prompt)."""
    assert wait_until(lambda: threshold(cluster) == BASE_THRESHOLD, REACT_S)  # offloading (not stopped at start)
    link.set_rate(DEGRADED_MBIT, side="ns")
    try:
        client = openai.OpenAI(base_url=cluster.base_url + "/v1", api_key="none", max_retries=0,
                               timeout=REQUEST_TIMEOUT_S)
        prompt = random.Random(-1).choices(range(1000, 40000), k=LONG)
        offloaded_before = cluster.routed("prfaas")
        readings: list[int] = []
        with ThreadPoolExecutor(1) as executor:
            reply = executor.submit(client.completions.create, model=MODEL, prompt=prompt, max_tokens=OUTPUT_TOKENS,
                                    temperature=0, extra_body={"ignore_eos": True})
            while not reply.done():
                readings.append(sum(k.bytes_sent for k in cluster.worker_stats("prefill-0").kv_links))
                time.sleep(0.2)
            assert reply.result().usage.completion_tokens == OUTPUT_TOKENS
        assert cluster.routed("prfaas") == offloaded_before + 1
        rises = sum(later > earlier for earlier, later in zip(readings, readings[1:]))
        # ~14 MB at 30 Mbit/s: ~4 s on the wire, read every 0.2 s; the connector publishes every 0.25 s
        assert rises >= 5, f"the sent-bytes figure rose {rises} times in {len(readings)} readings: {readings}"
    finally:
        link.set_rate(NOMINAL_MBIT, side="ns")  # the next test starts on the nominal link


def test_a_squeezed_link_raises_the_threshold_and_a_restored_one_lowers_it(cluster, link):
    timeline = Timeline(cluster)
    # The nominal phase starts with the controller at rest: a squeezed link before (the test above)
    # holds the threshold raised for a while after the cap is lifted.
    assert wait_until(lambda: threshold(cluster) == BASE_THRESHOLD, REACT_S), timeline.close()
    with Load(cluster.base_url, seed=1) as load:
        assert wait_until(lambda: cluster.routed("prfaas") >= 2, REACT_S), timeline.close()
        nominal = offloaded_long_fraction(cluster, timeline)
        timeline.mark(f"nominal link: offloaded fraction {nominal:.2f}; capping at {DEGRADED_MBIT} Mbit/s")
        link.set_rate(DEGRADED_MBIT, side="ns")
        raised = wait_until(lambda: threshold(cluster) > BASE_THRESHOLD, REACT_S)
        timeline.mark(f"threshold raised: {raised}")
        degraded, num_degraded = offloaded_long_fraction_while_raised(cluster, timeline)
        timeline.mark(f"degraded link: offloaded fraction {degraded:.2f} of {num_degraded}; lifting the cap")
        link.set_rate(NOMINAL_MBIT, side="ns")
        time.sleep(SETTLE_S)  # the last snapshot from the degraded link may still raise t once
        lowered = wait_until(lambda: threshold(cluster) == BASE_THRESHOLD, REACT_S)
        timeline.mark(f"threshold back at the base: {lowered}")
        restored = offloaded_long_fraction(cluster, timeline)
        timeline.mark(f"restored link: offloaded fraction {restored:.2f}")
    assert_none_lost(load, timeline)
    history = timeline.close()
    assert nominal >= 0.75, history
    assert raised and num_degraded >= 2 and degraded <= nominal / 2, history
    assert lowered and restored >= 0.5 and restored >= 1.5 * degraded, history


def num_dropped_transfers(cluster: Deployment) -> int:
    return cluster.child("local-0").log_path.read_text(errors="replace").count("KV transfer dropped")


def test_a_cut_link_stops_offloading_without_losing_requests(cluster, link):
    timeline = Timeline(cluster)
    dropped_before = num_dropped_transfers(cluster)
    with Load(cluster.base_url, seed=100_000) as load:
        assert wait_until(lambda: cluster.worker_stats("prefill-0").num_active_requests > 0, REACT_S), \
            timeline.close()
        link.set_up(False)
        timeline.mark("link down with a request on the PrfaaS prefill worker")
        stopped = wait_until(lambda: cluster.metric('prfaas_scheduler_controller_state{state="stopped"}') == 1,
                             REACT_S)
        timeline.mark(f"offloading stopped: {stopped}")
        offloaded_while_down = offloaded_fraction(cluster, WINDOW_S)
        link.set_up(True)
        timeline.mark(f"link up; offloaded fraction while down {offloaded_while_down:.2f}")
        resumed = wait_until(lambda: cluster.metric('prfaas_scheduler_controller_state{state="stopped"}') == 0,
                             REACT_S)
        before = cluster.routed("prfaas")
        resumed = resumed and wait_until(lambda: cluster.routed("prfaas") > before, REACT_S)
        timeline.mark(f"offloading resumed: {resumed}")
    assert_none_lost(load, timeline)
    history = timeline.close()
    assert stopped and offloaded_while_down == 0, history
    # The request cut off mid-transfer finished on the local worker, which prefilled it itself.
    assert num_dropped_transfers(cluster) > dropped_before, history
    assert resumed, history
