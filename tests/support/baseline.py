"""The reference of every token-identity test: greedy outputs of one colocated vLLM engine.

The engine is built as the workers build theirs, because the CPU build's bf16 results depend on
more than the model and the prompt:
- the engine core runs in its own process (an in-process engine, VLLM_ENABLE_V1_MULTIPROCESSING=0,
  gives different logits for some prompts on this build);
- one OpenMP thread, as each test worker has (``VLLM_CPU_OMP_THREADS_BIND``): the thread count
  changes the order of bf16 sums;
- the same chunks: a prompt of N tokens is prefilled with the caller's budget for it, which tests
  choose so that the consumer's ``N-1`` tokens split into the producer's chunks.

Even so, a greedy answer can rest on a tie: two logits equal in bf16, broken by token index, which any
reordered sum (another batch, another chunk) may break the other way. ``greedy_margins`` gives, per
prompt, the smallest lead of the chosen token over the runner-up, so a caller can keep only prompts
whose answer is decided.

Answers are cached on disk (``$PRFAAS_CACHE_DIR/references``, default ``~/.cache/prfaas``) under a
hash of everything they depend on: the reference script (model path, dtype, engine settings, token
count), the prompts and budgets, the checkpoint's files, vLLM's and torch's versions, the CPU model
and its flags, and the OpenMP binding. A miss computes the answers with a real engine, never guesses;
``PRFAAS_REFERENCE_CACHE=0`` turns the cache off.
"""
from __future__ import annotations

import functools
import hashlib
import json
import os
import platform
import tempfile
from pathlib import Path

from services.engine.args import resolve_dtype
from services.models.cache import cache_dir
from support.deployment import run_python


def colocated_greedy(model_path: str, prompts: list[list[int]], budgets: list[int], max_tokens: int,
                     cpu: int = 0, **engine) -> list[str]:
    """Text of ``max_tokens`` greedy tokens (EOS ignored) per prompt, each prefilled with its budget,
    on one OpenMP thread bound to ``cpu``."""
    return [text for text, *_ in _reference(model_path, prompts, budgets, max_tokens, cpu, engine, margins=False)]


def greedy_margins(model_path: str, prompts: list[list[int]], budgets: list[int], max_tokens: int,
                   cpu: int = 0, **engine) -> list[tuple[str, float]]:
    """As ``colocated_greedy``, with each answer's smallest logprob lead of the chosen token over the
    runner-up (0.0 where two candidates tie)."""
    return [(text, margin) for text, margin, _ in
            _reference(model_path, prompts, budgets, max_tokens, cpu, engine, margins=True)]


def greedy_token_margins(model_path: str, prompts: list[list[int]], budgets: list[int], max_tokens: int,
                         cpu: int | str = 0, **engine) -> list[tuple[list[int], float]]:
    """As ``greedy_margins``, with token ids instead of text (a tiny random model's tokens often
    decode to nothing). ``cpu``: "0|1" for an engine of two TP ranks."""
    return [(tokens, margin) for _, margin, tokens in
            _reference(model_path, prompts, budgets, max_tokens, cpu, engine, margins=True)]


def greedy_token_texts(model_path: str, prompts: list[list[int]], budgets: list[int], max_tokens: int,
                       cpu: int | str = 0, ignore_eos: bool = True, **engine) -> list[tuple[str, list[int]]]:
    """Text and token ids of up to ``max_tokens`` greedy tokens per prompt; with ``ignore_eos=False``
    an answer ends at EOS, as a client's request does."""
    return [(text, tokens) for text, _, tokens in
            _reference(model_path, prompts, budgets, max_tokens, cpu, engine, margins=False, ignore_eos=ignore_eos)]


