"""What the fp8 wire codec (`transport.codec: fp8`) costs in output quality, measured on the PrfaaS
path: a prefill worker computes a prompt's KV and streams it over the KV transport to a decode worker,
which generates 32 tokens greedily and reports the top-20 log probabilities at each position.

Per model (the embedded SmolLM2-135M-Instruct on English prose, the tiny random-weight Qwen3-Next on
random tokens) and per codec, one deployment (tests/support/deployment.py; ``transport.codec`` is a
deployment's) of one decode worker (CPU 1) and a prefill worker per variant (CPU 0; ``anchor`` on
CPU 1 beside the decode worker), all with the same engine settings: one request at a time
(``max_num_seqs`` 1) and a chunk budget of 2,048 tokens, so every prompt is prefilled in one chunk and
decoded alone, whichever variant (VLLM_HYBRID_FACTS.md: batches and chunk boundaries change bfloat16
results):

- ``none``: a prefill worker of the local cluster, which sends raw (each deployment's reference);
- ``fp8``: a PrfaaS prefill worker: e4m3 values, one scale per row (one channel of a block's K, or a
  few tokens of its V: ``kv_connector.codecs.coding_of``);
- ``anchor`` (in the fp8 deployment): a PrfaaS prefill worker with one scale per frame
  (``PRFAAS_CODEC_SCALE_PER_TENSOR``), what an FP8 KV cache with one static scale per tensor does;
- ``int8`` (a deployment of its own): signed 8-bit values in uniform steps of each row's scale.

Every prompt (64 per model, 1,024 to 1,536 tokens) goes through each variant: the decode worker's
Generate (``kv_source``) waits for the KV, the sender's Prefill (``kv_target``) streams it. A reply
whose prompt was not received (a fallback to local prefill) fails the run.

Figures, each variant against ``none`` on the same prompt:
- identical: the share of prompts whose 32 tokens are all ``none``'s;
- first divergence: the index (0-31) of the first token that differs, 32 when none does; the mean
  over all prompts;
- KL: KL(P_none || P_variant) of the next-token distribution, at each position up to and including
  the first divergence of any variant on that prompt (after it the runs continue from different
  tokens, so their distributions no longer measure the codec; the same positions for every variant,
  so one that diverges later is not judged on more, later positions). Each distribution is known
  only on its top 20 tokens: the KL is taken over ``none``'s top 20 plus one bucket for the rest of
  the vocabulary; a token of that top 20 that is not in the variant's own top 20 gets the variant's
  20th probability (an upper bound), the variant's tail bucket what is left of 1. Merging the tail
  can only lower a KL, so this reads low by the tail's share of it. Mean and p95 are over all
  compared positions of all prompts.

A control row compares the int8 deployment's ``none`` with the fp8 deployment's: two raw runs in
separate processes, which should agree on every token (the figures above are then the codecs' alone).

Targets, per codec: its mean KL at most the anchor's on both models, and >= 90% of SmolLM2's prompts
identical. The last line gives them for the better codec; exit status 0 only when that one meets both.

    python bench/wire_codec_quality.py
"""
from __future__ import annotations

import math
import random
import sys
import tempfile
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import _common  # noqa: F401  (puts the project and tests/ on sys.path)
from _common import free_port
from prfaas.v1 import worker_pb2 as pb
from prfaas.v1 import worker_pb2_grpc as pb_grpc

from services.engine.args import SCALE_PER_TENSOR_ENV
from support.deployment import Deployment, deployment_config

MODELS = ("smollm2-135m-instruct", "tiny-qwen3-next")
# per deployment (``transport.codec`` is the deployment's): the variants its prefill workers send
DEPLOYMENTS = {"fp8": ("none", "fp8", "anchor"), "int8": ("none", "int8")}
NUM_PROMPTS = 64
LENGTHS = (1024, 1536)  # prompt tokens
OUTPUT_TOKENS = 32
TOP = 20  # the worker API's most
BUDGET = 2048  # max_num_batched_tokens everywhere: each prompt is one chunk on every worker
IN_FLIGHT = 4  # requests at once; each engine still runs one at a time (max_num_seqs 1)
TARGET_IDENTICAL = 0.90
_TINY = 1e-12


@dataclass(frozen=True)
class Reply:
    token_ids: tuple[int, ...]
    tops: tuple[dict[int, float], ...]  # per position: token id -> log probability (top TOP)


@dataclass(frozen=True)
class Figures:
    identical: float
    kl_mean: float
    kl_p95: float
    first_divergence: float
    positions: int


