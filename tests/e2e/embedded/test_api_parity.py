"""The OpenAI API as the router serves it against vLLM's own server (issue 54): the same requests,
through the official ``openai`` client, to the embedded deployment (tests/e2e/embedded/conftest.py)
and to `vllm serve` on the same model with decode-0's engine settings (support/reference_server.py),
started once for this module. Every case runs on a short prompt (prefilled by decode-0: the local
path) and on a long one (past ``scheduler.offload_threshold_tokens``: prefilled by prefill-0, its KV
streamed to decode-0: the PrfaaS path; the router's ``prfaas_router_routed_requests_total`` says
which path each request took), streamed and not.

Greedy replies must be equal: text, finish reason, tool calls, usage, token ids where returned, and
logprobs within ``TOLERANCE`` (support/api_parity.py). Sampled replies (temperature 1, a seed) are
checked for shape and validity only. A case whose parameter does not change the reference's reply
would pass against a router that ignores it: the reference's reply must differ from its reply
without the parameter. Requests vLLM refuses (n > 1 at temperature 0; tool choices without a tool
parser) must be refused by the router too. Then each parameter the router still refuses
(``services.router.openai_api.UNSUPPORTED``) must get a 400 that names it, and README's API table
must list it as refused.

The longer sweep (more prompts, seeds, longer replies) is bench/api_parity.py. Measured on the 2-core
host (shared), the whole module with the embedded deployment's start: 184 s, of which the reference
server's start about 20 s (while the PrfaaS path still answered 500 at once: more once it serves).
"""
from __future__ import annotations

import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest

from services.engine.args import resolve_dtype
from services.models import smollm2
from support import api_parity as parity
from support.embedded import API_KEY, MODEL
from support.reference_server import ReferenceServer, configured_tool_parser

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[3]
SIZES = ("short", "long")
# Both engines run the same dtype with one OpenMP thread; the local path computes exactly what the
# reference computes, but the PrfaaS path prefills on another engine and decode-0 computes the last
# prompt token alone (a GEMM of another shape: other rounding). Float32 logits then differ in the
# 6th digit: 1e-3. In bfloat16 (this host: AVX512-BF16) a logit keeps 8 significant bits, so
# logprobs move in steps of 1/16 for logits of 8-16 and 1/8 for 16-32 (the embedded model's
# largest); on the PrfaaS path the KV and the last token's logits both round their own way: up to two
# steps, 0.25 (bench/api_parity.py --quick measured 0.21 at most, over 240 greedy cases).
TOLERANCE = {"float32": 1e-3, "bfloat16": 0.25}[resolve_dtype("auto", smollm2.prepare())]
GREEDY = parity.greedy_cases()
SAMPLED = parity.sampled_cases()


def _id(case: parity.Case) -> str:
    return "-".join(filter(None, (case.api, case.name, case.prompt_list)))


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    server = ReferenceServer(tmp_path_factory.mktemp("reference")).start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def clients(embedded, reference):
    ours = openai.OpenAI(base_url=embedded.base_url + "/v1", api_key=API_KEY, max_retries=0, timeout=120)
    theirs = openai.OpenAI(base_url=reference.base_url + "/v1", api_key=reference.api_key, max_retries=0,
                           timeout=120)
    return ours, theirs


@pytest.fixture(scope="module")
def prompts(reference, clients):
    """Per size, the completions prompt, its token ids, the prompt lists, the plain greedy replies (the
    placeholders' source) and the token that logit_bias forces."""
    with httpx.Client(base_url=reference.base_url, headers={"Authorization": f"Bearer {reference.api_key}"},
                      timeout=30) as http:
        def tokenize(text: str) -> list[int]:
            body = {"model": MODEL, "prompt": text, "add_special_tokens": False}
            return http.post("/tokenize", json=body).raise_for_status().json()["tokens"]

        texts = {"short": parity.SHORT_TEXT, "long": parity.LONG_TEXT}
        ids = {size: tokenize(text) for size, text in texts.items()}
        biased = tokenize(parity.BIASED_TEXT)
    assert len(ids["long"]) > parity.OFFLOAD_THRESHOLD_TOKENS >= len(ids["short"])
    lists = {("short", "text"): [texts["short"], texts["short"] + " the"],
             ("long", "text"): [texts["long"], texts["short"]],
             ("short", "tokens"): [ids["short"], ids["short"][:-2]],
             ("long", "tokens"): [ids["long"], ids["short"]]}
    plains = {(api, size): parity.send(clients[1], parity.plain_case(api), text, stream=False)
              for api in ("completions", "chat") for size, text in texts.items()}
    return {"texts": texts, "lists": lists, "plains": plains, "biased": biased[0]}


