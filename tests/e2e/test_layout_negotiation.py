"""Layout negotiation end to end (issue 19, item 1): a PrfaaS prefill worker whose engine runs
another dtype than the decode worker announces a KV layout that cannot map to the decode worker's.
The router refuses the pair from the announcements alone (status, metric, log), long prompts prefill
on the decode worker and come out as a colocated engine's, and no KV ever leaves the prefill worker
(no transfer is tried and failed)."""
from __future__ import annotations

import httpx
import openai
import pytest

from services.engine.args import resolve_dtype
from support.baseline import colocated_greedy
from support.deployment import deployment_config, wait_until
from support.ports import free_port
from support.prose import corpus, tokenize

pytestmark = pytest.mark.e2e

MODEL = "smollm2-135m-instruct"
BUDGET = 128                  # max_num_batched_tokens of every engine here and of the reference
THRESHOLD = 300               # prompts longer than this would be offloaded to prefill-0
LONG_LENGTHS = (385, 513)
OUTPUT_TOKENS = 16
PAIR = '{decode="decode-0",prefill="prefill-0"}'


def _model_path() -> str:
    from services.models import smollm2

    return str(smollm2.prepare())


def _dtypes() -> tuple[str, str]:
    """The decode worker's dtype (the deployment's ``auto``, as the reference resolves it) and another
    one for the prefill worker."""
    local = resolve_dtype("auto", _model_path())
    return local, "bfloat16" if local == "float32" else "float32"


def _prompt(length: int, seed: int) -> list[int]:
    text = corpus()
    header = tokenize(f"Document {seed}:\n")
    start = (seed * 7919) % (len(text) - length)
    return (header + text[start:start + length])[:length]


@pytest.fixture(scope="module")
def cluster(start_deployment):
    engine = {"max_num_batched_tokens": BUDGET}
    config = deployment_config(
        [{"name": "prefill-0", "service": "prefill_worker", "cluster": "prfaas", "dtype": _dtypes()[1],
          "engine": engine, "env": {"VLLM_CPU_OMP_THREADS_BIND": "0"}},
         {"name": "decode-0", "service": "decode_worker", "role": "both", "kv_port": free_port(), "engine": engine,
          "env": {"VLLM_CPU_OMP_THREADS_BIND": "1"}}],
        scheduler={"offload_threshold_tokens": THRESHOLD},
        transport={"secret": "e2e-layout-secret"},
    )
    return start_deployment(config, "layouts")


@pytest.fixture(scope="module")
def expected():
    prompts = [_prompt(n, seed=n) for n in LONG_LENGTHS]
    texts = colocated_greedy(_model_path(), prompts, [BUDGET] * len(prompts), OUTPUT_TOKENS)
    return list(zip(prompts, texts))


def _layouts(cluster) -> list[dict]:
    return httpx.get(cluster.base_url + "/health", timeout=10).json()["layouts"]


def test_the_router_refuses_the_pair_from_the_announced_layouts(cluster):
    assert wait_until(lambda: any(p["verdict"] == "unmappable" for p in _layouts(cluster)), 30)
    local, other = _dtypes()
    (pair,) = _layouts(cluster)
    assert (pair["prefill"], pair["decode"], pair["verdict"]) == ("prefill-0", "decode-0", "unmappable")
    assert pair["reason"] == f"different KV dtypes: producer {other}, consumer {local}"
    assert cluster.metric("prfaas_router_layout_unmappable_pairs") == 1
    assert cluster.metric(f"prfaas_router_layout_pair_unmappable{PAIR}") == 1
    assert "KV layouts of prefill worker prefill-0 and decode worker decode-0 do not map" in \
        cluster.child("router").log_tail(100_000)
    assert cluster.worker_stats("prefill-0").layout_spec and cluster.worker_stats("decode-0").layout_spec


def test_long_prompts_prefill_locally_and_right(cluster, expected):
    assert wait_until(lambda: cluster.metric("prfaas_router_layout_unmappable_pairs") == 1, 30)
    before = {path: cluster.routed(path) for path in ("prfaas", "pd", "local")}
    with openai.OpenAI(base_url=cluster.base_url + "/v1", api_key="none", max_retries=0, timeout=300) as client:
        for prompt, text in expected:
            reply = client.completions.create(model=MODEL, prompt=prompt, max_tokens=OUTPUT_TOKENS, temperature=0,
                                              extra_body={"ignore_eos": True})
            assert reply.usage.prompt_tokens == len(prompt) > THRESHOLD
            assert reply.choices[0].text == text, f"prompt of {len(prompt)} tokens differs from the reference"
    assert cluster.routed("local") - before["local"] == len(expected)
    assert cluster.routed("prfaas") == before["prfaas"] == 0
    assert cluster.metric("prfaas_router_prefill_fallbacks_total") == 0


def test_the_prefill_worker_sent_no_kv(cluster):
    stats = cluster.worker_stats("prefill-0")
    assert list(stats.kv_links) == [] and stats.num_finished_requests == 0
    assert cluster.worker_stats("decode-0").kv_bytes_received == 0
    assert "KV layout mismatch" not in cluster.child("decode-0").log_tail(400)
