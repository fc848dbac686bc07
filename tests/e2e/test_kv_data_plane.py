"""The KV data plane end to end: real vLLM engines in separate processes, KV over real TCP.

A PrfaaS prefill worker streams every prompt's KV (threshold 0) to a decode-role worker; greedy
outputs must equal a colocated vLLM engine's token for token. Chunk boundaries change bf16
results, so the baseline prefills with the same chunks the producer used: budget
``min(N-1, BUDGET)`` with N-1 a multiple of it (see the module's prompt lengths), and with one
OpenMP thread, as each worker here has.
"""
from __future__ import annotations

import functools
import json
import os
import random
import re
import socket
import time
import urllib.request
import uuid

import grpc
import openai
import pytest
from prfaas.v1 import worker_pb2 as pb
from prfaas.v1 import worker_pb2_grpc as pb_grpc

from services.kv_transport import protocol
from support.deployment import Deployment, deployment_config, run_python, wait_until
from support.ports import free_port

pytestmark = pytest.mark.e2e

MODEL = "smollm2-135m-instruct"
BUDGET = 128                   # max_num_batched_tokens of every engine here
SECRET = "e2e-kv-secret"
OUTPUT_TOKENS = 32
LENGTHS = (65, 257, 385)       # N-1 = 64 (shorter than the budget), 2 and 3 budgets


def _prompt(length: int, seed: int) -> list[int]:
    """``length`` tokens of English prose (random token ids make near-ties that any batch flips),
    each prompt opening with its own header so no two share a cached prefix."""
    corpus = _corpus()
    header = _tokenize(f"Document {seed}:\n")
    start = random.Random(seed).randrange(0, len(corpus) - length)
    return (header + corpus[start:start + length])[:length]


def _tokenize(text: str) -> list[int]:
    from transformers import AutoTokenizer

    from services.models import smollm2

    return AutoTokenizer.from_pretrained(smollm2.prepare()).encode(text, add_special_tokens=False)


@functools.cache
def _corpus() -> list[int]:
    import argparse as a, collections as c, inspect, json as j, logging as lg, subprocess as sp, threading as th

    text = "\n\n".join(inspect.getdoc(m) or "" for m in (a, c, j, lg, sp, th, inspect))
    text += "\n\n".join(inspect.getdoc(getattr(m, name)) or "" for m in (sp, th, c) for name in dir(m)
                          if not name.startswith("_") and inspect.isclass(getattr(m, name)))
    return _tokenize(text)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    engine = {"max_num_batched_tokens": BUDGET}
    config = deployment_config(
        [{"name": "prefill-0", "service": "prefill_worker", "cluster": "prfaas", "engine": engine,
          "env": {"VLLM_CPU_OMP_THREADS_BIND": "0"}},
         {"name": "pd-d", "service": "decode_worker", "role": "decode", "kv_port": free_port(),
          "engine": {**engine, "max_num_seqs": 1}, "env": {"VLLM_CPU_OMP_THREADS_BIND": "1"}}],
        scheduler={"offload_threshold_tokens": 0},
        transport={"secret": SECRET, "recv_idle_timeout_s": 10.0},
    )
    deployment = Deployment(config, tmp_path_factory.mktemp("kv")).start()
    yield {"deployment": deployment, "prfaas_url": deployment.base_url}
    deployment.stop()


def _get(url: str) -> str | None:
    try:
        with urllib.request.urlopen(url, timeout=2) as reply:
            return reply.read().decode()
    except OSError:
        return None


def _routed(url: str, path: str) -> float:
    match = re.search(rf'prfaas_router_routed_requests_total{{path="{path}"}} (\S+)', _get(url + "/metrics") or "")
    return float(match.group(1)) if match else 0.0


def _baseline(prompts: list[list[int]], budgets: list[int]) -> list[str]:
    """Greedy text from one colocated vLLM engine per chunk budget (in-process engines)."""
    from services.models import smollm2

    code = f"""
import json
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt
prompts, budgets = {prompts!r}, {budgets!r}
params = SamplingParams(temperature=0, max_tokens={OUTPUT_TOKENS}, ignore_eos=True)
texts = [None] * len(prompts)
for budget in sorted(set(budgets)):
    llm = LLM(model={str(smollm2.prepare())!r}, max_model_len=2048, dtype="bfloat16", enforce_eager=True, seed=0,
              max_num_batched_tokens=budget, max_num_seqs=min(64, budget))
    for i, ids in enumerate(prompts):
        if budgets[i] == budget:
            texts[i] = llm.generate([TokensPrompt(prompt_token_ids=list(ids))], params, use_tqdm=False)[0].outputs[0].text
    del llm
print("RESULT" + json.dumps(texts))
"""
    # One OpenMP thread, as each worker here has (VLLM_CPU_OMP_THREADS_BIND): thread count changes bf16 sums.
    out = run_python(code, env={"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1",
                                "VLLM_CPU_OMP_THREADS_BIND": "0"})
    return json.loads(out.split("RESULT", 1)[1])