def _deployment(model: str, directory: Path, codec: str) -> Deployment:
    engine = {"max_num_batched_tokens": BUDGET, "enable_prefix_caching": False, "max_num_seqs": 1}
    senders = [{"name": f"send-{variant}", "service": "prefill_worker", "engine": engine,
                "cluster": "local" if variant == "none" else "prfaas",
                "env": {"VLLM_CPU_OMP_THREADS_BIND": "1" if variant == "anchor" else "0",
                        SCALE_PER_TENSOR_ENV: "1" if variant == "anchor" else "0"}}
               for variant in DEPLOYMENTS[codec]]
    decode = {"name": "decode", "service": "decode_worker", "role": "decode", "kv_port": free_port(), "engine": engine,
              "env": {"VLLM_CPU_OMP_THREADS_BIND": "1"}}
    config = deployment_config(senders + [decode], model_path=f"builtin:{model}", model_name=model,
                               transport={"codec": codec})
    return Deployment(config, directory).start()


def _prompts(model: str) -> list[list[int]]:
    rng = random.Random(35)
    lengths = [rng.randint(*LENGTHS) for _ in range(NUM_PROMPTS)]
    if model.startswith("tiny"):
        return [[rng.randrange(3, 1024) for _ in range(n)] for n in lengths]
    from support.prose import corpus

    text = corpus()
    return [text[(start := rng.randrange(len(text) - n)):start + n] for n in lengths]


def _worker(deployment: Deployment, name: str) -> dict:
    return next(w for w in deployment.config["workers"] if w["name"] == name)


def _run(deployment: Deployment, variant: str, prompt: list[int]) -> Reply:
    """``prompt`` prefilled by the variant's sender and decoded by the decode worker from its KV."""
    transfer_id = f"{variant}-{uuid.uuid4().hex[:8]}"
    decode, sender = _worker(deployment, "decode"), _worker(deployment, f"send-{variant}")
    request = pb.GenerateRequest(
        request_id=transfer_id, prompt_token_ids=prompt, kv_source=pb.KvSource(transfer_id=transfer_id),
        sampling=pb.SamplingParams(max_tokens=OUTPUT_TOKENS, temperature=0, ignore_eos=True, top_logprobs=TOP))
    with deployment.security.channel(f"127.0.0.1:{decode['port']}") as channel, ThreadPoolExecutor(1) as executor:
        replies = executor.submit(lambda: list(pb_grpc.DecodeWorkerStub(channel).Generate(request, timeout=600)))
        with deployment.security.channel(f"127.0.0.1:{sender['port']}") as prefill:
            pb_grpc.PrefillWorkerStub(prefill).Prefill(pb.PrefillRequest(
                request_id=transfer_id, prompt_token_ids=prompt, kv_target=f"127.0.0.1:{decode['kv_port']}",
                transfer_id=transfer_id), timeout=600)
        messages = replies.result()
    received = max(m.num_cached_tokens for m in messages)
    if received != len(prompt) - 1:
        raise RuntimeError(f"{variant}: the decode worker received {received} of {len(prompt) - 1} prompt tokens")
    tops = tuple(dict(zip(top.token_ids, top.logprobs)) for m in messages for top in m.top_logprobs)
    reply = Reply(tuple(t for m in messages for t in m.token_ids), tops)
    if len(reply.token_ids) != OUTPUT_TOKENS or len(reply.tops) != OUTPUT_TOKENS:
        raise RuntimeError(f"{variant}: {len(reply.token_ids)} tokens, {len(reply.tops)} logprob sets")
    return reply


def kl_on_top(reference: dict[int, float], other: dict[int, float]) -> float:
    """KL(reference || other) over ``reference``'s listed tokens plus one bucket for the rest; a token
    ``other`` does not list gets ``other``'s smallest listed probability (module docstring)."""
    floor = min(other.values())
    p = {t: math.exp(lp) for t, lp in reference.items()}
    q = {t: math.exp(other.get(t, floor)) for t in reference}
    p_tail, q_tail = max(1 - sum(p.values()), 0.0), max(1 - sum(q.values()), _TINY)
    kl = sum(p[t] * (math.log(p[t]) - math.log(max(q[t], _TINY))) for t in p if p[t] > 0)
    return max(kl + (p_tail * math.log(p_tail / q_tail) if p_tail > _TINY else 0.0), 0.0)


def first_divergence(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a))


