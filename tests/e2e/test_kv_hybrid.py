"""The KV data plane with a hybrid model: the tiny Qwen3-Next (3 Gated-DeltaNet + 1 full-attention
layer). A producer streams the attention layer's blocks while it computes and the three
linear-attention state pages when the prefill ends; the decode worker must then generate exactly
what one colocated engine generates. Prompts longer than the threshold take the PrfaaS path
(prefill-0), shorter ones the PD path (pd-p, a local prefill-role worker). Prefix caching is off here;
with it on (vLLM keeps one state page per block-aligned position), a stream between two workers is
tested in test_cache_pool_reuse.py. Chunks are aligned as in test_kv_data_plane.py, against a
reference engine built as in support/baseline.py.
"""
from __future__ import annotations

import re

import pytest

from support.baseline import colocated_greedy
from support.completions import greedy_completions, random_prompt
from support.deployment import deployment_config
from support.ports import free_port

pytestmark = pytest.mark.e2e

MODEL = "tiny-qwen3-next"
BUDGET = 256
OUTPUT_TOKENS = 32
THRESHOLD = 300
LENGTHS = (129, 257, 513, 769)     # N-1 = 128 (shorter than the budget), then 1, 2 and 3 budgets
IN_FLIGHT = (257, 513) * 4         # 8 at once, on both paths


_prompt = random_prompt


@pytest.fixture(scope="module")
def cluster(start_deployment):
    engine = {"max_num_batched_tokens": BUDGET, "enable_prefix_caching": False}
    config = deployment_config(
        [{"name": "prefill-0", "service": "prefill_worker", "cluster": "prfaas", "engine": engine,
          "env": {"VLLM_CPU_OMP_THREADS_BIND": "0"}},
         {"name": "pd-p", "service": "decode_worker", "role": "prefill", "engine": engine,
          "env": {"VLLM_CPU_OMP_THREADS_BIND": "0"}},
         {"name": "pd-d", "service": "decode_worker", "role": "decode", "kv_port": free_port(),
          "engine": {**engine, "max_num_seqs": 1}, "env": {"VLLM_CPU_OMP_THREADS_BIND": "1"}}],
        model_path=f"builtin:{MODEL}", model_name=MODEL,
        scheduler={"offload_threshold_tokens": THRESHOLD}, transport={"secret": "e2e-hybrid"},
    )
    return start_deployment(config, "hybrid")


@pytest.fixture(scope="module")
def expected():
    prompts = [_prompt(n, seed=n) for n in LENGTHS] + [_prompt(n, seed=100 + i) for i, n in enumerate(IN_FLIGHT)]
    budgets = [min(len(p) - 1, BUDGET) for p in prompts]
    from services.models import tiny_hybrid

    texts = colocated_greedy(str(tiny_hybrid.prepare()), prompts, budgets, OUTPUT_TOKENS, enable_prefix_caching=False)
    return list(zip(prompts, texts))


def _completions(deployment, prompts):
    return [r.choices[0].text for r in greedy_completions(deployment, MODEL, prompts, OUTPUT_TOKENS)]


def test_hybrid_state_and_kv_stream_token_exact_on_both_paths(cluster, expected):
    for prompt, text in expected[:len(LENGTHS)]:
        path = "prfaas" if len(prompt) > THRESHOLD else "pd"
        assert _completions(cluster, [prompt]) == [text], f"prompt of {len(prompt)} tokens differs on the {path} path"
    assert cluster.routed("prfaas") == cluster.routed("pd") == 2 and cluster.routed("local") == 0
    assert cluster.worker_stats("pd-d").kv_bytes_received > 0


def test_hybrid_eight_in_flight(cluster, expected):
    pairs = expected[len(LENGTHS):]
    assert _completions(cluster, [p for p, _ in pairs]) == [t for _, t in pairs]
    with open(cluster.directory / "router.log") as log:
        assert not re.search(r"prefill .* failed", log.read())
