"""`prfaas up` itself, on three workers (prefill-0 for the PrfaaS cluster, decode-0 and decode-1 for
the local PD cluster): a decode worker killed under a greedy stream costs the client nothing and is
restarted while the launcher keeps serving; then SIGTERM to `prfaas up` mid-stream drains the stream
to its end, refuses new requests with 503 and Retry-After, and leaves no process of the deployment.

One deployment serves both tests, in this order (the second one stops it)."""
from __future__ import annotations

import os
import re
import signal
import time

import openai
import pytest

from services.launcher import supervisor
from support.deployment import Deployment, deployment_config, wait_until
from support.ports import free_port
from support.procs import group_alive

pytestmark = pytest.mark.e2e

MODEL = "smollm2-135m-instruct"
COUNT = "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12,"  # a confident greedy continuation (see test_worker_failure)
NUM_TOKENS = 120
BACKOFF_S = 1.0
REQUEST = {"model": MODEL, "prompt": COUNT, "max_tokens": NUM_TOKENS, "temperature": 0,
           "extra_body": {"ignore_eos": True}}


@pytest.fixture(scope="module")
def up(tmp_path_factory):
    config = deployment_config(
        [{"name": "prefill-0", "service": "prefill_worker", "cluster": "prfaas",
          "env": {"VLLM_CPU_OMP_THREADS_BIND": "0"}},
         {"name": "decode-0", "role": "both", "kv_port": free_port(), "env": {"VLLM_CPU_OMP_THREADS_BIND": "1"}},
         {"name": "decode-1", "role": "both", "kv_port": free_port(), "env": {"VLLM_CPU_OMP_THREADS_BIND": "0"}}],
        supervisor={"restart_backoff_s": BACKOFF_S})
    deployment = Deployment(config, tmp_path_factory.mktemp("up-supervision"), launcher="up").start()
    deployment.pids_seen = {}
    try:
        yield deployment
    finally:
        deployment.stop()


def _client(deployment) -> openai.OpenAI:
    return openai.OpenAI(base_url=deployment.base_url + "/v1", api_key="none", max_retries=0, timeout=120)


def _serving(deployment) -> str | None:
    return next((name for name in ("decode-0", "decode-1")
                 if deployment.worker_stats(name).num_active_requests > 0), None)


def _stream_text(deployment, on_chunk) -> str:
    chunks = []
    for chunk in _client(deployment).completions.create(**REQUEST, stream=True):
        chunks.append(chunk)
        on_chunk(len(chunks))
    return "".join(c.choices[0].text for c in chunks if c.choices)


@pytest.fixture(scope="module")
def reference(up) -> str:
    return _client(up).completions.create(**REQUEST).choices[0].text


def test_a_killed_decode_worker_costs_no_request_and_is_restarted(up, reference):
    before = up.service_pids()
    killed = {}

    def kill_the_serving_worker(num_chunks: int) -> None:
        if num_chunks == 6:
            victim = _serving(up)
            assert victim is not None, "no worker reports the request in flight"
            os.kill(before[victim], signal.SIGKILL)  # its main process only, as the OOM killer would
            killed.update(name=victim, at=time.monotonic())

    assert _stream_text(up, kill_the_serving_worker) == reference
    victim = killed["name"]
    assert wait_until(lambda: up.service_pids()[victim] != before[victim], 30, interval_s=0.1), up.logs()
    restarted_after_s = time.monotonic() - killed["at"]
    # the backoff, plus the time its leftover engine core takes to exit (at most GROUP_EXIT_S, then SIGKILL)
    assert restarted_after_s < BACKOFF_S + supervisor.GROUP_EXIT_S + 2
    assert not group_alive(before[victim]), "the killed worker's engine core outlived it"
    up_log = up.child("up").log_path.read_text()
    assert f"{victim} exited unexpectedly (killed by SIGKILL); restart 1 in {BACKOFF_S:.1f} s" in up_log
    assert up.child("up").process.poll() is None
    assert all(up.service_pids()[name] == pid for name, pid in before.items() if name != victim)
    host_port = next(("127.0.0.1", w["port"]) for w in up.config["workers"] if w["name"] == victim)
    assert wait_until(lambda: supervisor.worker_serving(*host_port, up.security), 240), up.logs()
    assert up.metric(f'prfaas_launcher_restarts_total{{service="{victim}"}}') == 1
    print(f"{victim} restarted {restarted_after_s:.1f} s after the kill (backoff {BACKOFF_S} s)")
    up.pids_seen = {**before, f"{victim} (killed)": before[victim]}


def test_sigterm_on_up_drains_the_stream_and_leaves_nothing_running(up, reference):
    pids = {**up.pids_seen, **up.service_pids()}
    refused = {}

    def stop_up_mid_stream(num_chunks: int) -> None:
        if num_chunks == 6:
            up.child("up").process.send_signal(signal.SIGTERM)
        if num_chunks == 12:  # the router drains: a new request is refused, with a time to come back
            try:
                _client(up).completions.create(model=MODEL, prompt="Hi", max_tokens=2)
            except openai.APIStatusError as exc:
                refused.update(status=exc.status_code, retry_after=exc.response.headers.get("Retry-After"))

    assert _stream_text(up, stop_up_mid_stream) == reference
    assert refused == {"status": 503, "retry_after": "5"}
    assert up.child("up").process.wait(180) == 0, up.logs()
    left = [name for name, pid in pids.items() if group_alive(pid)]
    assert not left, f"still running after `prfaas up` exited: {left}"
    log = up.child("up").log_path.read_text()
    assert re.search(r"^stopped$", log, re.MULTILINE), log[-2000:]
