"""The OpenAI API parity cases: one request sent through the official ``openai`` client to a PrfaaS
router and to vLLM's own server (``support.reference_server``), each reply read into one shape
(streamed or not), and the two compared. Used by tests/e2e/embedded/test_api_parity.py and
bench/api_parity.py.

A case is a request's parameters (``Case.params``: keyword arguments of the client's ``create``)
for one API (``completions`` or ``chat``); its prompt is given separately, so each case runs on a
short prompt (prefilled by the decode worker) and on a long one (past the embedded default's
``scheduler.offload_threshold_tokens``: prefilled by the PrfaaS prefill worker, its KV streamed).
Greedy replies must be equal (``differences``); sampled ones are checked for shape and validity
only (``problems``).
"""
from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Callable
from dataclasses import dataclass, field

MODEL = "smollm2-135m-instruct"
OFFLOAD_THRESHOLD_TOKENS = 256  # deploy/local.yaml's scheduler.offload_threshold_tokens
# The PrfaaS path needs a prompt past the threshold: these paragraphs are about 330 tokens.
LONG_TEXT = (
    "The lighthouse stood at the end of a long stone pier, and for more than a hundred years its keepers "
    "had climbed the spiral stairs each evening to light the lamp. The first keeper was a fisherman who had "
    "lost his boat in a winter storm; the town gave him the job so that he would not have to leave. He kept "
    "a journal of every ship that passed, the weather of each day, and the birds that rested on the railing. "
    "His daughter took over after him, and she added notes about the tides and the shapes of the clouds. "
    "When the lamp was finally replaced by an automatic light, the journals were moved to the small museum "
    "beside the harbour, where visitors still read them on rainy afternoons. Children like the pages with "
    "drawings best: a whale seen far out in the bay, a ship with three masts, a storm that broke every window "
    "on the north side of the tower. Older visitors read the lists of ships, looking for the names of their "
    "grandparents' boats. The museum keeps the journals in a glass case, open at a different page each week, "
    "and the town holds a small festival every summer on the day the first lamp was lit. There is music on "
    "the pier, the tower is open to anyone who wants to climb the stairs, and at sunset the old lamp, cleaned "
    "and polished, is lit one more time for an hour before the automatic light takes over again for the "
    "night. People say that on clear nights the light can be seen from the hills thirty miles inland."
)
SHORT_TEXT = "The lighthouse stood at the end of a long stone pier, and"
QUESTION = " In one short sentence: who kept the journal first?"
# Replies that repeat themselves, for the penalties to act on
REPEAT_SUFFIX = " Yes, yes, yes, yes, yes,"
REPEAT_QUESTION = " Now write the word yes ten times, separated by commas."
JSON_OBJECT_QUESTION = ' Reply with a JSON object {"answer": ...}: is the sea calm?'
JSON_QUESTION = ' Reply with a JSON object: the "city" of the story and the "year" it begins.'
WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
STRICT_WEATHER_TOOL = {"type": "function", "function": {**WEATHER_TOOL["function"], "strict": True}}
TIME_TOOL = {"type": "function", "function": {
    "name": "get_time", "description": "The local time in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
CITY_SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                "year": {"type": "integer"}},
               "required": ["city", "year"], "additionalProperties": False}
GRAMMAR = 'root ::= "The answer is " ("yes" | "no") "."'
CHOICES = ["red", "green", "blue"]
REGEX = "(yes|no), because [a-z ]{1,12}\\."


@dataclass(frozen=True, slots=True)
class Case:
    """``params``: keyword arguments of ``client.<api>.create`` (``extra_body`` for vLLM's own fields).
    ``valid``: a check of one choice's text and tool calls, a message when it fails. ``under_test``:
    the parameters (``extra_body.<name>`` for vLLM's own) whose effect the reference's greedy reply
    must show: it must differ from the reply to the same request without them (``baseline``), else
    the case would pass against a server that ignores them."""

    name: str
    api: str  # "completions" or "chat"
    params: dict
    valid: Callable[["Choice"], str | None] | None = None
    under_test: tuple[str, ...] = ()
    prompt_list: str | None = None  # completions: a list of prompts, as "text" or "tokens"
    question: str = QUESTION  # chat: what the user asks after the prompt's text
    suffix: str = ""  # completions: added to the prompt's text
    second_turn: bool = False  # chat: the text is a first user turn, answered; the question is a second


