"""The trust boundary end to end: a deployment with mutual TLS and a bearer token on every gRPC hop
(router -> workers, workers -> cache pool, health probes) and on the KV data plane. Requests
succeed; callers without the token, with a wrong one, or with another CA's certificate are refused
and counted; no caller can make a worker or a pool dial an address of its choosing; a flood of idle
connections to a KV port costs bounded memory while a real request goes through."""
from __future__ import annotations

import json
import os
import random
import re
import resource
import signal
import socket
import threading
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path

import grpc
import openai
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prfaas.v1 import cache_pool_pb2, cache_pool_pb2_grpc
from prfaas.v1 import worker_pb2 as pb
from prfaas.v1 import worker_pb2_grpc as pb_grpc

from services.security import GrpcSecurity
from support.certs import make_node_cert
from support.deployment import Deployment, at_rest, deployment_config, wait_until
from support.ports import free_port
from support.prose import corpus, tokenize

pytestmark = pytest.mark.e2e

MODEL = "smollm2-135m-instruct"
THRESHOLD = 256
IDLE_CONNECTIONS = 1000
STALL_TIMEOUT_S = 10.0  # transport.stall_timeout_s, its default


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    directory = tmp_path_factory.mktemp("trust")
    cert = make_node_cert(directory / "pki")
    config = deployment_config(
        [{"name": "prefill-0", "service": "prefill_worker", "cluster": "prfaas", "health_port": free_port(),
          "env": {"VLLM_CPU_OMP_THREADS_BIND": "0"}},
         {"name": "decode-0", "service": "decode_worker", "role": "both", "kv_port": free_port(),
          "env": {"VLLM_CPU_OMP_THREADS_BIND": "1"}}],
        scheduler={"offload_threshold_tokens": THRESHOLD},
        transport=cert.transport(),
        cache_pools=[{"name": "pool-local", "cluster": "local", "port": free_port(), "kv_port": free_port(),
                      "metrics_port": free_port(), "health_port": free_port(), "memory_budget_gib": 0.25}],
    )
    deployment = Deployment(config, directory).start()
    deployment.cert = cert
    yield deployment
    deployment.stop()


def _address(cluster, name: str) -> str:
    entries = cluster.config["workers"] + cluster.config["cache_pools"]
    return f"127.0.0.1:{next(e for e in entries if e['name'] == name)['port']}"


def _get_stats(channel, name: str):
    if name.startswith("pool"):
        return cache_pool_pb2_grpc.CachePoolStub(channel).GetStats(cache_pool_pb2.CachePoolStatsRequest(), timeout=10)
    stub = pb_grpc.PrefillWorkerStub if name.startswith("prefill") else pb_grpc.DecodeWorkerStub
    return stub(channel).GetStats(pb.StatsRequest(), timeout=10)


def _prompt(length: int, seed: int) -> list[int]:
    """``length`` tokens of prose behind a header of their own (no shared cached prefix)."""
    text = corpus()
    start = random.Random(seed).randrange(0, len(text) - length)
    return (tokenize(f"Note {seed}:\n") + text[start:start + length])[:length]


def _complete(cluster, prompt: list[int]) -> openai.types.Completion:
    client = openai.OpenAI(base_url=cluster.base_url + "/v1", api_key="none", max_retries=0, timeout=300)
    return client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0)


def test_requests_succeed_on_both_paths_over_authenticated_hops(cluster):
    before = cluster.routed("prfaas")
    for length in (40, 600):
        reply = _complete(cluster, _prompt(length, length))
        assert reply.usage.completion_tokens == 8 and reply.choices[0].text
    assert cluster.routed("prfaas") == before + 1
    assert cluster.worker_stats("decode-0").kv_bytes_received > 0  # the KV crossed, over TLS


