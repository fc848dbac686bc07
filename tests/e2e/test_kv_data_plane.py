"""The KV data plane end to end: real vLLM engines in separate processes, KV over real TCP.

Prompts longer than the threshold prefill on a PrfaaS prefill worker, shorter ones on a local
prefill-role worker (the PD path); both stream the KV to one decode-role worker, whose greedy
outputs must equal a colocated vLLM engine's token for token. The reference engine is built as the
workers are (see support/baseline.py); prompt lengths keep its chunks equal to the producers':
``N-1`` is shorter than the budget or a multiple of it.
"""
from __future__ import annotations

import asyncio
import os
import random
import re
import socket
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
from prfaas.v1 import worker_pb2 as pb
from prfaas.v1 import worker_pb2_grpc as pb_grpc

from services.kv_transport import protocol
from support.baseline import colocated_greedy
from support.deployment import deployment_config, wait_until
from support.ports import free_port
from support.prose import corpus, tokenize

pytestmark = pytest.mark.e2e

MODEL = "smollm2-135m-instruct"
BUDGET = 128                   # max_num_batched_tokens of every engine here
THRESHOLD = 300                # longer prompts take the PrfaaS path, shorter ones the PD path
SECRET = "e2e-kv-secret"
OUTPUT_TOKENS = 32
PRFAAS_LENGTHS = (385, 513)    # N-1 = 3 and 4 budgets
PD_LENGTHS = (65, 257)         # N-1 shorter than the budget, 2 budgets
IN_FLIGHT = (385, 513) * 4     # 8 PrfaaS requests at once
KILLED_LENGTH = 1921           # long enough to kill its prefill worker mid-transfer


def _prompt(length: int, seed: int) -> list[int]:
    """``length`` tokens of English prose (random token ids make near-ties that any batch flips),
    each prompt opening with its own header so no two share a cached prefix."""
    text = corpus()
    header = tokenize(f"Document {seed}:\n")
    start = random.Random(seed).randrange(0, len(text) - length)
    return (header + text[start:start + length])[:length]


@pytest.fixture(scope="module")
def cluster(start_deployment):
    engine = {"max_num_batched_tokens": BUDGET}
    config = deployment_config(
        [{"name": "prefill-0", "service": "prefill_worker", "cluster": "prfaas", "engine": engine,
          "env": {"VLLM_CPU_OMP_THREADS_BIND": "0"}},
         {"name": "pd-p", "service": "decode_worker", "role": "prefill", "engine": engine,
          "env": {"VLLM_CPU_OMP_THREADS_BIND": "0"}},
         {"name": "pd-d", "service": "decode_worker", "role": "decode", "kv_port": free_port(),
          "engine": {**engine, "max_num_seqs": 1}, "env": {"VLLM_CPU_OMP_THREADS_BIND": "1"}}],
        scheduler={"offload_threshold_tokens": THRESHOLD},
        transport={"secret": SECRET, "recv_idle_timeout_s": 10.0},
    )
    return start_deployment(config, "kv")


def _budget(length: int) -> int:
    return min(length - 1, BUDGET)


BAD_FRAMES = ("corrupted", "oversized", "truncated")


@pytest.fixture(scope="module")
def expected():
    """Distinct prompts per test (a prompt already in the decode worker's prefix cache loads nothing)."""
    sets = {"prfaas": [_prompt(n, seed=n) for n in PRFAAS_LENGTHS],
            "pd": [_prompt(n, seed=n) for n in PD_LENGTHS],
            "in_flight": [_prompt(n, seed=100 + i) for i, n in enumerate(IN_FLIGHT)],
            "killed": [_prompt(KILLED_LENGTH, seed=KILLED_LENGTH)]}
    for k, case in enumerate(BAD_FRAMES):
        sets[case] = [_prompt(257, seed=5000 + k)]
    prompts = [p for group in sets.values() for p in group]
    from services.models import smollm2

    texts = iter(colocated_greedy(str(smollm2.prepare()), prompts, [_budget(len(p)) for p in prompts], OUTPUT_TOKENS))
    return {name: [(p, next(texts)) for p in group] for name, group in sets.items()}