@dataclass(slots=True)
class Choice:
    index: int
    text: str = ""
    finish_reason: str | None = None
    logprobs: dict | list | None = None  # completions: the four lists; chat: ``content`` entries
    tool_calls: list[dict] = field(default_factory=list)  # {"name", "arguments"}
    token_ids: list[int] | None = None


@dataclass(slots=True)
class Reply:
    choices: list[Choice]
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    error: dict | None = None  # a refused request: {"status", "message", "param"}


def _json_object(choice: Choice) -> str | None:
    try:
        value = json.loads(choice.text)
    except ValueError as exc:
        return f"not JSON ({exc}): {choice.text!r}"
    return None if isinstance(value, dict) else f"not a JSON object: {choice.text!r}"


def _city_schema(choice: Choice) -> str | None:
    import jsonschema

    try:
        jsonschema.validate(json.loads(choice.text), CITY_SCHEMA)
    except (ValueError, jsonschema.ValidationError) as exc:
        return f"does not validate ({str(exc).splitlines()[0]}): {choice.text!r}"
    return None


def _fullmatch(pattern: str) -> Callable[[Choice], str | None]:
    import re

    return lambda choice: None if re.fullmatch(pattern, choice.text) else f"{choice.text!r} is not {pattern!r}"


def _one_of(options: list[str]) -> Callable[[Choice], str | None]:
    return lambda choice: None if choice.text in options else f"{choice.text!r} is not one of {options}"


def _tool_call(names: tuple[str, ...]) -> Callable[[Choice], str | None]:
    def check(choice: Choice) -> str | None:
        if not choice.tool_calls:
            return f"no tool call (text {choice.text!r})"
        for call in choice.tool_calls:
            if call["name"] not in names:
                return f"a call of {call['name']!r}, not of {names}"
            try:
                arguments = json.loads(call["arguments"])
            except ValueError:
                return f"arguments are not JSON: {call['arguments']!r}"
            if not isinstance(arguments, dict) or not isinstance(arguments.get("city"), str):
                return f"arguments lack the required string 'city': {call['arguments']!r}"
        return None
    return check


def _no_tool_call(choice: Choice) -> str | None:
    return f"a tool call where none was allowed: {choice.tool_calls}" if choice.tool_calls else None