@pytest.mark.parametrize("name", ["prefill-0", "decode-0", "pool-local"])
def test_calls_without_the_token_are_unauthenticated_and_counted(cluster, name):
    tls = {"tls_cert": cluster.cert.cert, "tls_key": cluster.cert.key, "tls_ca": cluster.cert.ca}
    tls_only, wrong = GrpcSecurity(**tls), GrpcSecurity(token="not-the-token", **tls)
    for caller, reason in ((tls_only, "no token"), (wrong, "wrong token")):
        with caller.channel(_address(cluster, name)) as channel:
            with pytest.raises(grpc.RpcError) as error:
                _get_stats(channel, name)
            assert error.value.code() == grpc.StatusCode.UNAUTHENTICATED, reason
            status = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10).status
            assert status == health_pb2.HealthCheckResponse.SERVING  # probes need no token
    with cluster.security.channel(_address(cluster, name)) as channel:
        _get_stats(channel, name)  # the deployment's own credentials work
    for reason in ("missing_token", "wrong_token"):
        sample = f'prfaas_grpc_rejected_total{{reason="{reason}",service="{name}"}}'
        assert wait_until(lambda: _rejected(cluster, name, sample) >= 1, 10), sample  # noqa: B023 (called at once)


def _rejected(cluster, name: str, sample: str) -> float:
    if not name.startswith("pool"):
        return cluster.metric(sample)  # workers report them in their stats; the router exports them
    port = cluster.config["cache_pools"][0]["metrics_port"]
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as reply:
        match = re.search(rf"^{re.escape(sample)} (\S+)$", reply.read().decode(), re.MULTILINE)
    return float(match.group(1)) if match else 0.0


@pytest.mark.parametrize("name", ["prefill-0", "pool-local"])
def test_a_plaintext_health_port_answers_probes_and_nothing_else(cluster, name):
    """Kubernetes gRPC probes cannot do TLS: ``health_port`` serves health alone, in plaintext."""
    entry = next(e for e in cluster.config["workers"] + cluster.config["cache_pools"] if e["name"] == name)
    with grpc.insecure_channel(f"127.0.0.1:{entry['health_port']}") as channel:
        status = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10).status
        assert status == health_pb2.HealthCheckResponse.SERVING
        with pytest.raises(grpc.RpcError) as error:
            _get_stats(channel, name)
        assert error.value.code() == grpc.StatusCode.UNIMPLEMENTED


def test_a_client_certificate_of_another_ca_is_refused_at_the_handshake(cluster, tmp_path):
    theirs = make_node_cert(tmp_path, ca_name="another-ca")
    stranger = GrpcSecurity(token=cluster.security.token, tls_cert=theirs.cert, tls_key=theirs.key,
                            tls_ca=cluster.cert.ca)
    plaintext = GrpcSecurity(token=cluster.security.token)
    for caller in (stranger, plaintext):
        with caller.channel(_address(cluster, "prefill-0")) as channel:
            with pytest.raises(grpc.RpcError) as error:
                _get_stats(channel, "prefill-0")
            assert error.value.code() == grpc.StatusCode.UNAVAILABLE