def figures(references: list[Reply], others: list[Reply], limits: list[int]) -> Figures:
    """``others`` against ``references``; the KL at each prompt's positions ``0 .. limits[k]``."""
    divergences = [first_divergence(r.token_ids, o.token_ids) for r, o in zip(references, others)]
    kls = sorted(kl_on_top(r.tops[i], o.tops[i]) for r, o, limit in zip(references, others, limits)
                 for i in range(min(limit + 1, OUTPUT_TOKENS)))
    return Figures(identical=sum(d == OUTPUT_TOKENS for d in divergences) / len(divergences),
                   kl_mean=sum(kls) / len(kls), kl_p95=kls[min(len(kls) - 1, int(0.95 * len(kls)))],
                   first_divergence=sum(divergences) / len(divergences), positions=len(kls))


def measure(model: str, directory: Path, codec: str) -> dict[str, list[Reply]]:
    """Every variant's replies in one deployment (``DEPLOYMENTS[codec]``), ``none`` included."""
    variants = DEPLOYMENTS[codec]
    prompts = _prompts(model)
    started = time.monotonic()
    deployment = _deployment(model, directory / codec, codec)
    print(f"{model} ({codec}): deployment ready in {time.monotonic() - started:.0f} s", flush=True)
    try:
        started = time.monotonic()
        jobs = [(variant, prompt) for prompt in prompts for variant in variants]
        with ThreadPoolExecutor(IN_FLIGHT) as pool:
            replies = list(pool.map(lambda job: _run(deployment, *job), jobs))
        print(f"{model} ({codec}): {len(prompts)} prompts x {len(variants)} variants in "
              f"{time.monotonic() - started:.0f} s", flush=True)
    finally:
        deployment.stop()
    return {v: replies[i::len(variants)] for i, v in enumerate(variants)}


def compare(runs: dict[str, dict[str, list[Reply]]]) -> dict[str, Figures]:
    """Each coded variant against its own deployment's ``none``, and the second deployment's ``none``
    against the first's (the control: how often two raw runs differ). The KL of every variant is
    taken at the same positions of each prompt, up to and including the first divergence of any
    variant (a variant that diverges later would otherwise be judged on more, later positions)."""
    pairs = {variant: (runs[codec]["none"], replies) for codec, by_variant in runs.items()
             for variant, replies in by_variant.items() if variant != "none"}
    first, *rest = runs
    pairs.update({f"none ({codec} run) vs none": (runs[first]["none"], runs[codec]["none"]) for codec in rest})
    limits = [min(first_divergence(ref[k].token_ids, other[k].token_ids) for ref, other in pairs.values())
              for k in range(len(runs[first]["none"]))]
    return {name: figures(ref, other, limits) for name, (ref, other) in pairs.items()}


def table(results: dict[str, dict[str, Figures]]) -> str:
    lines = ["| model | variant | identical (32 tokens) | KL mean | KL p95 | mean first divergence | positions |",
             "|---|---|---|---|---|---|---|"]
    for model, by_variant in results.items():
        for variant, f in by_variant.items():
            lines.append(f"| {model} | {variant} | {f.identical:.1%} | {f.kl_mean:.2e} | {f.kl_p95:.2e} | "
                         f"{f.first_divergence:.1f} | {f.positions} |")
    return "\n".join(lines)


def main() -> int:
    results = {}
    with tempfile.TemporaryDirectory(prefix="prfaas-codec-quality-") as directory:
        for model in MODELS:
            results[model] = compare({codec: measure(model, Path(directory) / model, codec) for codec in DEPLOYMENTS})
    print(table(results))
    passed = {codec: all(r[codec].kl_mean <= r["anchor"].kl_mean for r in results.values())
              and results[MODELS[0]][codec].identical >= TARGET_IDENTICAL for codec in DEPLOYMENTS}
    for codec in DEPLOYMENTS:
        kls = ", ".join(f"{m} {r[codec].kl_mean:.2e} vs {r['anchor'].kl_mean:.2e}" for m, r in results.items())
        print(f"{codec}: mean KL vs the per-tensor fp8 anchor's: {kls}; SmolLM2 identical "
              f"{results[MODELS[0]][codec].identical:.1%}: {'meets' if passed[codec] else 'misses'} both targets")
    best = max(DEPLOYMENTS, key=lambda codec: (passed[codec], results[MODELS[0]][codec].identical))
    smol = results[MODELS[0]][best]
    kls = ", ".join(f"{m} {r[best].kl_mean:.2e} vs {r['anchor'].kl_mean:.2e}" for m, r in results.items())
    print(f"wire codec quality ({best}, the better codec): mean KL vs the per-tensor anchor's: {kls} (target <= "
          f"anchor); SmolLM2 prompts identical over {OUTPUT_TOKENS} tokens: {smol.identical:.1%} (target >= "
          f"{TARGET_IDENTICAL:.0%}): {'PASS' if passed[best] else 'FAIL'}")
    return 0 if passed[best] else 1


if __name__ == "__main__":
    sys.exit(main())