def greedy_cases(max_tokens: int = 8) -> list[Case]:
    """Every parameter of issue 54 at temperature 0, for both APIs where the API has it. Placeholders
    (the token ``logit_bias`` forces, the stop string and stop token id) are filled by ``filled``.
    ``n`` > 1 runs with a ``top_p`` that keeps one token: vLLM refuses n > 1 at temperature 0
    (``n2_greedy``, a 400 on both)."""
    g = {"temperature": 0, "max_tokens": max_tokens}
    # n > 1 is refused at temperature 0; a top_p this small keeps one token whatever the seed (of tokens
    # tied at the top, the one sorted last, where top_k 1 would keep them all and sample)
    one_token = {"temperature": 1.0, "top_p": 1e-6, "seed": 3, "max_tokens": max_tokens}
    repeat = {"suffix": REPEAT_SUFFIX, "question": REPEAT_QUESTION, "second_turn": True}
    long_budget = {"temperature": 0, "max_tokens": 5 * max_tokens}
    tools = {"tools": [WEATHER_TOOL, TIME_TOOL]}
    cases = [
        Case("logprobs", "completions", {**g, "logprobs": 3}),
        Case("echo_logprobs_max0", "completions", {**g, "echo": True, "logprobs": 2, "max_tokens": 0}),
        Case("echo_logprobs_max1", "completions", {**g, "echo": True, "logprobs": 2, "max_tokens": 1}),
        Case("best_of", "completions", {**one_token, "n": 2, "best_of": 2}),
        Case("logprobs", "chat", {**g, "logprobs": True, "top_logprobs": 3}),
        Case("logprobs_no_top", "chat", {**g, "max_tokens": 2, "logprobs": True}),
        Case("prompt_list_n2", "completions", {**one_token, "n": 2, "logprobs": 1}, prompt_list="text"),
        Case("prompt_list_n2", "completions", {**one_token, "n": 2}, prompt_list="tokens"),
    ]
    for api in ("completions", "chat"):
        # SmolLM2's chat replies repeat no token in a few: a bias towards one gives the penalties work
        repeat_bias = {"logit_bias": {"@BIASED@": 5}} if api == "chat" else {}
        cases += [
            Case("n2_greedy", api, {**g, "n": 2}),
            Case("n2", api, {**one_token, "n": 2}),
            Case("frequency_penalty", api, {**g, **repeat_bias, "frequency_penalty": 2.0},
                 under_test=("frequency_penalty",), **repeat),
            Case("repetition_penalty", api, {**g, "extra_body": {"repetition_penalty": 1.8}},
                 under_test=("extra_body.repetition_penalty",), **repeat),
            Case("logit_bias", api, {**g, "max_tokens": 4, "logit_bias": {"@BIASED@": 100}},
                 under_test=("logit_bias",)),
            Case("min_tokens_stop", api, {**g, "stop": ["@STOP@"], "extra_body": {"min_tokens": 4}},
                 under_test=("extra_body.min_tokens",)),
            Case("stop_token_ids", api, {**g, "extra_body": {"stop_token_ids": ["@STOP_ID@"]}},
                 under_test=("extra_body.stop_token_ids",)),
            Case("so_regex", api, {**long_budget, "extra_body": {"structured_outputs": {"regex": REGEX}}},
                 _fullmatch(REGEX)),
            Case("so_choice", api, {**g, "extra_body": {"structured_outputs": {"choice": CHOICES}}}, _one_of(CHOICES)),
            Case("so_grammar", api, {**long_budget, "extra_body": {"structured_outputs": {"grammar": GRAMMAR}}},
                 _fullmatch("The answer is (yes|no)\\.")),
        ]
    # presence_penalty on completions only: on this model's short chat replies no prompt and bias found
    # made it change vLLM's own reply, so the chat case would test nothing (the sampling is the same code)
    cases.insert(8, Case("presence_penalty", "completions", {**g, "presence_penalty": 2.0},
                         under_test=("presence_penalty",), **repeat))
    cases += [
        Case("json_object", "chat", {**long_budget, "response_format": {"type": "json_object"}}, _json_object,
             question=JSON_OBJECT_QUESTION),
        Case("json_schema", "chat", {**long_budget, "response_format": {
            "type": "json_schema", "json_schema": {"name": "city", "schema": CITY_SCHEMA, "strict": True}}},
            _city_schema, question=JSON_QUESTION),
        Case("tool_named", "chat", {**long_budget, **tools, "tool_choice": {
            "type": "function", "function": {"name": "get_weather"}}}, _tool_call(("get_weather",))),
        Case("tool_required", "chat", {**long_budget, **tools, "tool_choice": "required"},
             _tool_call(("get_weather", "get_time"))),
        Case("tool_none", "chat", {**g, **tools, "tool_choice": "none"}, _no_tool_call),
        Case("tool_auto", "chat", {**g, **tools, "tool_choice": "auto"}),
    ]
    return cases


