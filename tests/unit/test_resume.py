"""A moved request's earlier tokens count as output: the frequency penalty folded into the logit bias
(checked against vLLM's own penalty code), min_tokens, and the cases refused as inexact."""
from __future__ import annotations

import dataclasses

import pytest

from services.worker_api.resume import resume_problem, resumed_logit_bias, resumed_min_tokens
from services.worker_api.types import Sampling

VOCAB = 32
PROMPT = [3, 4, 5, 4]
EARLIER = [7, 7, 9, 4, 7]  # generated before the move
LATER = [9, 11, 7]  # generated after it, before the step sampled here


def _penalised(logits, prompt, output, sampling: Sampling, bias: dict[int, float]):
    """The logits vLLM samples from: the logit bias, then its own penalties (vLLM's order)."""
    import torch
    from vllm.model_executor.layers.utils import apply_penalties

    logits = logits.clone()
    for token, value in bias.items():
        logits[0, token] += value

    def padded(tokens):
        return torch.tensor([tokens or [VOCAB]])  # vLLM pads with the vocabulary size

    def per_seq(value):
        return torch.tensor([value], dtype=torch.float32)

    return apply_penalties(logits, padded(prompt), padded(output), per_seq(sampling.presence_penalty),
                           per_seq(sampling.frequency_penalty), per_seq(sampling.repetition_penalty))


def _uninterrupted_and_moved(sampling: Sampling):
    import torch

    logits = torch.randn(1, VOCAB, generator=torch.Generator().manual_seed(0))
    uninterrupted = _penalised(logits, PROMPT, EARLIER + LATER, sampling, dict(sampling.logit_bias))
    moved = _penalised(logits, PROMPT + EARLIER, LATER, sampling, resumed_logit_bias(sampling, EARLIER))
    return uninterrupted, moved


@pytest.mark.parametrize("sampling", [
    Sampling(16, temperature=0, frequency_penalty=0.7),
    Sampling(16, temperature=0, frequency_penalty=-0.4, logit_bias=((7, 2.5), (20, -1.0))),
    Sampling(16, temperature=0, repetition_penalty=1.3),  # counts prompt and output alike: nothing to fold
    Sampling(16, temperature=0, logit_bias=((9, 5.0),)),
])
def test_a_moved_request_samples_from_the_logits_an_uninterrupted_one_would(sampling):
    uninterrupted, moved = _uninterrupted_and_moved(sampling)
    assert moved[0].tolist() == pytest.approx(uninterrupted[0].tolist(), abs=1e-6)


@pytest.mark.parametrize("sampling", [
    Sampling(16, temperature=0, presence_penalty=0.5),
    Sampling(16, temperature=0, frequency_penalty=0.7, repetition_penalty=1.3),
])
def test_the_cases_refused_as_inexact_would_sample_from_other_logits(sampling):
    uninterrupted, moved = _uninterrupted_and_moved(sampling)
    assert moved[0].tolist() != pytest.approx(uninterrupted[0].tolist(), abs=1e-3)
    assert resume_problem(sampling) is not None


def test_the_fold_subtracts_the_penalty_times_each_earlier_tokens_count_from_its_bias():
    sampling = Sampling(16, frequency_penalty=0.5, logit_bias=((7, 1.0), (30, -2.0)))
    assert resumed_logit_bias(sampling, EARLIER) == {7: 1.0 - 0.5 * 3, 9: -0.5, 4: -0.5, 30: -2.0}
    assert resumed_logit_bias(dataclasses.replace(sampling, frequency_penalty=0.0), EARLIER) == {7: 1.0, 30: -2.0}
    assert resumed_logit_bias(sampling, []) == {7: 1.0, 30: -2.0}


@pytest.mark.parametrize("min_tokens, num_earlier, expected", [(10, 0, 10), (10, 4, 6), (10, 10, 0), (3, 8, 0)])
def test_min_tokens_counts_only_the_tokens_still_to_generate(min_tokens, num_earlier, expected):
    assert resumed_min_tokens(Sampling(16, min_tokens=min_tokens, num_output_prompt_tokens=num_earlier)) == expected


@pytest.mark.parametrize("fields, refused_for", [
    ({}, None),
    ({"frequency_penalty": 1.0}, None),
    ({"repetition_penalty": 1.2}, None),
    ({"frequency_penalty": 1.0, "repetition_penalty": 1.2}, "repetition_penalty"),
    ({"presence_penalty": 0.1}, "presence_penalty"),
    ({"presence_penalty": -0.5}, "presence_penalty"),
    ({"seed": 7, "temperature": 0.8}, "seeded"),
    ({"seed": 7, "temperature": 0.0}, None),  # greedy: the seed draws nothing
    ({"temperature": 0.8}, None),  # unseeded sampling promises no particular draws
])
def test_resume_problem_names_what_cannot_go_on_exactly(fields, refused_for):
    problem = resume_problem(Sampling(16, **fields))
    assert problem is None if refused_for is None else refused_for in problem
