"""Two routers in front of the same workers behave as one (`prfaas up --routers 2`, one shared
deployment): a prefix one router sent to a PD-P worker is known to the other, which sends the same
prefix there (the workers stream their engines' prefix caches to every router); a role flip the
deciding router (replica 0) makes at the worker is seen by the other within one stats interval; a
hand-off limit of 1 holds at the worker whatever router sends; SIGTERM to one router under load fails
no request, its own in-flight ones included.

Workers: two PD-P workers and one PD-D of 4 sequences (every request takes the PD path: prefill on a
PD-P worker, KV to the PD-D). Role flips are tuned so that 3 or more requests decoding at a poll bind
decode (sustain 0 s): the decider drains one PD-P worker and flips it to decode, once (dwell 600 s).
Tests run in file order: the prefix test needs both PD-P workers, before the flip."""
from __future__ import annotations

import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

from support.deployment import Deployment, at_rest, deployment_config, wait_until
from support.ports import free_port, free_ports
from support.procs import group_alive
from support.prose import corpus

pytestmark = pytest.mark.e2e

MODEL = "smollm2-135m-instruct"
STATS_INTERVAL_S = 0.5
PD_P = ("pd-p1", "pd-p2")
FLIPS = {"enabled": True, "sustain_s": 0, "min_dwell_s": 600, "max_drain_s": 30, "prefill_queue_low": 1,
         "prefill_queue_high": 2, "decode_utilization_high": 0.75, "decode_utilization_low": 0.5}


@pytest.fixture(scope="module")
def deployment(tmp_path_factory):
    engine = {"max_num_batched_tokens": 256}
    workers = [{"name": name, "service": "decode_worker", "role": role, "kv_port": free_port(),
                "engine": {**engine, "max_num_seqs": seqs}, "env": {"VLLM_CPU_OMP_THREADS_BIND": cpu}}
               for name, role, cpu, seqs in (("pd-p1", "prefill", "0", 16), ("pd-p2", "prefill", "1", 16),
                                             ("pd-d", "decode", "1", 4))]
    config = deployment_config(workers, router={"port": free_ports(2), "stats_interval_s": STATS_INTERVAL_S,
                                                "max_handoffs_per_prefill_worker": 1, "drain_timeout_s": 60},
                               scheduler={"role_flips": FLIPS})
    corpus()  # tokenized once, before the tests' threads need it
    deployment = Deployment(config, tmp_path_factory.mktemp("replicas"), launcher="up", routers=2).start()
    try:
        yield deployment
    finally:
        deployment.stop()


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)


def _prompt(index: int, length: int = 200) -> list[int]:
    text = corpus()
    return text[index * 7:index * 7 + length]


def _ask(url: str, index: int, max_tokens: int = 8, length: int = 200):
    return _client(url).completions.create(model=MODEL, prompt=_prompt(index, length), max_tokens=max_tokens,
                                           temperature=0, extra_body={"ignore_eos": True})


def _flipped(deployment) -> str | None:
    return next((name for name in PD_P if deployment.worker_stats(name).role == "decode"), None)


def _role_metric(deployment, url: str, worker: str, role: str) -> float:
    return deployment.metric(f'prfaas_scheduler_worker_role{{role="{role}",worker="{worker}"}}', url)


def _finished(deployment) -> dict[str, int]:
    """Requests each PD-P worker's engine finished (engine-reported: read once two readings agree)."""
    return at_rest(lambda: {name: deployment.worker_stats(name).num_finished_requests for name in PD_P},
                   interval_s=0.3)


def test_a_prefix_sent_through_one_router_is_found_by_the_other(deployment):
    """Router 0 sends a long prompt to pd-p1 (the first pick) and, while pd-p1 is busy with it, a
    second prompt to pd-p2. Router 1 never saw either; sent the second prompt's prefix, it picks pd-p2
    only if it knows what pd-p2's engine holds (without that it picks pd-p1, the first by name)."""
    first, other = deployment.base_urls
    text = corpus()
    shared = text[1000:1384]  # three 128-token blocks
    with ThreadPoolExecutor(2) as pool:
        busy = pool.submit(_client(first).completions.create, model=MODEL, prompt=text[2500:4000], max_tokens=2)
        time.sleep(0.3)
        before = {name: deployment.worker_stats(name).num_finished_requests for name in PD_P}
        pool.submit(_client(first).completions.create, model=MODEL, prompt=shared + text[100:120],
                    max_tokens=2).result()
        busy.result()
    served = {name for name, count in _finished(deployment).items() if count > before[name]}
    assert "pd-p2" in served, served
    assert wait_until(lambda: deployment.metric('prfaas_router_prefix_index_blocks{worker="pd-p2"}', other) >= 3,
                      timeout_s=5, interval_s=0.1), "router 1 never learned pd-p2's prefix cache"
    before = _finished(deployment)
    reply = _client(other).completions.create(model=MODEL, prompt=shared + text[200:220], max_tokens=2)
    after = _finished(deployment)
    assert after["pd-p2"] == before["pd-p2"] + 1 and after["pd-p1"] == before["pd-p1"], (before, after)
    assert reply.usage.prompt_tokens_details.cached_tokens > 0