def sampled_cases(max_tokens: int = 8, seed: int = 7) -> list[Case]:
    """Temperature 1 with a seed: only shapes, bounds and validity are compared."""
    s = {"temperature": 1.0, "seed": seed, "max_tokens": max_tokens}
    fixed = {**s, "extra_body": {"ignore_eos": True}}
    return [
        Case("sampled_logprobs_n2", "completions", {**fixed, "n": 2, "logprobs": 4}),
        Case("sampled_logprobs_n2", "chat", {**fixed, "n": 2, "logprobs": True, "top_logprobs": 4}),
        Case("sampled_json_schema", "chat", {**s, "max_tokens": 5 * max_tokens, "response_format": {
            "type": "json_schema", "json_schema": {"name": "city", "schema": CITY_SCHEMA}}}, _city_schema,
            question=JSON_QUESTION),
        # strict: the arguments pinned to the function's schema (OpenAI's strict mode; vLLM's parser pins
        # them only then): sampled freely, SmolLM2 writes them as a bare string
        Case("sampled_tool_named", "chat", {**s, "max_tokens": 5 * max_tokens, "tools": [STRICT_WEATHER_TOOL],
                                            "tool_choice": {"type": "function", "function": {"name": "get_weather"}}},
             _tool_call(("get_weather",))),
        Case("sampled_prompt_list_n2", "completions", {**fixed, "n": 2}, prompt_list="text"),
    ]


PLAIN_TOKENS = 16  # the plain greedy reply that the placeholders and the sensitivity checks read
BIASED_TEXT = " yes"  # the token logit_bias forces


def plain_case(api: str) -> Case:
    """A greedy request with no parameter under test, sent to the reference only: its tokens give the
    stop string and stop token id, and its text what a case that ignored its parameter would return."""
    logprobs = {"logprobs": True} if api == "chat" else {"logprobs": 0}
    return Case("plain", api, {"temperature": 0, "max_tokens": PLAIN_TOKENS, **logprobs,
                               "extra_body": {"return_token_ids": True}})


def filled(case: Case, plain: Reply, biased: int) -> Case:
    """``case`` with its placeholders filled from the plain reply on the same prompt: the stop token id
    is its fourth token (so a reply stops after three), the stop string its second token's text (so
    only ``min_tokens`` lets the reply past it), and ``biased`` the token ``logit_bias`` forces."""
    choice = plain.choices[0]
    text = json.dumps(case.params).replace('"@BIASED@"', json.dumps(str(biased)))
    text = text.replace('"@STOP_ID@"', str(choice.token_ids[3])).replace("@STOP@", _token_texts(choice)[1].strip())
    return dataclasses.replace(case, params=json.loads(text))


def _token_texts(choice: Choice) -> list[str]:
    if isinstance(choice.logprobs, dict):
        return choice.logprobs["tokens"]
    return [entry["token"] for entry in choice.logprobs]


def baseline(case: Case) -> Case:
    """``case`` without the parameters it tests."""
    params = json.loads(json.dumps(case.params))
    for path in case.under_test:
        *parents, name = path.split(".")
        holder = params
        for parent in parents:
            holder = holder[parent]
        del holder[name]
    return dataclasses.replace(case, name=case.name + "_baseline", params=params, under_test=())


def sensitivity(reference: Reply, without: Reply) -> str | None:
    """Why the reference's reply does not show that the case's parameters acted: it is the reply to
    the request without them (None when it differs)."""
    if [(c.text, c.finish_reason) for c in reference.choices] != [(c.text, c.finish_reason) for c in without.choices]:
        return None
    return f"the reply is the same without the parameters under test: {[c.text for c in reference.choices]}"


def messages(text: str, question: str = QUESTION, second_turn: bool = False) -> list[dict]:
    if second_turn:
        return [{"role": "user", "content": text}, {"role": "assistant", "content": "Thank you, I have read it."},
                {"role": "user", "content": question.strip()}]
    return [{"role": "user", "content": text + question}]


