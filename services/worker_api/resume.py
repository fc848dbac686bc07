"""What a request that moved to another worker needs to go on exactly as an uninterrupted run would.

A moved request's prompt is its original prompt plus the tokens generated so far
(``Sampling.num_output_prompt_tokens`` of them, services/router/continuation.py). vLLM treats every
prompt token alike, so three things that count *output* tokens would change meaning; the worker
restores them:

- **frequency_penalty** subtracts ``penalty x count`` for each token generated so far. vLLM applies
  the logit bias, then the repetition penalty, then frequency and presence penalties, all on the same
  logits. The counts of the earlier worker's tokens are folded into the logit bias
  (``-penalty x count``), which adds the same amount: exact while ``repetition_penalty`` is 1 (a
  repetition penalty scales the logit between the bias and the frequency penalty, so the fold
  would be scaled with it).
- **min_tokens** counts only the tokens still to generate here.
- **Structured outputs**: the grammar is advanced over the tokens already generated before the first
  new one is sampled (services/engine/vllm_plugin.py), so the continuation satisfies the same
  constraint from where it stood.

What cannot be made exact is refused (``resume_problem``), and the router ends such a stream with an
error event instead of a silently different answer:

- **presence_penalty**: a token already generated is penalised once, however often it appears; after
  the fold, vLLM would penalise it again if it appears in the continuation.
- **frequency_penalty with a repetition_penalty other than 1** (above).
- **A seeded request that samples** (temperature > 0): the new engine's random stream starts over, so
  the continuation would not be the one the seed promises.

The repetition penalty alone is exact: vLLM applies it to tokens of the prompt and the output alike.
"""
from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from services.worker_api.types import Sampling


def resume_problem(sampling: Sampling) -> str | None:
    """Why a request with these settings cannot go on exactly on another worker once it has generated
    tokens (None: it can)."""
    if sampling.presence_penalty:
        return ("presence_penalty counts each generated token once; a continuation on another worker cannot "
                "tell the engine which tokens it generated before")
    if sampling.frequency_penalty and sampling.repetition_penalty != 1.0:
        return ("frequency_penalty together with a repetition_penalty other than 1 cannot be carried to another "
                "worker exactly")
    if sampling.seed is not None and sampling.temperature > 0:
        return "a seeded sampling request cannot continue on another worker with the same random draws"
    return None


def resumed_logit_bias(sampling: Sampling, generated: Sequence[int]) -> dict[int, float]:
    """The logit bias under which a continuation counts ``generated`` (the earlier worker's tokens) for
    ``frequency_penalty`` as an uninterrupted run does."""
    bias = dict(sampling.logit_bias)
    if sampling.frequency_penalty:
        for token, count in Counter(generated).items():
            bias[token] = bias.get(token, 0.0) - sampling.frequency_penalty * count
    return bias


def resumed_min_tokens(sampling: Sampling) -> int:
    return max(0, sampling.min_tokens - sampling.num_output_prompt_tokens)