class _Bait:
    """A listener that records whoever connects to it."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.sock.settimeout(0.2)
        self.address = f"127.0.0.1:{self.sock.getsockname()[1]}"
        self.connections = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except TimeoutError:
                continue
            self.connections += 1
            conn.close()

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self.sock.close()


def test_a_prefill_cannot_be_pointed_at_an_unknown_kv_target(cluster):
    bait = _Bait()
    try:
        with cluster.security.channel(_address(cluster, "prefill-0")) as channel:
            with pytest.raises(grpc.RpcError) as error:
                pb_grpc.PrefillWorkerStub(channel).Prefill(pb.PrefillRequest(
                    request_id=f"ssrf-{uuid.uuid4().hex[:6]}", prompt_token_ids=_prompt(300, 3),
                    kv_target=bait.address), timeout=60)
        assert error.value.code() == grpc.StatusCode.PERMISSION_DENIED and bait.address in error.value.details()
        with cluster.security.channel(_address(cluster, "pool-local")) as channel:
            with pytest.raises(grpc.RpcError) as error:
                cache_pool_pb2_grpc.CachePoolStub(channel).Push(cache_pool_pb2.PushRequest(
                    model=MODEL, kv_target=bait.address, kv_transfer_id="ssrf",
                    blocks=[cache_pool_pb2.CacheBlockRef(group_id=0, block_hash=b"h" * 32)]), timeout=10)
        assert error.value.code() == grpc.StatusCode.PERMISSION_DENIED
        sample = 'prfaas_grpc_rejected_total{reason="unknown_peer",service="prefill-0"}'
        assert wait_until(lambda: cluster.metric(sample) >= 1, 10)
        assert _rejected(cluster, "pool-local", 'prfaas_grpc_rejected_total{reason="unknown_peer",'
                                                'service="pool-local"}') == 1
    finally:
        bait.close()
    assert bait.connections == 0


def _group_rss_kib(pgid: int) -> int:
    total = 0
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if os.getpgid(int(entry.name)) != pgid:
                continue
            status = (entry / "status").read_text()
        except (OSError, ProcessLookupError):
            continue
        total += int(re.search(r"^VmRSS:\s+(\d+)", status, re.MULTILINE).group(1))
    return total


def test_idle_connections_to_a_kv_port_cost_bounded_memory_and_a_request_goes_through(cluster):
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, min(hard, 4096)), hard))
    kv_port = next(w for w in cluster.config["workers"] if w["name"] == "decode-0")["kv_port"]
    pgid = cluster.child("decode-0").process.pid
    rss_before = _group_rss_kib(pgid)
    received_before = at_rest(lambda: cluster.worker_stats("decode-0").kv_bytes_received)
    idle = []
    try:
        for _ in range(IDLE_CONNECTIONS):
            sock = socket.socket()
            sock.bind(("127.0.0.2", 0))  # another host, as far as the receiver can tell
            sock.connect(("127.0.0.1", kv_port))
            idle.append(sock)
        reply = _complete(cluster, _prompt(700, 11))  # the PrfaaS path, while the flood holds
        assert reply.usage.completion_tokens == 8
        rss_during = _group_rss_kib(pgid)
    finally:
        for sock in idle:
            sock.close()
    def stats():  # the connector's counters are published every 0.25 s
        return cluster.worker_stats("decode-0")

    assert wait_until(lambda: stats().kv_bytes_received > received_before, 5), \
        (received_before, stats().kv_bytes_received)  # streamed, not recomputed
    assert wait_until(lambda: stats().kv_connections_refused >= IDLE_CONNECTIONS - 64, 5), \
        stats().kv_connections_refused
    assert rss_during - rss_before < 64 << 10, (rss_before, rss_during)  # KiB: under 64 MiB for 1,000 sockets


def test_unauthenticated_connections_from_the_prefill_workers_own_address_leave_it_room(cluster):
    """300 idle connections to decode-0's KV port from 127.0.0.1, the prefill worker's own address,
    after a few garbage payloads: they never count against its ``max_connections_per_peer``, so a
    long prompt on the PrfaaS path answers within the fail-fast bound (issue 52)."""
    kv_port = next(w for w in cluster.config["workers"] if w["name"] == "decode-0")["kv_port"]
    routed_before = cluster.routed("prfaas")
    fallbacks_before = cluster.metric("prfaas_router_prefill_fallbacks_total")
    flood = []
    try:
        for garbage in (b"GET / HTTP/1.1\r\n\r\n", os.urandom(64), b"\x16\x03\x01" + os.urandom(200)):
            sock = socket.create_connection(("127.0.0.1", kv_port))
            sock.sendall(garbage)
            flood.append(sock)
        flood += [socket.create_connection(("127.0.0.1", kv_port)) for _ in range(300)]
        started = time.monotonic()
        reply = _complete(cluster, _prompt(540, 52))
        elapsed_s = time.monotonic() - started
    finally:
        for sock in flood:
            sock.close()
    assert reply.usage.completion_tokens == 8 and reply.choices[0].text
    assert elapsed_s < STALL_TIMEOUT_S + 20, elapsed_s  # the bound plus a local prefill, with room for 2 cores
    assert cluster.routed("prfaas") == routed_before + 1
    assert cluster.metric("prfaas_router_prefill_fallbacks_total") == fallbacks_before  # the KV crossed
    assert "(max_connections_per_peer)" not in cluster.child("decode-0").log_tail(400)


def test_a_kv_transfer_to_a_stopped_decode_worker_fails_the_prefill_within_the_bound(cluster):
    """decode-0 stopped (SIGSTOP: its KV port accepts connections, nothing reads or answers them): a
    Prefill whose KV goes there ends ABORTED within ``transport.stall_timeout_s`` of its KV leaving,
    never waiting on the dead link, and the prefill worker's link counts the failed transfer."""
    kv_port = next(w for w in cluster.config["workers"] if w["name"] == "decode-0")["kv_port"]
    failed_before = sum(link.transfers_failed for link in cluster.worker_stats("prefill-0").kv_links)
    pgid = cluster.child("decode-0").process.pid
    os.killpg(pgid, signal.SIGSTOP)
    try:
        started = time.monotonic()
        with cluster.security.channel(_address(cluster, "prefill-0")) as channel:
            with pytest.raises(grpc.RpcError) as error:
                pb_grpc.PrefillWorkerStub(channel).Prefill(pb.PrefillRequest(
                    request_id=f"dead-link-{uuid.uuid4().hex[:6]}", prompt_token_ids=_prompt(1800, 53),
                    kv_target=f"127.0.0.1:{kv_port}"), timeout=120)
        elapsed_s = time.monotonic() - started
    finally:
        os.killpg(pgid, signal.SIGCONT)
    assert error.value.code() == grpc.StatusCode.ABORTED and "KV transfer" in error.value.details(), error.value
    assert elapsed_s < STALL_TIMEOUT_S + 20, elapsed_s  # the bound, plus the prefill of 1,800 tokens on 2 cores
    assert wait_until(lambda: sum(link.transfers_failed for link in cluster.worker_stats("prefill-0").kv_links)
                      > failed_before, 5)  # what the scheduler's link signals count as a fault
    assert wait_until(lambda: cluster.metric('prfaas_router_worker_up{worker="decode-0"}') == 1, 30)