def _completions(url: str, prompts: list[list[int]]) -> list[str]:
    """Greedy completions through the router, all in flight at once, with the official client."""
    async def run():
        async with openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=300) as client:
            replies = await asyncio.gather(*(client.completions.create(
                model=MODEL, prompt=p, max_tokens=OUTPUT_TOKENS, temperature=0, extra_body={"ignore_eos": True})
                for p in prompts))
        for prompt, reply in zip(prompts, replies):
            assert reply.usage.prompt_tokens == len(prompt)
            assert reply.usage.completion_tokens == OUTPUT_TOKENS
        return [reply.choices[0].text for reply in replies]

    return asyncio.run(run())


def test_streamed_kv_gives_the_colocated_engines_tokens_on_both_paths(cluster, expected):
    before = {path: cluster.routed(path) for path in ("prfaas", "pd", "local")}
    for path in ("prfaas", "pd"):
        for prompt, text in expected[path]:
            assert _completions(cluster.base_url, [prompt]) == [text], \
                f"prompt of {len(prompt)} tokens differs on the {path} path"
    assert cluster.routed("prfaas") - before["prfaas"] == len(expected["prfaas"])
    assert cluster.routed("pd") - before["pd"] == len(expected["pd"])
    assert cluster.routed("local") == before["local"] == 0


def test_eight_requests_in_flight_stream_their_kv_exactly(cluster, expected):
    pairs = expected["in_flight"]
    assert _completions(cluster.base_url, [p for p, _ in pairs]) == [t for _, t in pairs]
    assert "KV transfer dropped" not in cluster.child("pd-d").log_tail(400)
    assert cluster.metric("prfaas_router_prefill_fallbacks_total") == 0


def test_transport_telemetry_reaches_the_router_metrics(cluster):
    # An RTT is reported only while ACKs come in (kv_transport/telemetry.py, RTT_FRESH_S): read it while
    # the KV of a prompt of its own is on the link.
    with ThreadPoolExecutor(1) as executor:
        reply = executor.submit(_completions, cluster.base_url, [_prompt(PRFAAS_LENGTHS[0], seed=777)])
        rtt_seen = wait_until(lambda: any(link.rtt_ms > 0 for link in cluster.worker_stats("prefill-0").kv_links),
                              60, interval_s=0.05)
        reply.result()
    assert rtt_seen
    link = cluster.worker_stats("prefill-0").kv_links[0]
    assert link.connections >= 1 and link.bytes_sent > 0 and link.transfers_sent >= 1
    assert cluster.worker_stats("pd-d").kv_bytes_received > 0
    metrics = cluster.metrics_text()
    assert re.search(r'prfaas_kv_link_goodput_bits_per_second\{peer="[^"]+",worker="prefill-0"\} [1-9]', metrics)


def _decode_generate(deployment, transfer_id: str, prompt: list[int]):
    """A consume request straight to pd-d's gRPC API, as the router would send it."""
    worker = next(w for w in deployment.config["workers"] if w["name"] == "pd-d")
    channel = deployment.security.channel(f"127.0.0.1:{worker['port']}")
    request = pb.GenerateRequest(request_id=transfer_id, prompt_token_ids=prompt,
                                 sampling=pb.SamplingParams(max_tokens=OUTPUT_TOKENS, temperature=0, top_p=1,
                                                            ignore_eos=True),
                                 kv_source=pb.KvSource(transfer_id=transfer_id))
    return channel, pb_grpc.DecodeWorkerStub(channel).Generate(request, timeout=120)


def _kv_socket(deployment, secret: str = SECRET) -> socket.socket:
    worker = next(w for w in deployment.config["workers"] if w["name"] == "pd-d")
    sock = socket.create_connection(("127.0.0.1", worker["kv_port"]), timeout=10)
    protocol.client_handshake(sock, secret.encode())
    return sock


