"""OpenAI API parity, the long sweep: the router against vLLM's own server on the same model.

The embedded default as `prfaas up` runs it (deploy/local.yaml on free ports: the router, prefill-0
for the PrfaaS cluster, decode-0 for the local PD cluster, SmolLM2), and `vllm serve` on the same
model with decode-0's engine settings (tests/support/reference_server.py), both started here. The
same requests go through the official `openai` client to both (tests/support/api_parity.py): every
case of issue 54 (logprobs, echo, n, best_of, penalties, logit bias, min_tokens, stop token ids, JSON
mode and schemas, structured outputs, tools, prompt lists), each also with logprobs on, on prompts
from a sentence to about 600 tokens (below and above `scheduler.offload_threshold_tokens`: the local
and the PrfaaS path), streamed and not, at two reply lengths. Greedy replies must be equal (logprobs
within the dtype's tolerance: tests/e2e/embedded/test_api_parity.py says why); sampled replies, over
several seeds, must have vLLM's shapes and be valid.

`make test` does not run this: tests/e2e/embedded/test_api_parity.py checks every case once on a
short and a long prompt against the suite's one shared deployment, with one reference server; this
sweep needs its own deployment and is slower (minutes; `--quick` runs one reply length and one seed).

Prints a row per case, then as its last line the headline: greedy parity, cases equal out of all
(target: all), with the sampled checks that passed. Exit status 0 only when every greedy case is
equal and every sampled reply passed.

    python bench/api_parity.py [--quick]
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
import tempfile
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import _common  # noqa: F401  (puts the project and tests/ on sys.path)
import httpx
import openai
from _common import verdict

from services.engine.args import resolve_dtype
from services.models import smollm2
from support import api_parity as parity
from support.deployment import Deployment
from support.embedded import API_KEY, MODEL, embedded_default_on_free_ports
from support.reference_server import ReferenceServer, configured_tool_parser

TOLERANCE = {"float32": 1e-3, "bfloat16": 0.25}[resolve_dtype("auto", smollm2.prepare())]  # the suite's: why there
REFUSED_BY_VLLM = ("n2_greedy",)
TOOL_CHOICES = ("tool_named", "tool_required", "tool_auto")


def prompts() -> dict[str, str]:
    """From one sentence (local path) to about 600 tokens (PrfaaS path)."""
    sentences = parity.LONG_TEXT.split(". ")
    return {"sentence": parity.SHORT_TEXT, "half": ". ".join(sentences[:len(sentences) // 2]) + ".",
            "long": parity.LONG_TEXT, "longer": parity.LONG_TEXT + " " + parity.LONG_TEXT[::-1].title()}


def with_logprobs(case: parity.Case) -> parity.Case | None:
    """``case`` with logprobs on as well (None where it has them, or where vLLM refuses the request)."""
    if "logprobs" in case.params or case.name in REFUSED_BY_VLLM or case.name.startswith("tool_"):
        return None
    extra = {"logprobs": True, "top_logprobs": 2} if case.api == "chat" else {"logprobs": 2}
    return dataclasses.replace(case, name=case.name + "+logprobs", params={**case.params, **extra})


def greedy_cases(quick: bool) -> list[parity.Case]:
    cases = []
    for max_tokens in (8,) if quick else (8, 32):
        for case in parity.greedy_cases(max_tokens):
            case = dataclasses.replace(case, name=f"{case.name}@{max_tokens}")
            cases += [case] + ([combined] if (combined := with_logprobs(case)) else [])
    return cases


def sampled_cases(quick: bool) -> list[parity.Case]:
    seeds = (7,) if quick else (1, 7, 42, 1234)
    return [dataclasses.replace(case, name=f"{case.name}/seed{seed}")
            for seed in seeds for case in parity.sampled_cases(16, seed)]


class Sweep:
    def __init__(self, ours: openai.OpenAI, reference: ReferenceServer, theirs: openai.OpenAI):
        self.ours, self.theirs = ours, theirs
        with httpx.Client(base_url=reference.base_url, headers={"Authorization": f"Bearer {reference.api_key}"},
                          timeout=30) as http:
            def tokenize(text: str) -> list[int]:
                body = {"model": MODEL, "prompt": text, "add_special_tokens": False}
                return http.post("/tokenize", json=body).raise_for_status().json()["tokens"]

            self.texts = prompts()
            self.ids = {name: tokenize(text) for name, text in self.texts.items()}
            self.biased = tokenize(parity.BIASED_TEXT)[0]
        self.plains = {(api, name): parity.send(theirs, parity.plain_case(api), text, stream=False)
                       for api in ("completions", "chat") for name, text in self.texts.items()}
        self.tool_parser = configured_tool_parser()

    def prompt(self, case: parity.Case, name: str):
        if case.prompt_list == "text":
            return [self.texts[name], self.texts["sentence"]]
        if case.prompt_list == "tokens":
            return [self.ids[name], self.ids["sentence"]]
        return self.texts[name]

    def greedy(self, case: parity.Case, name: str, stream: bool) -> str | None:
        """None when the router's reply equals the reference's; else the first differences."""
        case = parity.filled(case, self.plains[case.api, name], self.biased)
        prompt = self.prompt(case, name)
        with ThreadPoolExecutor(1) as pool:
            theirs = pool.submit(parity.send, self.theirs, case, prompt, stream)
            ours = parity.send(self.ours, case, prompt, stream)
            reference = theirs.result()
        base = case.name.split("@")[0]
        if base in REFUSED_BY_VLLM or (base in TOOL_CHOICES and not self.tool_parser):
            refused = reference.error and ours.error and ours.error["status"] == reference.error["status"] == 400
            return None if refused else f"vLLM: {reference.error}; router: {ours.error or 'answered'}"
        if reference.error or ours.error:
            return f"vLLM: {reference.error or 'answered'}; router: {ours.error or 'answered'}"
        found = parity.differences(ours, reference, TOLERANCE) + parity.invalid(ours, case)
        return "; ".join(found[:3]) or None

    def sampled(self, case: parity.Case, name: str, stream: bool) -> str | None:
        prompt = self.prompt(case, name)
        ours = parity.send(self.ours, case, prompt, stream)
        found = parity.problems(ours, case, [0] * (len(prompt) if case.prompt_list else 1))
        return "; ".join(found[:3]) or None


def run(sweep: Sweep, quick: bool) -> int:
    names = ("sentence", "long") if quick else tuple(sweep.texts)
    results: dict[str, Counter] = {}
    failures = []

    def record(kind: str, case: parity.Case, name: str, stream: bool, problem: str | None) -> None:
        results.setdefault(f"{kind} {case.api} {case.name}", Counter())["equal" if problem is None else "differ"] += 1
        if problem is not None:
            failures.append(f"{kind} {case.api} {case.name} {name} {'stream' if stream else 'whole'}: {problem}")

    started = time.monotonic()
    for case in greedy_cases(quick):
        for name in names:
            for stream in (False, True):
                record("greedy", case, name, stream, sweep.greedy(case, name, stream))
    for case in sampled_cases(quick):
        for name in names:
            for stream in (False, True):
                record("sampled", case, name, stream, sweep.sampled(case, name, stream))
    print(f"{'case':<58} {'equal/valid':>12} {'of':>4}")
    for key, counts in results.items():
        print(f"{key:<58} {counts['equal']:>12} {sum(counts.values()):>4}")
    for failure in failures:
        print("FAIL", failure[:400])
    greedy = [c for k, c in results.items() if k.startswith("greedy")]
    sampled = [c for k, c in results.items() if k.startswith("sampled")]
    equal, total = sum(c["equal"] for c in greedy), sum(sum(c.values()) for c in greedy)
    valid, num_sampled = sum(c["equal"] for c in sampled), sum(sum(c.values()) for c in sampled)
    detail = (f"{equal}/{total} cases equal, {valid}/{num_sampled} sampled replies valid, on "
              f"{', '.join(names)} prompts, {time.monotonic() - started:.0f} s, logprob tolerance {TOLERANCE:g}")
    status = verdict("greedy parity", equal / total if total else 0.0, 1.0, detail)
    return status if valid == num_sampled else 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="one reply length, one seed, two prompts")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="api-parity-") as directory:
        deployment = Deployment(embedded_default_on_free_ports(), Path(directory) / "prfaas", launcher="up",
                                env={"PRFAAS_API_KEYS": API_KEY})
        reference = ReferenceServer(Path(directory) / "reference")
        try:
            deployment.start()
            reference.start()
            ours = openai.OpenAI(base_url=deployment.base_url + "/v1", api_key=API_KEY, max_retries=0, timeout=300)
            theirs = openai.OpenAI(base_url=reference.base_url + "/v1", api_key=reference.api_key, max_retries=0,
                                   timeout=300)
            return run(Sweep(ours, reference, theirs), args.quick)
        finally:
            reference.stop()
            deployment.stop()


if __name__ == "__main__":
    sys.exit(main())
