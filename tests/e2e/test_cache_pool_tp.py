"""An engine of two TP ranks storing prompt blocks in the cluster's cache pool and loading them back
(vLLM's CPU build, one worker process per rank, the pool its own process).

Each rank holds half the KV heads of every block, so each stores its share under a key of its own
(``rank_key``: the layout key and ``/tp<rank>of<size>``) and loads only its own share; the engine's
scheduler counts a prefix as usable only where both ranks' shares are in the pool. The worker runs
with vLLM's prefix caching off, so a second request for a prompt can only get its prefix from the
pool. A prompt answered once from scratch and once with its prefix loaded from the pool must give the
same greedy tokens: both runs are the same two ranks' arithmetic on the same chunks (the loaded prefix
is a multiple of the chunk budget), so only wrong KV (a rank given the other's heads, or a share
missing) changes the answer.
"""
from __future__ import annotations

import random
import uuid

import pytest
from prfaas.v1 import cache_pool_pb2, cache_pool_pb2_grpc
from prfaas.v1 import worker_pb2 as pb
from prfaas.v1 import worker_pb2_grpc as pb_grpc

from support.deployment import Deployment, deployment_config, wait_until
from support.ports import free_port, free_ports

pytestmark = pytest.mark.e2e

MODEL = "tiny-qwen3-dense"  # 2 KV heads: one per rank at TP 2
BLOCK = 128                 # the CPU backend's KV block size for this model
BUDGET = 2 * BLOCK          # chunk budget: the loadable prefix (4 blocks) is two whole chunks
OUTPUT_TOKENS = 16
TP_SIZE = 2


@pytest.fixture(scope="module")
def deployment(tmp_path_factory):
    config = deployment_config(
        [{"name": "pd-tp2", "service": "decode_worker", "role": "both", "kv_port": free_ports(TP_SIZE),
          "engine": {"max_num_batched_tokens": BUDGET, "tensor_parallel_size": TP_SIZE,
                     "enable_prefix_caching": False},
          "env": {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}}],
        model_path=f"builtin:{MODEL}", model_name=MODEL, scheduler={"cache_block_size": BLOCK})
    config["cache_pools"] = [{"name": "pool-local", "cluster": "local", "port": free_port(), "memory_budget_gib": 1.0}]
    deployment = Deployment(config, tmp_path_factory.mktemp("pool-tp2")).start()
    yield deployment
    deployment.stop()


def _generate(deployment: Deployment, prompt: list[int]) -> list[int]:
    port = deployment.config["workers"][0]["port"]
    request = pb.GenerateRequest(request_id=f"tp-pool-{uuid.uuid4().hex[:8]}", prompt_token_ids=prompt,
                                 sampling=pb.SamplingParams(max_tokens=OUTPUT_TOKENS, temperature=0, ignore_eos=True))
    with deployment.security.channel(f"127.0.0.1:{port}") as channel:
        replies = list(pb_grpc.DecodeWorkerStub(channel).Generate(request, timeout=300))
    return [token for reply in replies for token in reply.token_ids]


def _pool_blocks(deployment: Deployment) -> int:
    port = deployment.config["cache_pools"][0]["port"]
    with deployment.security.channel(f"127.0.0.1:{port}") as channel:
        stats = cache_pool_pb2_grpc.CachePoolStub(channel).GetStats(cache_pool_pb2.CachePoolStatsRequest(), timeout=5)
    return stats.memory_blocks


def test_each_rank_stores_and_loads_its_own_share_of_a_prefix(deployment):
    prompt = [random.Random(7).randrange(3, 1024) for _ in range(2 * BUDGET + 10)]
    full_blocks = len(prompt) // BLOCK  # stored by the first request (prefix caching is off)
    loadable = (len(prompt) - 1) // BLOCK * BLOCK  # at most N-1 prompt tokens are looked up

    computed = _generate(deployment, prompt)
    assert len(computed) == OUTPUT_TOKENS
    # every full block twice in the pool: once per rank's share, under two keys
    assert wait_until(lambda: _pool_blocks(deployment) >= TP_SIZE * full_blocks, 30), _pool_blocks(deployment)
    stats = deployment.worker_stats("pd-tp2")
    assert stats.kv_pool_tokens_loaded == 0 and stats.kv_pool_loads_failed == 0

    loaded = _generate(deployment, prompt)
    assert wait_until(lambda: deployment.worker_stats("pd-tp2").kv_pool_tokens_loaded == loadable, 10), \
        deployment.worker_stats("pd-tp2")
    assert deployment.worker_stats("pd-tp2").kv_pool_loads_failed == 0
    assert loaded == computed, "the answer from the pool's prefix differs from the one computed from scratch"
