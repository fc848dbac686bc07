"""Engines of different tensor-parallel sizes handing KV to each other, end to end (issue 19).

vLLM's CPU engines at TP 1 and TP 2 (two worker processes, one core each), for a dense model and the
tiny hybrid, whose head counts divide by 2 (SmolLM2's 3 KV heads do not). Two PD workers, one of each
TP size: one prefills a prompt (its KV, ``prompt[:-1]``) and streams it to the other, each producer
rank sending each consumer rank the KV heads, Gated-DeltaNet heads and conv-component shares it owns,
each consumer rank receiving on its own port (``kv_port + rank``). The receiving worker computes only
the last prompt token, and its greedy tokens equal a colocated engine's.

A reference at TP 1 and one at TP 2 sum in different orders, so bf16 near-ties can break either way:
only prompts on which both references agree, with every token ahead of the runner-up by at least
``MARGIN`` nats, are checked (a rank given the wrong heads, or a contiguous slice of the conv state,
answers something else).
"""
from __future__ import annotations

import random
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import httpx
import pytest
from prfaas.v1 import worker_pb2 as pb
from prfaas.v1 import worker_pb2_grpc as pb_grpc

from services.kv_connector.layout_spec import LayoutSpec
from support.baseline import greedy_token_margins
from support.deployment import Deployment, deployment_config, wait_until
from support.ports import free_port, free_ports

pytestmark = pytest.mark.e2e

OUTPUT_TOKENS = 8
BUDGET = 256                  # every engine's chunk budget; prompts of BUDGET + 1 tokens chunk alike
CANDIDATES = 16              # half for each direction: a worker that prefilled a prompt has it cached
MARGIN = 0.1
TP2_CPUS = "0|1"


@dataclass(frozen=True)
class Model:
    name: str

    def path(self) -> str:
        from services.models import tiny_dense, tiny_hybrid

        return str((tiny_dense if self.name == tiny_dense.NAME else tiny_hybrid).prepare())


MODELS = {"dense": Model("tiny-qwen3-dense"), "hybrid": Model("tiny-qwen3-next")}
WORKERS = (  # name, TP size, CPUs: PD workers (role both) that prefill for each other over the KV transport
    ("pd-tp1", 1, "1"),
    ("pd-tp2", 2, TP2_CPUS),
)
PAIRS = (("pd-tp1", "pd-tp2"), ("pd-tp2", "pd-tp1"))


def _prompts() -> list[list[int]]:
    return [[random.Random(seed).randrange(3, 1024) for _ in range(BUDGET + 1)] for seed in range(CANDIDATES)]


def _deployment(model: Model, tmp_path_factory) -> Deployment:
    workers = [{"name": name, "service": "decode_worker", "role": "both",
                "kv_port": free_ports(tp_size) if tp_size > 1 else free_port(),
                "engine": {"max_num_batched_tokens": BUDGET, "tensor_parallel_size": tp_size},
                "env": {"VLLM_CPU_OMP_THREADS_BIND": cpus}} for name, tp_size, cpus in WORKERS]
    config = deployment_config(workers, model_path=f"builtin:{model.name}", model_name=model.name,
                               transport={"secret": "e2e-tp-secret"})
    return Deployment(config, tmp_path_factory.mktemp(f"tp-{model.name}"))