def _prompt(case: parity.Case, size: str, prompts: dict):
    return prompts["lists"][size, case.prompt_list] if case.prompt_list else prompts["texts"][size]


def _routed(embedded) -> dict[str, float]:
    return {path: embedded.routed(path) for path in ("local", "pd", "prfaas")}


def _needs_prompt_logprobs(case: parity.Case) -> bool:
    params = {**case.params, **case.params.get("extra_body", {})}
    return params.get("prompt_logprobs") is not None or (
        bool(params.get("echo")) and params.get("logprobs") is not None)


def _refused_by_vllm(case: parity.Case) -> bool:
    """vLLM refuses n > 1 at temperature 0, and every tool choice but `none` without a tool parser."""
    if case.name == "n2_greedy":
        return True
    return case.name in ("tool_named", "tool_required", "tool_auto") and not configured_tool_parser()


def _greedy_runs() -> list:
    """Each case on both paths, one of them streamed and the other whole (alternating from case to case,
    so that each path sees every API streamed and not); bench/api_parity.py runs all four."""
    return [pytest.param(case, size, (i + j) % 2 == 1, id=f"{_id(case)}-{size}-{'stream' if (i + j) % 2 else 'whole'}")
            for i, case in enumerate(GREEDY) for j, size in enumerate(SIZES)]


@pytest.mark.parametrize("case, size, stream", _greedy_runs())
def test_greedy_reply_equals_vllms(case, size, stream, clients, prompts, embedded):
    case = parity.filled(case, prompts["plains"][case.api, size], prompts["biased"])
    prompt = _prompt(case, size, prompts)
    check_sensitivity = bool(case.under_test) and not stream

    def reference_side():
        reply = parity.send(clients[1], case, prompt, stream)
        without = parity.send(clients[1], parity.baseline(case), prompt, stream) if check_sensitivity else None
        return reply, without

    before = _routed(embedded)
    with ThreadPoolExecutor(2) as pool:
        theirs = pool.submit(reference_side)
        ours = pool.submit(parity.send, clients[0], case, prompt, stream).result()
        reference, without = theirs.result()

    if _refused_by_vllm(case):
        assert reference.error and reference.error["status"] == 400, reference
        assert ours.error and ours.error["status"] == 400, f"vLLM refuses it ({reference.error}); we answered {ours}"
        return
    assert not reference.error, reference.error
    assert not ours.error, f"refused: {ours.error}"
    assert not (differences := parity.differences(ours, reference, TOLERANCE)), "\n".join(differences)
    assert not (invalid := parity.invalid(ours, case)), invalid
    if check_sensitivity:
        assert not (why := parity.sensitivity(reference, without)), f"the case tests nothing: {why}"
    if case.params.get("n", 1) == 2:  # one token kept per step: a prompt's two choices are equal
        pairs = [[c.text for c in ours.choices[i:i + 2]] for i in range(0, len(ours.choices), 2)]
        assert all(a == b for a, b in pairs), pairs
    after = _routed(embedded)
    if _needs_prompt_logprobs(case):  # the router prefills these on the decode worker (README's table)
        assert after["prfaas"] == before["prfaas"], f"prompt logprobs took the PrfaaS path: {before} -> {after}"
    elif size == "long":
        assert after["prfaas"] > before["prfaas"], f"no request took the PrfaaS path: {before} -> {after}"
    else:
        assert after["prfaas"] == before["prfaas"], f"a short prompt took the PrfaaS path: {before} -> {after}"


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("case", SAMPLED, ids=_id)
def test_sampled_reply_has_vllms_shape(case, size, clients, prompts):
    """Streamed on the long prompt, whole on the short one; the reference is held to the same checks,
    so that a check vLLM itself fails shows here as the reference's failure."""
    stream = size == "long"
    prompt = _prompt(case, size, prompts)
    num_prompts = len(prompt) if case.prompt_list else 1
    with ThreadPoolExecutor(2) as pool:
        theirs = pool.submit(parity.send, clients[1], case, prompt, stream)
        ours = parity.send(clients[0], case, prompt, stream)
        reference = theirs.result()
    assert not (problems := parity.problems(reference, case, [0] * num_prompts)), f"the reference's: {problems}"
    assert not (problems := parity.problems(ours, case, [0] * num_prompts)), problems