def _bad_frame(case: str, transfer_id: str) -> bytes:
    """One frame for ``transfer_id`` that the receiver must refuse: a flipped checksum, a length
    beyond the frame limit, or half the announced payload before the connection closes."""
    payload = os.urandom(65536)
    header = bytearray(protocol.encode_header(protocol.DATA, transfer_id, 0, 0, 0, 1, 0, payload))
    fields = list(protocol.HEADER.unpack(bytes(header[:protocol.HEADER.size])))
    if case == "corrupted":
        fields[-1] ^= 1
    elif case == "oversized":
        fields[-2] = 1 << 40
    header[:protocol.HEADER.size] = protocol.HEADER.pack(*fields)
    body = {"corrupted": payload, "oversized": b"", "truncated": payload[:len(payload) // 2]}[case]
    return bytes(header) + body


@pytest.mark.parametrize("case", BAD_FRAMES)
def test_bad_frames_make_the_request_recompute_and_the_worker_keeps_serving(cluster, expected, case):
    ((prompt, text),) = expected[case]
    transfer_id = f"bad-{case}-{uuid.uuid4().hex[:8]}"
    channel, call = _decode_generate(cluster, transfer_id, prompt)
    try:
        assert wait_until(lambda: cluster.worker_stats("pd-d").num_active_requests == 1, 30)
        time.sleep(0.5)  # the engine has allocated the request's blocks and waits for KV
        sock = _kv_socket(cluster)
        sock.sendall(_bad_frame(case, transfer_id))
        if case == "truncated":
            sock.close()
        tokens = "".join(message.text for message in call)
        sock.close()
    finally:
        channel.close()
    # A failed load recomputes the prompt locally: the same chunks as the reference, the same tokens.
    assert tokens == text
    assert re.search(rf"{transfer_id}: KV transfer dropped", cluster.child("pd-d").log_tail(400))
    assert _completions(cluster.base_url, [_prompt(385, seed=6000 + BAD_FRAMES.index(case))])


def test_an_unauthenticated_peer_is_refused_and_logged(cluster):
    with pytest.raises(protocol.HandshakeRefused):
        _kv_socket(cluster, secret="not-the-secret")
    assert wait_until(lambda: "refused KV connection" in cluster.child("pd-d").log_tail(200), 10)
    assert _completions(cluster.base_url, [_prompt(385, seed=7000)])


def test_killing_the_prefill_worker_mid_transfer_falls_back_without_leaks(cluster, expected):
    """Last in the module: it leaves the PrfaaS cluster dead."""
    ((prompt, text),) = expected["killed"]
    idle_usage = cluster.worker_stats("pd-d").kv_cache_usage
    # The router routes on its last health poll: start only once it counts prefill-0 as up.
    assert wait_until(lambda: cluster.metric('prfaas_router_worker_up{worker="prefill-0"}') == 1, 30)
    routed_before = cluster.routed("prfaas")
    result: list[str] = []
    client = threading.Thread(target=lambda: result.extend(_completions(cluster.base_url, [prompt])))
    client.start()
    # Kill a few chunks into the prefill (it takes seconds here): some layers' KV has left, not all.
    assert wait_until(lambda: cluster.worker_stats("prefill-0").num_active_requests == 1, 60, interval_s=0.02), \
        (f"the request never ran on prefill-0 (prfaas routes {routed_before} -> {cluster.routed('prfaas')}); "
         f"logs:\n{cluster.logs()}")
    time.sleep(0.5)
    cluster.kill("prefill-0")
    client.join(timeout=300)
    assert result == [text]
    assert cluster.metric("prfaas_router_prefill_fallbacks_total") == 1
    stats = lambda: cluster.worker_stats("pd-d")  # noqa: E731
    idle = lambda s: s.num_active_requests == s.num_running_requests == s.num_waiting_requests == 0  # noqa: E731
    assert wait_until(lambda: idle(stats()) and stats().kv_cache_usage <= idle_usage, 30), \
        f"pd-d did not return to idle: {stats()}"