# The HTTP API: bounded bodies, validated token ids, no 5xx for any input -------------------------

def _router_pgid(cluster) -> int:
    return cluster.child("router").process.pid


def _post_raw(cluster, path: str, body: bytes, chunked: bool = False) -> tuple[int, bytes]:
    """POST ``body`` on a raw socket (stopping early if the router answers first); (status, reply)."""
    port = cluster.config["router"]["port"]
    with socket.create_connection(("127.0.0.1", port), timeout=60) as sock:
        length = "Transfer-Encoding: chunked" if chunked else f"Content-Length: {len(body)}"
        sock.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n{length}\r\n"
                     "Connection: close\r\n\r\n".encode())
        try:
            for start in range(0, len(body), 1 << 20):
                piece = body[start:start + (1 << 20)]
                sock.sendall(b"%x\r\n%s\r\n" % (len(piece), piece) if chunked else piece)
            if chunked:
                sock.sendall(b"0\r\n\r\n")
        except OSError:
            pass  # the router answered and closed before the whole body went out
        reply = b""
        try:
            while chunk := sock.recv(65536):
                reply += chunk
        except OSError:
            pass
    status = int(reply.split(b" ", 2)[1]) if reply.startswith(b"HTTP/1.1 ") else 0
    return status, reply


@pytest.mark.parametrize("chunked", [False, True])
def test_a_50_mib_body_is_413_with_bounded_memory_while_a_normal_request_completes(cluster, chunked):
    body = b'{"model": "' + MODEL.encode() + b'", "prompt": "' + b"a" * (50 << 20) + b'"}'
    rss_before = _group_rss_kib(_router_pgid(cluster))
    results = {}
    flood = threading.Thread(target=lambda: results.update(big=_post_raw(cluster, "/v1/completions", body, chunked)))
    flood.start()
    reply = _complete(cluster, _prompt(40, 5))  # at the same time
    flood.join(120)
    status, raw = results["big"]
    assert status == 413, raw[:300]
    assert b'"code": "request_too_large"' in raw and b"router.max_body_bytes" in raw
    assert reply.usage.completion_tokens == 8
    assert _group_rss_kib(_router_pgid(cluster)) - rss_before < 32 << 10  # KiB: the body was never held


