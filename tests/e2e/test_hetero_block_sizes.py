"""A PrfaaS prefill worker and a decode worker with different KV block sizes, end to end (issue 19).

vLLM's CPU engines: the prefill worker with blocks of one size, the decode worker with another. The
router judges the pair mappable from the announced layouts; long prompts prefill on the prefill
worker, whose KV the decode worker re-blocks as it arrives, and the answers equal a colocated
engine's token for token, with no transfer failed and no prefill repeated. Two models: SmolLM2
(attention only) and the tiny hybrid, whose Gated-DeltaNet state pages are padded to the attention
page, so that they differ in size too and their conv and temporal states are copied each on its own.
"""
from __future__ import annotations

import random
from dataclasses import dataclass

import httpx
import openai
import pytest

from services.kv_connector.layouts.from_vllm import cpu_kernel_layout
from services.kv_connector.layouts.spec import SLICEABLE_LAYOUTS, AttentionLayer, LayoutSpec
from support.baseline import colocated_greedy
from support.deployment import Deployment, deployment_config, wait_until
from support.ports import free_port
from support.prose import corpus, tokenize

pytestmark = pytest.mark.e2e

THRESHOLD = 300               # longer prompts are offloaded to prefill-0
OUTPUT_TOKENS = 16


@dataclass(frozen=True)
class Setup:
    model: str
    prefill_block: int
    decode_block: int
    budget: int                   # max_num_batched_tokens of every engine here and of the references
    lengths: tuple[int, ...]      # N-1 a multiple of the budget: the references chunk as prefill-0 does

    def model_path(self) -> str:
        from services.models import smollm2, tiny_hybrid

        return str((smollm2 if self.model == smollm2.NAME else tiny_hybrid).prepare())

    def prompt(self, length: int) -> list[int]:
        if self.model == "smollm2-135m-instruct":
            text, header = corpus(), tokenize(f"Document {length}:\n")
            start = (length * 7919) % (len(text) - length)
            return (header + text[start:start + length])[:length]
        rng = random.Random(length)  # the tiny hybrid is randomly initialised: any tokens will do
        return [rng.randrange(3, 1024) for _ in range(length)]


SETUPS = {
    "dense-64-to-128": Setup("smollm2-135m-instruct", 64, 128, 128, (385, 513)),
    # vLLM raises the hybrid's attention block to 256 so that a page holds a GDN state
    "hybrid-256-to-512": Setup("tiny-qwen3-next", 256, 512, 512, (513, 1025)),
}


@pytest.fixture(scope="module", params=list(SETUPS), ids=list(SETUPS))
def setup(request) -> Setup:
    return SETUPS[request.param]


@pytest.fixture(scope="module")
def cluster(setup, tmp_path_factory):
    """One deployment per setup, stopped before the next one starts."""
    workers = []
    for name, service, block, cpu in (("prefill-0", "prefill_worker", setup.prefill_block, 0),
                                      ("decode-0", "decode_worker", setup.decode_block, 1)):
        worker = {"name": name, "service": service, "engine": {"max_num_batched_tokens": setup.budget,
                                                                "block_size": block},
                  "env": {"VLLM_CPU_OMP_THREADS_BIND": str(cpu)}}
        if service == "prefill_worker":
            worker["cluster"] = "prfaas"
        else:
            worker.update(role="both", kv_port=free_port())
        workers.append(worker)
    config = deployment_config(workers, model_path=f"builtin:{setup.model}", model_name=setup.model,
                               scheduler={"offload_threshold_tokens": THRESHOLD},
                               transport={"secret": "e2e-blocks-secret"})
    deployment = Deployment(config, tmp_path_factory.mktemp(f"blocks-{setup.prefill_block}-{setup.decode_block}"))
    yield deployment.start()
    deployment.stop()


@pytest.fixture(scope="module")
def expected(setup):
    """Each prompt with the answer of a colocated engine; engines with either block size agree on it
    (attention sums over blocks in another order, which could flip a near-tie; these prompts have none)."""
    prompts = [setup.prompt(n) for n in setup.lengths]
    budgets = [setup.budget] * len(prompts)
    texts = [colocated_greedy(setup.model_path(), prompts, budgets, OUTPUT_TOKENS, block_size=size)
             for size in (setup.prefill_block, setup.decode_block)]
    assert texts[0] == texts[1], "the reference engines' answers depend on the block size"
    assert all(texts[1]), "the reference generated empty texts: choose other prompts"
    return list(zip(prompts, texts[1]))


def test_the_router_maps_the_pair(setup, cluster):
    def pairs() -> list[dict]:
        return httpx.get(cluster.base_url + "/health", timeout=10).json()["layouts"]

    assert wait_until(lambda: len(pairs()) == 1, 30)
    assert pairs() == [{"prefill": "prefill-0", "decode": "decode-0", "verdict": "mappable", "reason": ""}], \
        f"the pair must map on every x86 host vLLM's CPU build runs on: {pairs()}"
    assert cluster.metric("prfaas_router_layout_unmappable_pairs") == 0
    prefill, decode = (LayoutSpec.from_bytes(cluster.worker_stats(name).layout_spec)
                       for name in ("prefill-0", "decode-0"))
    assert set(prefill.block_sizes) == {setup.prefill_block} and set(decode.block_sizes) == {setup.decode_block}
    # the layout of the kernel vLLM picks on this host (cpu-amx on hosts with AMX for bfloat16, else
    # cpu-k-transposed), one the connector maps
    for spec in (prefill, decode):
        attention = next(layer for layer in spec.layers if isinstance(layer, AttentionLayer))
        kernel = cpu_kernel_layout(spec.dtype, spec.block_sizes[attention.group], attention.head_size)
        assert spec.cache_layout == kernel and kernel in SLICEABLE_LAYOUTS, (spec.cache_layout, kernel)


def test_long_prompts_prefill_remotely_and_decode_right(setup, cluster, expected):
    before = cluster.routed("prfaas")
    with openai.OpenAI(base_url=cluster.base_url + "/v1", api_key="none", max_retries=0, timeout=300) as client:
        for prompt, text in expected:
            reply = client.completions.create(model=setup.model, prompt=prompt, max_tokens=OUTPUT_TOKENS,
                                              temperature=0, extra_body={"ignore_eos": True})
            assert reply.usage.prompt_tokens == len(prompt) > THRESHOLD
            assert reply.choices[0].text == text, f"prompt of {len(prompt)} tokens differs from the reference"
            # the decode worker received all but the last token's KV and computed only that one
            assert reply.usage.prompt_tokens_details.cached_tokens == len(prompt) - 1
    assert cluster.routed("prfaas") - before == len(expected)
    assert cluster.metric("prfaas_router_prefill_fallbacks_total") == 0
    log = cluster.child("decode-0").log_tail(100_000)
    assert "KV layout mismatch" not in log and "KV transfer dropped" not in log