def _budget(length: int) -> int:
    return min(length - 1, BUDGET)


BAD_FRAMES = ("corrupted", "oversized")


@pytest.fixture(scope="module")
def expected():
    """Distinct prompts per test (a prompt already in the decode worker's prefix cache loads nothing)."""
    sets = {"prfaas": [_prompt(n, seed=n) for n in LENGTHS]}
    for k, case in enumerate(BAD_FRAMES):
        sets[case] = [_prompt(LENGTHS[1], seed=5000 + k)]
    prompts = [p for group in sets.values() for p in group]
    texts = iter(_baseline(prompts, [_budget(len(p)) for p in prompts]))
    return {name: [(p, next(texts)) for p in group] for name, group in sets.items()}


def test_streamed_kv_gives_the_colocated_engines_tokens(cluster, expected):
    url = cluster["prfaas_url"]
    before = _routed(url, "prfaas")
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=300)
    for prompt, text in expected["prfaas"]:
        reply = client.completions.create(model=MODEL, prompt=prompt, max_tokens=OUTPUT_TOKENS, temperature=0,
                                          extra_body={"ignore_eos": True})
        assert reply.usage.prompt_tokens == len(prompt)
        assert reply.usage.completion_tokens == OUTPUT_TOKENS
        assert reply.choices[0].text == text, f"prompt of {len(prompt)} tokens differs on the PrfaaS path"
    assert _routed(url, "prfaas") - before == len(expected["prfaas"])
    assert _routed(url, "local") == 0


def test_transport_telemetry_reaches_the_router_metrics(cluster):
    deployment = cluster["deployment"]
    assert wait_until(lambda: deployment.worker_stats("prefill-0").kv_links, 15)
    link = deployment.worker_stats("prefill-0").kv_links[0]
    assert link.connections >= 1 and link.bytes_sent > 0 and link.transfers_sent >= 1 and link.rtt_ms > 0
    assert deployment.worker_stats("pd-d").kv_bytes_received > 0
    metrics = _get(cluster["prfaas_url"] + "/metrics")
    assert re.search(r'prfaas_kv_link_goodput_bits_per_second\{peer="[^"]+",worker="prefill-0"\} [1-9]', metrics)


def _decode_generate(deployment, transfer_id: str, prompt: list[int]):
    """A consume request straight to pd-d's gRPC API, as the router would send it."""
    worker = next(w for w in deployment.config["workers"] if w["name"] == "pd-d")
    channel = grpc.insecure_channel(f"127.0.0.1:{worker['port']}")
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
    payload = os.urandom(65536)
    header = bytearray(protocol.encode_header(protocol.DATA, transfer_id, 0, 0, 0, 1, 0, payload))
    fields = list(protocol.HEADER.unpack(bytes(header[:protocol.HEADER.size])))
    if case == "corrupted":
        fields[-1] ^= 1
    elif case == "oversized":
        fields[-2] = 1 << 40
    header[:protocol.HEADER.size] = protocol.HEADER.pack(*fields)
    return bytes(header) + (payload if case != "oversized" else b"")


@pytest.mark.parametrize("case", BAD_FRAMES)
def test_bad_frames_make_the_request_recompute_and_the_worker_keeps_serving(cluster, expected, case):
    deployment = cluster["deployment"]
    ((prompt, text),) = expected[case]
    transfer_id = f"bad-{case}-{uuid.uuid4().hex[:8]}"
    channel, call = _decode_generate(deployment, transfer_id, prompt)
    try:
        time.sleep(1.0)  # the engine has allocated blocks and waits for KV
        sock = _kv_socket(deployment)
        sock.sendall(_bad_frame(case, transfer_id))
        tokens = "".join(message.text for message in call)
        sock.close()
    finally:
        channel.close()
    # A failed load recomputes the prompt locally: the same chunks as the baseline, the same tokens.
    assert tokens == text
    assert transfer_id in deployment.child("pd-d").log_tail(400)
    client = openai.OpenAI(base_url=cluster["prfaas_url"] + "/v1", api_key="none", max_retries=0, timeout=300)
    assert client.completions.create(model=MODEL, prompt=_prompt(300, seed=6000 + BAD_FRAMES.index(case)), max_tokens=4,
                                     extra_body={"ignore_eos": True}).usage.completion_tokens == 4