def _reference(model_path: str, prompts, budgets, max_tokens: int, cpu: int | str, engine: dict,
               margins: bool, ignore_eos: bool = True) -> list[list]:
    code = _reference_code(model_path, max_tokens, engine, margins, ignore_eos)
    env = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": str(cpu)}
    path = _cache_path(code, env, model_path, prompts, budgets)
    if path is not None and path.exists():
        try:
            cached = json.loads(path.read_text())
            if isinstance(cached, list) and len(cached) == len(prompts):
                return cached
        except ValueError:
            pass  # a torn or foreign file: recompute and replace it
    with tempfile.NamedTemporaryFile("w", suffix=".json") as inputs:  # too long for a command line
        json.dump({"prompts": prompts, "budgets": budgets}, inputs)
        inputs.flush()
        out = run_python(code.replace("@INPUTS@", inputs.name), env=env, timeout=300 + 3 * len(prompts))
    answers = json.loads(out.split("RESULT", 1)[1].splitlines()[0])
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        staging = path.with_suffix(f".{os.getpid()}.tmp")
        staging.write_text(json.dumps(answers))
        staging.replace(path)  # whole or absent, for a concurrent reader
    return answers


def _cache_path(code: str, env: dict, model_path: str, prompts, budgets) -> Path | None:
    if os.environ.get("PRFAAS_REFERENCE_CACHE", "1") == "0":
        return None
    key = hashlib.sha256(json.dumps({
        "code": code, "env": env, "prompts": prompts, "budgets": budgets, **engine_identity(model_path),
    }, sort_keys=True).encode()).hexdigest()
    return cache_dir() / "references" / f"{key[:32]}.json"


def engine_identity(model_path: str) -> dict:
    """What decides a reference engine's numbers besides its script (which names the dtype), inputs
    and settings: the checkpoint's files, vLLM's and torch's versions, the CPU model and its flags. A
    cache of answers derived from references (bench/chaos.py's) keys on it and the dtype."""
    import torch
    import vllm

    return {"checkpoint": _checkpoint_digest(model_path), "vllm": vllm.__version__, "torch": torch.__version__,
            "cpu": _cpu_identity()}


@functools.cache
def _checkpoint_digest(model_path: str) -> str:
    """A digest of the checkpoint's files (names and contents): a regenerated tiny model with other
    weights is another key."""
    digest = hashlib.blake2b(digest_size=16)
    for file in sorted(p for p in Path(model_path).rglob("*") if p.is_file()):
        digest.update(str(file.relative_to(model_path)).encode() + b"\0")
        with file.open("rb") as handle:
            while chunk := handle.read(1 << 22):
                digest.update(chunk)
    return digest.hexdigest()


@functools.cache
def _cpu_identity() -> str:
    """The CPU model and flags: bfloat16 and float32 sums differ between instruction sets."""
    model, flags = platform.machine(), ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name") and not model.endswith(line):
                model += " " + line.split(":", 1)[1].strip()
            elif line.startswith("flags") and not flags:
                flags = " ".join(sorted(line.split(":", 1)[1].split()))
    except OSError:
        pass
    return f"{model} | {flags}"


def _reference_code(model_path: str, max_tokens: int, engine: dict, margins: bool, ignore_eos: bool) -> str:
    return f"""
import json
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt
inputs = json.load(open("@INPUTS@"))
prompts, budgets = inputs["prompts"], inputs["budgets"]
params = SamplingParams(temperature=0, max_tokens={max_tokens}, ignore_eos={ignore_eos!r},
                        logprobs={2 if margins else None})


def lead(output):
    if not output.logprobs:
        return None
    tops = [sorted((c.logprob for c in step.values()), reverse=True) for step in output.logprobs]
    return min((top[0] - top[1] if len(top) > 1 else float("inf")) for top in tops)


texts = [None] * len(prompts)
for budget in sorted(set(budgets)):
    llm = LLM(model={model_path!r}, max_model_len=2048, dtype={resolve_dtype("auto", model_path)!r},
              enforce_eager=True, seed=0,
              max_num_batched_tokens=budget, max_num_seqs=min(64, budget), **{engine!r})
    for i, ids in enumerate(prompts):
        if budgets[i] == budget:
            output = llm.generate([TokensPrompt(prompt_token_ids=list(ids))], params, use_tqdm=False)[0]
            texts[i] = [output.outputs[0].text, lead(output.outputs[0]), list(output.outputs[0].token_ids)]
    del llm
print("RESULT" + json.dumps(texts))
"""
