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
"""
from __future__ import annotations

import json
import tempfile

from services.engine.args import resolve_dtype
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


def _reference(model_path: str, prompts, budgets, max_tokens: int, cpu: int | str, engine: dict,
               margins: bool) -> list[list]:
    with tempfile.NamedTemporaryFile("w", suffix=".json") as inputs:  # too long for a command line
        json.dump({"prompts": prompts, "budgets": budgets}, inputs)
        inputs.flush()
        return _run_reference(model_path, inputs.name, max_tokens, engine, cpu, margins,
                              timeout=300 + 3 * len(prompts))


def _run_reference(model_path: str, inputs: str, max_tokens: int, engine: dict, cpu: int | str, margins: bool,
                   timeout: float) -> list[list]:
    code = f"""
import json
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt
inputs = json.load(open({inputs!r}))
prompts, budgets = inputs["prompts"], inputs["budgets"]
params = SamplingParams(temperature=0, max_tokens={max_tokens}, ignore_eos=True, logprobs={2 if margins else None})


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
    out = run_python(code, env={"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": str(cpu)},
                     timeout=timeout)
    return json.loads(out.split("RESULT", 1)[1].splitlines()[0])