def test_a_flip_made_through_one_router_is_seen_by_the_other_within_a_stats_interval(deployment):
    decider, follower = deployment.base_urls
    assert deployment.metric("prfaas_scheduler_role_decider", decider) == 1
    assert deployment.metric("prfaas_scheduler_role_decider", follower) == 0
    deadline, index, flipped = time.monotonic() + 60, 0, None
    with ThreadPoolExecutor(4) as pool:
        while flipped is None and time.monotonic() < deadline:  # decode load at the decider's polls
            list(pool.map(lambda i: _ask(decider, i, max_tokens=48), range(index, index + 4)))
            index += 4
            flipped = _flipped(deployment)
    assert flipped is not None, f"no PD-P worker was flipped to decode:\n{deployment.logs()}"
    seen_at_worker = time.monotonic()
    stats = deployment.worker_stats(flipped)
    assert (stats.role, stats.draining, stats.role_generation) == ("decode", False, 3)
    assert wait_until(lambda: _role_metric(deployment, follower, flipped, "decode") == 1,
                      timeout_s=STATS_INTERVAL_S + 1.0, interval_s=0.05), "the other router did not see the flip"
    assert time.monotonic() - seen_at_worker <= STATS_INTERVAL_S + 1.0
    assert _role_metric(deployment, decider, flipped, "decode") == 1
    flips = 'prfaas_scheduler_role_flips_total{role="decode"}'
    assert deployment.metric(flips, decider) == 1 and deployment.metric(flips, follower) == 0
    # the follower routes by the worker's role: a generation it sends goes on, nothing fails
    assert _ask(follower, 100).usage.completion_tokens == 8


def test_a_hand_off_limit_of_one_holds_across_two_routers(deployment):
    urls = deployment.base_urls
    with ThreadPoolExecutor(6) as pool:
        replies = list(pool.map(lambda i: _ask(urls[i % 2], 200 + i, max_tokens=4, length=400), range(6)))
    assert all(r.usage.completion_tokens == 4 for r in replies)
    peaks = {name: deployment.worker_stats(name).peak_handoffs for name in PD_P}
    assert max(peaks.values()) == 1, peaks  # hand-offs happened, never two at once on one worker
    assert all(deployment.worker_stats(name).max_handoffs == 1 for name in PD_P)


def test_sigterm_to_one_router_under_load_fails_no_request(deployment):
    urls = deployment.base_urls
    pid = deployment.service_pids()["router-1"]
    started = [threading.Event() for _ in range(3)]

    def stream(url: str, index: int, first: threading.Event | None = None) -> str:
        chunks = _client(url).completions.create(model=MODEL, prompt=_prompt(300 + index), max_tokens=32,
                                                 temperature=0, stream=True, extra_body={"ignore_eos": True})
        text = ""
        for chunk in chunks:
            text += "".join(c.text for c in chunk.choices)
            if first is not None:
                first.set()
        return text

    with ThreadPoolExecutor(6) as pool:
        streams = [pool.submit(stream, urls[1], i, started[i]) for i in range(3)]
        others = [pool.submit(stream, urls[0], 10 + i) for i in range(3)]
        assert all(event.wait(60) for event in started), "router-1's streams never started"
        os.kill(pid, signal.SIGTERM)
        texts = [s.result() for s in streams + others]  # raises if any failed
    assert all(texts)
    assert wait_until(lambda: not group_alive(pid), timeout_s=30), "router-1 did not exit after its drain"
    assert _ask(urls[0], 400).usage.completion_tokens == 8  # the other router serves on
    assert "router-1 stopped (drained, exit status 0); still serving: router" in \
        deployment.child("up").log_path.read_text()
