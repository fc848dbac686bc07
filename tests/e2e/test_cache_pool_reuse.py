"""The cluster's cache pool reused across workers: real engines and the pool in separate processes,
started from the deployment config as `prfaas up` starts them.

Request A is prefilled on worker ``pd-a`` (a prefill-role worker, called on its own gRPC API, so the
router never sends it anything else); its connector stores A's prompt blocks, and for the hybrid
model its linear-attention states at chunk ends, in the local cluster's pool. Request B shares a
long prefix with A and goes through the router (official ``openai`` client) to ``pd-b``, the only
worker that generates. ``pd-b`` finds the prefix in the pool, loads it and prefills only the rest:
its stats count exactly the loaded prefix. B's greedy output must equal a colocated engine's
without any cache (support/baseline.py). The loaded prefix is always a multiple of the chunk budget,
so the worker's chunks equal the reference's (see VLLM_HYBRID_FACTS.md, "Testing pitfalls").
"""
from __future__ import annotations

import asyncio
import random
import uuid
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
from prfaas.v1 import cache_pool_pb2, cache_pool_pb2_grpc
from prfaas.v1 import worker_pb2 as pb
from prfaas.v1 import worker_pb2_grpc as pb_grpc

from support.baseline import colocated_greedy
from support.deployment import Deployment, at_rest, deployment_config, wait_until
from support.ports import free_port
from support.prose import corpus, tokenize

pytestmark = pytest.mark.e2e

OUTPUT_TOKENS = 32
BLOCK = 128  # the CPU backend's KV block size (SmolLM2)


def _deployment(tmp_path_factory, model_name: str, engine: dict, block_size: int):
    """The local cluster: ``pd-a`` (prefill role), ``pd-b`` (both, receives KV streams), and its
    cache pool."""
    config = deployment_config(
        [{"name": "pd-a", "service": "decode_worker", "role": "prefill", "engine": engine,
          "env": {"VLLM_CPU_OMP_THREADS_BIND": "0"}},
         {"name": "pd-b", "service": "decode_worker", "role": "both", "engine": engine, "kv_port": free_port(),
          "env": {"VLLM_CPU_OMP_THREADS_BIND": "1"}}],
        model_path=f"builtin:{model_name}", model_name=model_name,
        scheduler={"cache_block_size": block_size},
    )
    config["cache_pools"] = [{"name": "pool-local", "cluster": "local", "port": free_port(), "memory_budget_gib": 1.0}]
    return Deployment(config, tmp_path_factory.mktemp(model_name)).start()


def _start_deployment_and_reference(tmp_path_factory, model_name, engine, block_size, model_path, prompts, budget):
    """The reference engine runs while the deployment starts (both take ~30 s of mostly waiting)."""
    with ThreadPoolExecutor(1) as executor:
        texts = executor.submit(colocated_greedy, model_path, prompts, [budget] * len(prompts), OUTPUT_TOKENS,
                                enable_prefix_caching=False)
        deployment = _deployment(tmp_path_factory, model_name, engine, block_size)
        try:
            return deployment, texts.result()
        except BaseException:
            deployment.stop()
            raise


def _prefill_on_pd_a(deployment, prompt: list[int]) -> None:
    port = next(w["port"] for w in deployment.config["workers"] if w["name"] == "pd-a")
    with deployment.security.channel(f"127.0.0.1:{port}") as channel:
        pb_grpc.PrefillWorkerStub(channel).Prefill(
            pb.PrefillRequest(request_id=f"a-{uuid.uuid4().hex[:8]}", prompt_token_ids=prompt), timeout=300)


def _complete(deployment, model_name: str, prompt: list[int]) -> str:
    async def run():
        async with openai.AsyncOpenAI(base_url=deployment.base_url + "/v1", api_key="none", max_retries=0,
                                      timeout=300) as client:
            return await client.completions.create(model=model_name, prompt=prompt, max_tokens=OUTPUT_TOKENS,
                                                   temperature=0, extra_body={"ignore_eos": True})

    reply = asyncio.run(run())
    assert reply.usage.completion_tokens == OUTPUT_TOKENS
    return reply.choices[0].text


def _pool_stats(deployment) -> cache_pool_pb2.CachePoolStats:
    port = deployment.config["cache_pools"][0]["port"]
    with deployment.security.channel(f"127.0.0.1:{port}") as channel:
        return cache_pool_pb2_grpc.CachePoolStub(channel).GetStats(cache_pool_pb2.CachePoolStatsRequest(), timeout=5)


def _pool_holds(deployment, num_blocks: int) -> bool:
    return _pool_stats(deployment).memory_blocks >= num_blocks


def _loaded_by_pd_b(deployment, tokens: int) -> bool:
    return deployment.worker_stats("pd-b").kv_pool_tokens_loaded == tokens