def send(client, case: Case, prompt, stream: bool) -> Reply:
    """One request of ``case`` on ``prompt`` (completions: a string, token ids or a list of those;
    chat: the user's text), read into a ``Reply``."""
    import openai

    params = dict(case.params)
    if stream:
        params |= {"stream": True, "stream_options": {"include_usage": True}}
    try:
        if case.api == "chat":
            chat = messages(prompt, case.question, case.second_turn)
            response = client.chat.completions.create(model=MODEL, messages=chat, **params)
        else:
            if case.suffix:
                prompt = prompt + case.suffix
            response = client.completions.create(model=MODEL, prompt=prompt, **params)
        if stream:
            return _read_chunks(case.api, [chunk.model_dump() for chunk in response])
    except openai.APIStatusError as exc:
        body = exc.body.get("error", exc.body) if isinstance(exc.body, dict) else {}
        return Reply([], error={"status": exc.status_code, "message": str(body.get("message", exc.message)),
                                "param": body.get("param")})
    return _read(case.api, response.model_dump())


def _read(api: str, body: dict) -> Reply:
    choices = []
    for raw in body["choices"]:
        choice = Choice(raw["index"], finish_reason=raw["finish_reason"], token_ids=raw.get("token_ids"))
        if api == "chat":
            message = raw["message"]
            choice.text = message.get("content") or ""
            choice.tool_calls = [{"name": c["function"]["name"], "arguments": c["function"]["arguments"]}
                                 for c in message.get("tool_calls") or ()]
            choice.logprobs = (raw.get("logprobs") or {}).get("content") if raw.get("logprobs") else None
        else:
            choice.text = raw["text"]
            choice.logprobs = _completion_logprobs(raw.get("logprobs"))
        choices.append(choice)
    usage = body.get("usage") or {}
    return Reply(sorted(choices, key=lambda c: c.index), usage.get("prompt_tokens"), usage.get("completion_tokens"))