# An example value the router refuses, and the API to send it to, for each parameter it may refuse.
REFUSED_EXAMPLES = {
    "suffix": ("completions", " and they lived happily."),
    "n": ("completions", 2),
    "best_of": ("completions", 2),
    "echo": ("completions", True),
    "logprobs": ("completions", 2),
    "top_logprobs": ("chat", 2),
    "logit_bias": ("completions", {"9805": 5}),
    "presence_penalty": ("completions", 1.0),
    "frequency_penalty": ("completions", 1.0),
    "repetition_penalty": ("completions", 1.2),
    "min_tokens": ("completions", 2),
    "stop_token_ids": ("completions", [2]),
    "tools": ("chat", [parity.WEATHER_TOOL]),
    "tool_choice": ("chat", "auto"),
    "functions": ("chat", [parity.WEATHER_TOOL["function"]]),
    "function_call": ("chat", {"name": "get_weather"}),
    "use_beam_search": ("completions", True),
    "response_format": ("chat", {"type": "json_object"}),
    "structured_outputs": ("completions", {"choice": ["a", "b"]}),
    "guided_json": ("completions", {"type": "object"}),
    "guided_regex": ("completions", "[a-z]+"),
    "guided_choice": ("completions", ["a", "b"]),
    "guided_grammar": ("completions", 'root ::= "a"'),
    "guided_decoding_backend": ("completions", "xgrammar"),
    "guided_whitespace_pattern": ("completions", " "),
}


def refused_parameters() -> list[str]:
    """What the router refuses, from its own table."""
    from services.router.openai_api import UNSUPPORTED

    return [entry[0] for entry in UNSUPPORTED]


@pytest.mark.parametrize("name", refused_parameters())
def test_refused_parameter_is_a_400_that_names_it(name, embedded):
    assert name in REFUSED_EXAMPLES, f"no example value of {name!r} to send: add one to REFUSED_EXAMPLES"
    api, value = REFUSED_EXAMPLES[name]
    error = _refusal(embedded, api, name, value)
    assert error["param"] == name and name in error["message"], error


def _refusal(embedded, api: str, name: str, value) -> dict:
    """The router's error for a request of ``api`` with ``name`` set to ``value``; fails unless a 400."""
    body = {"model": MODEL, "max_tokens": 2, name: value}
    body |= {"messages": parity.messages("Hello.")} if api == "chat" else {"prompt": "Hello."}
    path = "/v1/chat/completions" if api == "chat" else "/v1/completions"
    reply = httpx.post(embedded.base_url + path, json=body, headers={"Authorization": f"Bearer {API_KEY}"},
                       timeout=60)
    assert reply.status_code == 400, (name, api, reply.text)
    return reply.json()["error"]


def test_suffix_is_refused():
    """vLLM's server honours every parameter of issue 54 but ``suffix``; so must the router refuse it."""
    assert "suffix" in refused_parameters()


def readme_refusals() -> dict[str, str]:
    """The parameters README's "OpenAI API reference" table marks refused, with the API each is refused
    on (the row's "(C)" or "(Ch)", else both: then the example's)."""
    text = (ROOT / "README.md").read_text()
    match = re.search(r"^## OpenAI API reference\n(.*?)(?=^## |\Z)", text, re.MULTILINE | re.DOTALL)
    assert match, 'README.md has no "## OpenAI API reference" section'
    refused = {}
    for line in match.group(1).splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if not line.lstrip().startswith("|") or len(cells) < 3 or not cells[1].strip("*").lower().startswith(
                ("refused", "no")):
            continue
        for name, api in re.findall(r"`([^`]+)`(?:\s*\((Ch|C)\))?", cells[0]):
            default = REFUSED_EXAMPLES.get(name, ("completions",))[0]
            refused[name] = {"C": "completions", "Ch": "chat"}.get(api, default)
    return refused


def test_readme_table_lists_what_the_router_refuses(embedded):
    """Each parameter the router's table refuses is marked refused in README, and each one README marks
    refused gets the 400 that names it on the API the row names."""
    refusals = readme_refusals()
    assert set(refused_parameters()) <= refusals.keys(), \
        f"refused but not in README's table as refused: {sorted(set(refused_parameters()) - refusals.keys())}"
    for name, api in refusals.items():
        assert name in REFUSED_EXAMPLES, f"no example value of {name!r} to send: add one to REFUSED_EXAMPLES"
        error = _refusal(embedded, api, name, REFUSED_EXAMPLES[name][1])
        assert error["param"] == name and name in error["message"], (name, api, error)
