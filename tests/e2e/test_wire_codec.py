"""The fp8 wire codec end to end (issue 35): the tiny Qwen3-Next (bfloat16 cache) prefilled on a
PrfaaS prefill worker, its attention KV coded to fp8 on the link (``transport.codec: fp8``, offered
by both ends), its linear-attention state pages raw, decoded by the decode worker into its cache.
The codec is lossy, so tokens are not held to the colocated engine's; bench/wire_codec_quality.py
measures how close they stay. Here: every request completes on the PrfaaS path without a fallback,
the link carries about half the attention bytes, and decoding stays on the model's track."""
from __future__ import annotations

import pytest

from support.baseline import colocated_greedy
from support.completions import greedy_completions, random_prompt
from support.deployment import at_rest, deployment_config
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
    """A PrfaaS prefill worker on CPU 0 and a decode worker on CPU 1, both offering fp8."""
    engine = {"max_num_batched_tokens": BUDGET, "enable_prefix_caching": False, "max_num_seqs": 4}
    prefill = {"name": "prefill-0", "service": "prefill_worker", "cluster": "prfaas"}
    decode = {"name": "pd-d", "service": "decode_worker", "role": "decode", "kv_port": free_port()}
    workers = [{**worker, "engine": engine, "env": {"VLLM_CPU_OMP_THREADS_BIND": cpu}}
               for worker, cpu in ((prefill, "0"), (decode, "1"))]
    transport = {"secret": "e2e-codec", "codec": "fp8"}
    return start_deployment(deployment_config(workers, model_path=f"builtin:{MODEL}", model_name=MODEL,
                                              scheduler={"offload_threshold_tokens": 200}, transport=transport),
                            "codec")


def test_fp8_kv_crosses_the_link_at_half_the_attention_bytes_and_requests_complete(cluster):
    prompts = [random_prompt(n, seed=3500 + i) for i, n in enumerate(LENGTHS)]
    replies = greedy_completions(cluster, MODEL, prompts, OUTPUT_TOKENS)
    assert [r.usage.completion_tokens for r in replies] == [OUTPUT_TOKENS] * len(prompts)
    assert cluster.routed("prfaas") == len(prompts) and cluster.routed("local") == 0
    assert cluster.metric("prfaas_router_prefill_fallbacks_total") == 0
    attention_raw = sum(-(-(n - 1) // BLOCK_SIZE) * ATTENTION_PAGE_BYTES for n in LENGTHS)
    states_at_most = STATE_PAGES * ATTENTION_PAGE_BYTES * len(LENGTHS)
    # both counters at rest: a worker publishes its connector's counters every 0.25 s, and the sender's
    # last transfer may be counted after the receiver's (one CI run read 1,093,511 sent, 1,364,032 received)
    sent, received = at_rest(lambda: (sum(link.bytes_sent for link in cluster.worker_stats("prefill-0").kv_links),
                                      cluster.worker_stats("pd-d").kv_bytes_received))
    # coded: a byte per value and a 4-byte scale per row of 128 (132/256 of bfloat16), plus frame
    # headers and each transfer's LAYOUT frame; raw it would be the whole attention_raw on top of the states
    assert attention_raw * 0.5 < sent < attention_raw * 0.6 + states_at_most, (sent, attention_raw)
    assert sent - 4096 * len(LENGTHS) < received < sent, (sent, received)  # less the headers

    from services.models import tiny_hybrid

    texts = colocated_greedy(str(tiny_hybrid.prepare()), prompts, [min(n - 1, BUDGET) for n in LENGTHS],
                             OUTPUT_TOKENS, enable_prefix_caching=False)
    firsts = [reply.choices[0].text[:1] == text[:1] for reply, text in zip(replies, texts)]
    assert sum(firsts) >= len(prompts) - 1, firsts  # the first token, sampled from the decoded KV