def test_token_ids_outside_the_vocabulary_are_a_400(cluster):
    client = openai.OpenAI(base_url=cluster.base_url + "/v1", api_key="none", max_retries=0, timeout=60)
    with pytest.raises(openai.BadRequestError) as error:
        client.completions.create(model=MODEL, prompt=[1, 2, 10**9], max_tokens=4)
    assert "outside the model's vocabulary" in error.value.message
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt=[-1, 5], max_tokens=4)


JSON = st.recursive(st.none() | st.booleans() | st.integers(-2**64, 2**64) | st.floats() | st.text(max_size=20),
                    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
                    max_leaves=12)
FIELDS = st.fixed_dictionaries({}, optional={
    "model": st.sampled_from([MODEL, "other"]) | JSON, "prompt": JSON | st.lists(st.integers(-5, 10**6), max_size=8),
    "messages": JSON | st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "tool", "x"]) | JSON,
                                                       "content": JSON}), max_size=3),
    "max_tokens": JSON | st.integers(-3, 5), "temperature": JSON, "top_p": JSON, "stop": JSON, "stream": JSON,
    "n": JSON, "logprobs": JSON, "seed": JSON, "stream_options": JSON})


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(path=st.sampled_from(["/v1/completions", "/v1/chat/completions"]), body=FIELDS | JSON,
       raw=st.none() | st.binary(max_size=64))
def test_random_bodies_get_a_4xx_in_openai_shape_or_an_answer_never_a_5xx(cluster, path, body, raw):
    payload = raw if raw is not None else json.dumps(_bounded(body)).encode()
    request = urllib.request.Request(cluster.base_url + path, data=payload,
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=120) as reply:
            assert reply.status == 200
            return
    except urllib.error.HTTPError as error:
        status, answer = error.code, error.read()
    assert 400 <= status < 500, (status, answer[:300])
    assert set(json.loads(answer)["error"]) >= {"message", "type"}


def _bounded(body):
    """A valid request without ``max_tokens`` may generate up to the whole context (minutes here):
    give it a short one, so that a slow answer means a hang."""
    if isinstance(body, dict):
        if not any(isinstance(body.get(k), int) for k in ("max_tokens", "max_completion_tokens")):
            body["max_tokens"] = 4
        for key in ("max_tokens", "max_completion_tokens"):
            if isinstance(body.get(key), int) and not isinstance(body[key], bool):
                body[key] = min(body[key], 4)
    return body


def test_schemathesis_finds_no_server_error_or_hang(cluster):
    schema = schemathesis.openapi.from_url(cluster.base_url + "/openapi.json")
    failures = []
    for operation in schema.get_all_operations():
        strategy = operation.ok().as_strategy()

        @settings(max_examples=15, deadline=None, suppress_health_check=list(HealthCheck))
        @given(case=strategy)
        def check(case):
            _bounded(case.body)
            response = case.call(base_url=cluster.base_url, timeout=60)
            if response.status_code >= 500:
                failures.append((case.method, case.path, case.body, response.status_code, response.text[:200]))

        check()
    assert not failures, failures