@pytest.fixture(scope="module", params=list(MODELS), ids=list(MODELS))
def cluster(request, tmp_path_factory):
    """The deployment, and the prompts both references answer alike and clearly, with that answer.
    The references run while the deployment starts."""
    model = MODELS[request.param]
    prompts = _prompts()
    budgets = [BUDGET] * len(prompts)
    with ThreadPoolExecutor(1) as executor:
        references = executor.submit(lambda: [
            greedy_token_margins(model.path(), prompts, budgets, OUTPUT_TOKENS),
            greedy_token_margins(model.path(), prompts, budgets, OUTPUT_TOKENS, cpu=TP2_CPUS,
                                 tensor_parallel_size=2)])
        deployment = _deployment(model, tmp_path_factory).start()
        try:
            tp1, tp2 = references.result()
        except BaseException:
            deployment.stop()
            raise
    expected = [[(prompt, a[0]) for i, (prompt, a, b) in enumerate(zip(prompts, tp1, tp2))
                 if i % len(PAIRS) == direction and a[0] == b[0] and min(a[1], b[1]) >= MARGIN]
                for direction in range(len(PAIRS))]
    try:
        assert all(expected), f"a direction has no prompt with a clear answer at both TP sizes: {tp1} {tp2}"
        yield model, deployment, expected
    finally:
        deployment.stop()


def _stream(deployment: Deployment, prefill: str, decode: str, prompt: list[int]) -> list[pb.GenerateResponse]:
    """``prefill`` computes the KV of ``prompt[:-1]`` and streams it to ``decode``, which generates."""
    workers = {w["name"]: w for w in deployment.config["workers"]}
    tp_size = workers[decode]["engine"]["tensor_parallel_size"]
    transfer_id = f"tp-{uuid.uuid4().hex[:8]}"
    request = pb.GenerateRequest(request_id=transfer_id, prompt_token_ids=prompt,
                                 sampling=pb.SamplingParams(max_tokens=OUTPUT_TOKENS, temperature=0, ignore_eos=True),
                                 kv_source=pb.KvSource(transfer_id=transfer_id))
    with deployment.security.channel(f"127.0.0.1:{workers[decode]['port']}") as channel, \
            ThreadPoolExecutor(1) as executor:
        replies = executor.submit(lambda: list(pb_grpc.DecodeWorkerStub(channel).Generate(request, timeout=300)))
        with deployment.security.channel(f"127.0.0.1:{workers[prefill]['port']}") as prefill_channel:
            pb_grpc.PrefillWorkerStub(prefill_channel).Prefill(pb.PrefillRequest(
                request_id=transfer_id, prompt_token_ids=prompt, transfer_id=transfer_id,
                kv_target=f"127.0.0.1:{workers[decode]['kv_port']}", kv_target_tp_size=tp_size), timeout=300)
        return replies.result()


def test_the_workers_announce_their_tp_sizes_and_the_router_maps_every_pair(cluster):
    _, deployment, _ = cluster
    for name, tp_size, _ in WORKERS:
        spec = LayoutSpec.from_bytes(deployment.worker_stats(name).layout_spec)
        assert spec.tp_size == tp_size and all(layer.parts[0].num_local_units == layer.parts[0].num_units // tp_size
                                               for layer in spec.layers), spec

    def pairs() -> list[dict]:
        return httpx.get(deployment.base_url + "/health", timeout=10).json()["layouts"]

    assert wait_until(lambda: len(pairs()) == len(PAIRS), 30), pairs()
    assert {(pair["prefill"], pair["decode"], pair["verdict"]) for pair in pairs()} == \
        {(prefill, decode, "mappable") for prefill, decode in PAIRS}


@pytest.mark.parametrize("direction", range(len(PAIRS)), ids=["tp1-to-tp2", "tp2-to-tp1"])
def test_kv_streamed_between_tp_sizes_decodes_as_a_colocated_engine(cluster, direction):
    _, deployment, expected = cluster
    prefill, decode = PAIRS[direction]
    for prompt, tokens in expected[direction]:
        replies = _stream(deployment, prefill, decode, prompt)
        # received, not computed: the decode worker has never seen this prompt (each direction has its own)
        assert max(r.num_cached_tokens for r in replies) == len(prompt) - 1
        assert [t for r in replies for t in r.token_ids] == tokens
    for name in (prefill, decode):
        log = deployment.child(name).log_tail(200_000)
        assert "KV layout mismatch" not in log and "KV transfer dropped" not in log, name