# SmolLM2 (dense) ------------------------------------------------------------------------------

SMOL = "smollm2-135m-instruct"
SMOL_BUDGET = 512
SMOL_PREFIX = 3 * SMOL_BUDGET  # 1536 tokens: 12 blocks, three whole chunks


def _smol_prompts() -> dict[str, list[int]]:
    text = corpus()
    prefix = text[:SMOL_PREFIX]
    return {"a": prefix + text[2000:2200], "b": prefix + tokenize("\n\nQuestion: what does this describe?\n")
            + text[3000:3120]}


@pytest.fixture(scope="module")
def smol(tmp_path_factory):
    from services.models import smollm2

    prompts = _smol_prompts()
    deployment, texts = _start_deployment_and_reference(
        tmp_path_factory, SMOL, {"max_num_batched_tokens": SMOL_BUDGET}, BLOCK, str(smollm2.prepare()), [prompts["b"]],
        SMOL_BUDGET)
    yield deployment, prompts, texts[0]
    deployment.stop()


def test_a_dense_prefix_prefilled_on_one_worker_is_loaded_by_another(smol):
    deployment, prompts, expected = smol
    _prefill_on_pd_a(deployment, prompts["a"])
    assert wait_until(lambda: _pool_holds(deployment, len(prompts["a"]) // BLOCK), 30), \
        "A's blocks never reached the pool"
    assert _complete(deployment, SMOL, prompts["b"]) == expected
    assert wait_until(lambda: _loaded_by_pd_b(deployment, SMOL_PREFIX), 10), deployment.worker_stats("pd-b")
    # pd-b computed from the prefix on: it stored only its own full blocks after it
    own_tokens = len(prompts["b"]) // BLOCK * BLOCK - SMOL_PREFIX
    assert wait_until(lambda: deployment.worker_stats("pd-b").kv_pool_tokens_stored == own_tokens, 10)
    assert deployment.worker_stats("pd-b").kv_pool_loads_failed == 0


def test_a_worker_stores_the_kv_it_received_over_the_transport_in_its_pool(smol):
    """The PD path by hand: pd-a prefills a new prompt and streams its KV to pd-b, which computes only
    the last prompt token and stores the blocks it received, so a next turn there is a pool hit."""
    deployment, _, _ = smol
    prompt = corpus()[3500:3500 + 4 * BLOCK + 10]  # shares no block with A's or B's prompts
    before = at_rest(lambda: _stored_by_pd_b(deployment))
    replies = _stream_from_pd_a_to_pd_b(deployment, prompt)
    assert sum(len(r.token_ids) for r in replies) == OUTPUT_TOKENS
    assert max(r.num_cached_tokens for r in replies) == len(prompt) - 1  # received, not computed
    wanted = before + len(prompt) // BLOCK * BLOCK
    assert wait_until(lambda: _stored_by_pd_b(deployment) == wanted, 10), \
        f"pd-b stored {_stored_by_pd_b(deployment)} tokens in all, {wanted} expected ({before} before)"


def _stored_by_pd_b(deployment) -> int:
    """pd-b's stored-token count after one more engine step: the connector's counters reach a worker's
    stats only with a step, and a store's background Put may end after its request's last step."""
    port = next(w["port"] for w in deployment.config["workers"] if w["name"] == "pd-b")
    request = pb.GenerateRequest(request_id=f"step-{uuid.uuid4().hex[:8]}", prompt_token_ids=[3, 4, 5],
                                 sampling=pb.SamplingParams(max_tokens=1, temperature=0))
    with deployment.security.channel(f"127.0.0.1:{port}") as channel:
        list(pb_grpc.DecodeWorkerStub(channel).Generate(request, timeout=60))
    return deployment.worker_stats("pd-b").kv_pool_tokens_stored


def _stream_from_pd_a_to_pd_b(deployment, prompt: list[int]) -> list[pb.GenerateResponse]:
    """pd-a produces the prompt's KV (``prompt[:-1]``) and streams it to pd-b, which generates."""
    transfer_id = f"received-{uuid.uuid4().hex[:8]}"
    pd_b = next(w for w in deployment.config["workers"] if w["name"] == "pd-b")
    request = pb.GenerateRequest(request_id=transfer_id, prompt_token_ids=prompt,
                                 sampling=pb.SamplingParams(max_tokens=OUTPUT_TOKENS, temperature=0, ignore_eos=True),
                                 kv_source=pb.KvSource(transfer_id=transfer_id))
    with deployment.security.channel(f"127.0.0.1:{pd_b['port']}") as channel, ThreadPoolExecutor(1) as executor:
        replies = executor.submit(lambda: list(pb_grpc.DecodeWorkerStub(channel).Generate(request, timeout=300)))
        pd_a = next(w for w in deployment.config["workers"] if w["name"] == "pd-a")
        with deployment.security.channel(f"127.0.0.1:{pd_a['port']}") as prefill:
            pb_grpc.PrefillWorkerStub(prefill).Prefill(pb.PrefillRequest(
                request_id=transfer_id, prompt_token_ids=prompt, kv_target=f"127.0.0.1:{pd_b['kv_port']}",
                transfer_id=transfer_id), timeout=300)
        return replies.result()


# Tiny hybrid (3 Gated-DeltaNet + 1 full attention) ---------------------------------------------
# With vLLM's prefix caching on, the GDN groups run in Mamba "align" mode: one state entry per
# block position, mostly null, the running state moving to a new block every step; a state loaded
# for a prefix of n tokens must land at block position n / block - 1, where vLLM's first step reads it.

HYBRID = "tiny-qwen3-next"
HYBRID_BLOCK = 256  # vLLM raises the attention block to the GDN state's page size (either mode)
HYBRID_BUDGET = 512  # A's chunks end, and its states are stored, at 512 and 1024 only
SHORT_SUFFIX = 3


def _random_tokens(length: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 1024) for _ in range(length)]


def _hybrid_prompts() -> dict[str, list[int]]:
    base = _random_tokens(1200, seed=1)
    return {"a": base,
            # shares 1024 tokens: the blocks before it and the state at 1024 (a chunk end of A). The
            # suffix is short because the GDN gates decay: after ~100 more tokens a wrong loaded state
            # (stale or empty) no longer changes the answer, and the test could not see it.
            "on_state": base[:1024] + _random_tokens(SHORT_SUFFIX, seed=2),
            # shares 800 tokens: the blocks up to 768, but A stored no state at 768: falls back to 512
            "between_states": base[:800] + _random_tokens(150, seed=3),
            # streamed from pd-a to pd-b: 512 tokens received (one chunk of pd-a), the last computed
            "streamed": _random_tokens(HYBRID_BUDGET + 1, seed=4)}


@pytest.fixture(scope="module", params=[False, True], ids=["prefix-caching-off", "prefix-caching-on"])
def hybrid(request, tmp_path_factory):
    """Both workers with vLLM's prefix caching as the parameter says; the reference engine has none
    (a prompt computed from scratch, in the same chunks)."""
    from services.models import tiny_hybrid

    prompts = _hybrid_prompts()
    names = ("on_state", "between_states", "streamed")
    engine = {"max_num_batched_tokens": HYBRID_BUDGET, "enable_prefix_caching": request.param}
    deployment, texts = _start_deployment_and_reference(
        tmp_path_factory, HYBRID, engine, HYBRID_BLOCK, str(tiny_hybrid.prepare()), [prompts[n] for n in names],
        HYBRID_BUDGET)
    assert all(texts), "the reference generated empty texts: choose other seeds"
    yield deployment, prompts, dict(zip(names, texts))
    deployment.stop()


def test_a_hybrid_prefix_and_its_linear_states_are_loaded_by_another_worker(hybrid):
    deployment, prompts, expected = hybrid
    _prefill_on_pd_a(deployment, prompts["a"])
    # A's full blocks of the attention group, and 2 states (512, 1024) of each of the 3 GDN groups
    assert wait_until(lambda: _pool_holds(deployment, len(prompts["a"]) // HYBRID_BLOCK + 2 * 3), 30), \
        _pool_stats(deployment)
    assert _complete(deployment, HYBRID, prompts["on_state"]) == expected["on_state"]
    assert wait_until(lambda: _loaded_by_pd_b(deployment, 1024), 10), deployment.worker_stats("pd-b")
    assert _complete(deployment, HYBRID, prompts["between_states"]) == expected["between_states"]
    assert wait_until(lambda: _loaded_by_pd_b(deployment, 1024 + 512), 10), deployment.worker_stats("pd-b")
    assert deployment.worker_stats("pd-b").kv_pool_loads_failed == 0


def test_a_hybrid_prompt_streamed_between_workers_is_exact_and_stored(hybrid):
    """The KV transport's path: attention blocks and the GDN states at N-1 go from pd-a to pd-b, which
    computes the last token, answers as the reference does and stores the blocks it received."""
    deployment, prompts, expected = hybrid
    prompt = prompts["streamed"]
    before = at_rest(lambda: _stored_by_pd_b(deployment))
    replies = _stream_from_pd_a_to_pd_b(deployment, prompt)
    assert max(r.num_cached_tokens for r in replies) == len(prompt) - 1  # received, not computed
    assert "".join(r.text for r in replies) == expected["streamed"]
    wanted = before + len(prompt) // HYBRID_BLOCK * HYBRID_BLOCK
    assert wait_until(lambda: _stored_by_pd_b(deployment) == wanted, 10), \
        f"pd-b stored {_stored_by_pd_b(deployment)} tokens in all, {wanted} expected ({before} before)"
