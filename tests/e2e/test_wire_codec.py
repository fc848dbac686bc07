"""The fp8 wire codec end to end (issue 35): the tiny Qwen3-Next (bfloat16 cache) prefilled on a
PrfaaS prefill worker, its attention KV coded to fp8 on the link (``transport.codec: fp8``, offered
by both ends), its linear-attention state pages raw, decoded by the decode worker into its cache.
The codec is lossy, so tokens are not held to the colocated engine's; bench/wire_codec_quality.py
measures how close they stay. Here: every request completes on the PrfaaS path without a fallback,
the link carries about half the attention bytes, and decoding stays on the model's track."""
from __future__ import annotations

import asyncio
import random

import openai
import pytest

from support.baseline import colocated_greedy
from support.deployment import deployment_config
from support.ports import free_port

pytestmark = pytest.mark.e2e

MODEL = "tiny-qwen3-next"
BUDGET = 256
OUTPUT_TOKENS = 32
LENGTHS = (257, 513, 513, 769)
ATTENTION_PAGE_BYTES, BLOCK_SIZE = 65536, 128  # one attention block (1 layer, 2 KV heads of 64, bf16)
STATE_PAGES = 3  # Gated-DeltaNet layers, one state page of at most ATTENTION_PAGE_BYTES each


@pytest.fixture(scope="module")
def cluster(start_deployment):
    engine = {"max_num_batched_tokens": BUDGET, "enable_prefix_caching": False}
    config = deployment_config(
        [{"name": "prefill-0", "service": "prefill_worker", "cluster": "prfaas", "engine": engine,
          "env": {"VLLM_CPU_OMP_THREADS_BIND": "0"}},
         {"name": "pd-d", "service": "decode_worker", "role": "decode", "kv_port": free_port(),
          "engine": {**engine, "max_num_seqs": 4}, "env": {"VLLM_CPU_OMP_THREADS_BIND": "1"}}],
        model_path=f"builtin:{MODEL}", model_name=MODEL,
        scheduler={"offload_threshold_tokens": 200}, transport={"secret": "e2e-codec", "codec": "fp8"},
    )
    return start_deployment(config, "codec")


def _prompt(length: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 1024) for _ in range(length)]


def _completions(deployment, prompts):
    async def run():
        async with openai.AsyncOpenAI(base_url=deployment.base_url + "/v1", api_key="none", max_retries=0,
                                      timeout=300) as client:
            return await asyncio.gather(*(client.completions.create(
                model=MODEL, prompt=p, max_tokens=OUTPUT_TOKENS, temperature=0, extra_body={"ignore_eos": True})
                for p in prompts))

    return asyncio.run(run())


def test_fp8_kv_crosses_the_link_at_half_the_attention_bytes_and_requests_complete(cluster):
    prompts = [_prompt(n, seed=3500 + i) for i, n in enumerate(LENGTHS)]
    replies = _completions(cluster, prompts)
    assert [r.usage.completion_tokens for r in replies] == [OUTPUT_TOKENS] * len(prompts)
    assert cluster.routed("prfaas") == len(prompts) and cluster.routed("local") == 0
    assert cluster.metric("prfaas_router_prefill_fallbacks_total") == 0
    attention_raw = sum(-(-(n - 1) // BLOCK_SIZE) * ATTENTION_PAGE_BYTES for n in LENGTHS)
    states_at_most = STATE_PAGES * ATTENTION_PAGE_BYTES * len(LENGTHS)
    sent = sum(link.bytes_sent for link in cluster.worker_stats("prefill-0").kv_links)
    assert attention_raw * 0.5 < sent < attention_raw * 0.55 + states_at_most, (sent, attention_raw)
    assert sent - 4096 * len(LENGTHS) < cluster.worker_stats("pd-d").kv_bytes_received < sent  # less the headers

    from services.models import tiny_hybrid

    texts = colocated_greedy(str(tiny_hybrid.prepare()), prompts, [min(n - 1, BUDGET) for n in LENGTHS],
                             OUTPUT_TOKENS, enable_prefix_caching=False)
    firsts = [reply.choices[0].text[:1] == text[:1] for reply, text in zip(replies, texts)]
    assert sum(firsts) >= len(prompts) - 1, firsts  # the first token, sampled from the decoded KV