def _completion_logprobs(raw: dict | None) -> dict | None:
    if raw is None:
        return None
    return {key: list(raw.get(key) or ()) for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset")}


def _read_chunks(api: str, chunks: list[dict]) -> Reply:
    choices: dict[int, Choice] = {}
    calls: dict[tuple[int, int], dict] = {}
    usage: dict = {}
    for chunk in chunks:
        usage = chunk.get("usage") or usage
        for raw in chunk["choices"]:
            choice = choices.setdefault(raw["index"], Choice(raw["index"]))
            choice.finish_reason = raw.get("finish_reason") or choice.finish_reason
            if raw.get("token_ids"):
                choice.token_ids = (choice.token_ids or []) + list(raw["token_ids"])
            if api == "chat":
                delta = raw.get("delta") or {}
                choice.text += delta.get("content") or ""
                for call in delta.get("tool_calls") or ():
                    built = calls.setdefault((raw["index"], call["index"]), {"name": "", "arguments": ""})
                    function = call.get("function") or {}
                    built["name"] += function.get("name") or ""
                    built["arguments"] += function.get("arguments") or ""
                if raw.get("logprobs") is not None:
                    choice.logprobs = (choice.logprobs or []) + list(raw["logprobs"].get("content") or ())
            else:
                choice.text += raw.get("text") or ""
                if raw.get("logprobs") is not None:
                    part = _completion_logprobs(raw["logprobs"])
                    choice.logprobs = part if choice.logprobs is None else \
                        {k: choice.logprobs[k] + part[k] for k in part}
    for (index, _), call in sorted(calls.items()):
        choices[index].tool_calls.append(call)
    return Reply(sorted(choices.values(), key=lambda c: c.index), usage.get("prompt_tokens"),
                 usage.get("completion_tokens"))


def differences(ours: Reply, reference: Reply, tolerance: float) -> list[str]:
    """Where a greedy reply differs from the reference's: every field exactly but logprob values,
    which may differ by ``tolerance``."""
    if ours.error or reference.error:
        statuses = [r.error and r.error["status"] for r in (ours, reference)]
        return [] if statuses[0] == statuses[1] else [f"error {ours.error} != {reference.error}"]
    found = []
    if [c.index for c in ours.choices] != [c.index for c in reference.choices]:
        return [f"choice indexes {[c.index for c in ours.choices]} != {[c.index for c in reference.choices]}"]
    for usage in ("prompt_tokens", "completion_tokens"):
        if getattr(ours, usage) != getattr(reference, usage):
            found.append(f"usage.{usage}: {getattr(ours, usage)} != {getattr(reference, usage)}")
    for a, b in zip(ours.choices, reference.choices):
        where = f"choice {a.index}"
        for name in ("text", "finish_reason", "tool_calls"):
            if getattr(a, name) != getattr(b, name):
                found.append(f"{where} {name}: {getattr(a, name)!r} != {getattr(b, name)!r}")
        if a.token_ids is not None and b.token_ids is not None and a.token_ids != b.token_ids:
            found.append(f"{where} token_ids: {a.token_ids} != {b.token_ids}")
        found += [f"{where} logprobs{d}" for d in _logprob_differences(a.logprobs, b.logprobs, tolerance)]
    return found


def _logprob_differences(a, b, tolerance: float) -> list[str]:
    if (a is None) != (b is None):
        return [f": {'present' if a is not None else 'absent'} here, {'present' if b is not None else 'absent'} "
                "in the reference"]
    if a is None:
        return []
    if isinstance(a, dict):  # completions
        found = [f".{key}: {a[key]!r} != {b[key]!r}" for key in ("tokens", "text_offset") if a[key] != b[key]]
        if len(a["token_logprobs"]) != len(b["token_logprobs"]):
            return found + [f".token_logprobs: {len(a['token_logprobs'])} entries != {len(b['token_logprobs'])}"]
        for i, (x, y) in enumerate(zip(a["token_logprobs"], b["token_logprobs"])):
            if not _close(x, y, tolerance):
                found.append(f".token_logprobs[{i}]: {x!r} != {y!r}")
        for i, (x, y) in enumerate(zip(a["top_logprobs"], b["top_logprobs"])):
            found += [f".top_logprobs[{i}]{d}" for d in _top_differences(x, y, tolerance)]
        return found
    if len(a) != len(b):
        return [f".content: {len(a)} entries != {len(b)}: {[e['token'] for e in a]} vs {[e['token'] for e in b]}"]
    found = []
    for i, (x, y) in enumerate(zip(a, b)):
        if x["token"] != y["token"] or x.get("bytes") != y.get("bytes"):
            found.append(f".content[{i}]: token {x['token']!r} {x.get('bytes')} != {y['token']!r} {y.get('bytes')}")
        if not _close(x["logprob"], y["logprob"], tolerance):
            found.append(f".content[{i}].logprob: {x['logprob']!r} != {y['logprob']!r}")
        tops = [None if t is None else {e["token"]: e["logprob"] for e in t}
                for t in (x.get("top_logprobs"), y.get("top_logprobs"))]
        if tops[0] is not None and tops[1] is not None and len(x["top_logprobs"]) != len(y["top_logprobs"]):
            found.append(f".content[{i}].top_logprobs: {len(x['top_logprobs'])} entries != {len(y['top_logprobs'])}")
        found += [f".content[{i}].top_logprobs{d}" for d in _top_differences(*tops, tolerance)]
    return found


def _top_differences(a: dict | None, b: dict | None, tolerance: float) -> list[str]:
    """Top-k alternatives: the same tokens with close logprobs, but that a token near the k-th may be
    in one list only (a near-tie at the cut), when its logprob is within ``tolerance`` of the other's last."""
    if not a or not b:
        return [] if not a and not b else [f": {a!r} != {b!r}"]
    found = []
    for token in a.keys() | b.keys():
        if token in a and token in b:
            if not _close(a[token], b[token], tolerance):
                found.append(f"[{token!r}]: {a[token]!r} != {b[token]!r}")
            continue
        present, other = (a, b) if token in a else (b, a)
        if not _close(present[token], min(other.values()), tolerance):
            found.append(f"[{token!r}]: {present[token]!r} in one list only")
    return found


def _close(x, y, tolerance: float) -> bool:
    if x is None or y is None:
        return x is y
    if math.isinf(x) or math.isinf(y):
        return x == y
    return abs(x - y) <= tolerance


def invalid(reply: Reply, case: Case) -> list[str]:
    """The case's validity check on each choice that finished (a reply cut at ``max_tokens`` is unfinished JSON)."""
    return [f"choice {c.index}: {problem}" for c in reply.choices
            if case.valid is not None and c.finish_reason in ("stop", "tool_calls") and (problem := case.valid(c))]


def problems(reply: Reply, case: Case, prompt_tokens: list[int] | None = None) -> list[str]:
    """What is wrong with a reply's shape, whatever its sampled values: the number of choices and their
    indexes, lengths within ``max_tokens`` (exactly it where EOS is ignored), logprob entries per token
    and alternatives per entry, and the case's own validity check. ``prompt_tokens``: each prompt's
    length (with echo, its tokens come first in the logprobs)."""
    if reply.error:
        return [f"refused: {reply.error}"]
    params = case.params
    n = params.get("n", 1)
    num_prompts = len(prompt_tokens or [0])
    found = []
    if [c.index for c in reply.choices] != list(range(n * num_prompts)):
        found.append(f"choice indexes {[c.index for c in reply.choices]}, not 0..{n * num_prompts - 1}")
    max_tokens = params["max_tokens"]
    ignore_eos = params.get("extra_body", {}).get("ignore_eos", False)
    if reply.completion_tokens is not None:
        expected = len(reply.choices) * max(max_tokens, 1)
        if reply.completion_tokens > expected or (ignore_eos and reply.completion_tokens != expected):
            found.append(f"usage.completion_tokens {reply.completion_tokens}, {'' if ignore_eos else 'at most '}"
                         f"{expected} expected")
    top = (params.get("top_logprobs") or 0) if case.api == "chat" else params.get("logprobs")
    for choice in reply.choices:
        echoed = prompt_tokens[choice.index // n] if params.get("echo") and prompt_tokens else 0
        if params.get("logprobs") not in (None, False):
            found += [f"choice {choice.index} {p}"
                      for p in _logprob_shape(choice, case.api, top, (echoed, max_tokens), ignore_eos)]
        if ignore_eos and choice.finish_reason != "length":
            found.append(f"choice {choice.index}: finish_reason {choice.finish_reason!r} with EOS ignored")
    return found + invalid(reply, case)


def _logprob_shape(choice: Choice, api: str, top: int | None, lengths: tuple[int, int], ignore_eos: bool) -> list[str]:
    """``lengths``: tokens echoed from the prompt, most tokens generated."""
    echoed, max_tokens = lengths
    if choice.logprobs is None:
        return ["logprobs missing"]
    if api == "chat":
        counts = [len(e.get("top_logprobs") or ()) for e in choice.logprobs]
        values = [e["logprob"] for e in choice.logprobs]
    else:
        counts = [len(t or {}) for t in choice.logprobs["top_logprobs"]]
        values = choice.logprobs["token_logprobs"]
        if echoed:  # the prompt's first token has no logprob
            counts, values = counts[1:], values[1:]
            echoed -= 1
    found = []
    generated = len(values) - echoed
    if not 0 <= generated <= max(max_tokens, 0) or (ignore_eos and generated != max_tokens):
        found.append(f"{len(values)} logprob entries for {echoed} echoed and up to {max_tokens} generated tokens")
    # completions: the token at the position comes first, then the top k, so k or k + 1 entries
    allowed = (top,) if api == "chat" else (top, top + 1)
    if top is not None and any(c not in allowed for c in counts):
        found.append(f"alternatives per token {counts}, not {' or '.join(map(str, allowed))}")
    if any(v is None or v > 0 or math.isnan(v) for v in values):
        found.append(f"logprobs outside (-inf, 0]: {values}")
    return found
