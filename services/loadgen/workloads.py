"""Workloads: lazy sequences of request specs (prompt, lengths, conversation, trace time).

Every generator takes its own `numpy.random.Generator`, so a seed reproduces the same prompts.
"""
from __future__ import annotations

import json
import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from services.loadgen.config import ConfigError, WorkloadConfig
from services.loadgen.prompts import PromptBuilder


@dataclass(frozen=True, slots=True)
class RequestSpec:
    """One request to send. Multi-turn specs carry only the new question; the runner adds the history."""

    index: int
    prompt: str
    input_len: int
    output_len: int
    system: str = ""
    conversation: int | None = None
    turn: int = 0
    arrival_s: float | None = None


@dataclass(frozen=True, slots=True)
class TraceRow:
    timestamp: float
    output_len: int
    input_len: int | None = None
    prompt: str | None = None


def make_workload(config: WorkloadConfig, builder: PromptBuilder, rng: np.random.Generator,
                  num_requests: int | None = None) -> Iterator[RequestSpec]:
    """An (infinite unless it is a trace) stream of specs; `num_requests` bounds multi-turn grouping."""
    if config.dataset == "random":
        return _single(config, builder, rng, lambda: uniform_length(config.input_len, config.range_ratio, rng))
    if config.dataset == "lognormal":
        return _single(config, builder, rng, lambda: lognormal_length(config, rng))
    if config.dataset == "shared-prefix":
        return shared_prefix(config, builder, rng)
    if config.dataset == "multi-turn":
        return multi_turn(config, builder, rng, num_requests)
    return trace(load_trace(Path(config.trace_path)), config, builder, rng)


def uniform_length(length: int, range_ratio: float, rng: np.random.Generator) -> int:
    if range_ratio == 0:
        return length
    low, high = max(1, math.floor(length * (1 - range_ratio))), math.ceil(length * (1 + range_ratio))
    return int(rng.integers(low, high + 1))


def lognormal_length(config: WorkloadConfig, rng: np.random.Generator) -> int:
    """The paper's truncated log-normal (rejection outside [min, max]), then scaled by `length_scale`."""
    while True:
        sample = rng.lognormal(config.lognormal_mu, config.lognormal_sigma)
        if config.lognormal_min <= sample <= config.lognormal_max:
            return max(1, round(sample * config.length_scale))


def _output_len(config: WorkloadConfig, rng: np.random.Generator) -> int:
    return uniform_length(config.output_len, config.range_ratio, rng)


def _single(config, builder, rng, input_length) -> Iterator[RequestSpec]:
    index = 0
    while True:
        length = input_length()
        yield RequestSpec(index, builder.build(length, rng), length, _output_len(config, rng))
        index += 1


def shared_prefix(config: WorkloadConfig, builder: PromptBuilder, rng: np.random.Generator) -> Iterator[RequestSpec]:
    """`num_prefixes` system prompts of `prefix_len` tokens, each request one of them plus a unique suffix."""
    prefixes = [builder.build(config.prefix_len, rng) + "\n" for _ in range(config.num_prefixes)]
    index = 0
    while True:
        prefix = prefixes[int(rng.integers(len(prefixes)))]
        suffix_len = uniform_length(config.input_len, config.range_ratio, rng)
        total = builder.count(prefix) + suffix_len
        text = builder.build(total, rng, prefix=prefix)
        yield RequestSpec(index, text[len(prefix):], total, _output_len(config, rng), system=prefix)
        index += 1


def multi_turn(config: WorkloadConfig, builder: PromptBuilder, rng: np.random.Generator,
               num_requests: int | None) -> Iterator[RequestSpec]:
    """Conversations of `num_turns` questions, interleaved round-robin so turn t+1 comes after turn t's answer.

    With `num_requests` the conversations are sized to cover exactly that many requests; otherwise
    (duration mode) new groups of conversations start as long as requests are wanted.
    """
    turns = config.num_turns
    group = max(1, math.ceil(num_requests / turns)) if num_requests else 8
    index, first_conversation = 0, 0
    while True:
        for turn in range(turns):
            for conversation in range(first_conversation, first_conversation + group):
                length = uniform_length(config.input_len, config.range_ratio, rng)
                yield RequestSpec(index, builder.build(length, rng), length, _output_len(config, rng),
                                  conversation=conversation, turn=turn)
                index += 1
        first_conversation += group


def load_trace(path: Path) -> list[TraceRow]:
    """JSONL rows with `timestamp` (s), `input_length` or `prompt`, and `output_length`."""
    try:
        lines = path.read_text().splitlines()
    except OSError as exc:
        raise ConfigError(f"--trace: cannot read {path}: {exc.strerror}") from None
    rows = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            rows.append(_trace_row(json.loads(line)))
        except (json.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
            raise ConfigError(f"--trace: {path}:{number}: {exc} (need timestamp, input_length or prompt, "
                              "output_length)") from None
    if not rows:
        raise ConfigError(f"--trace: {path} has no requests")
    return sorted(rows, key=lambda row: row.timestamp)


def _trace_row(row: dict) -> TraceRow:
    if "input_length" not in row and "prompt" not in row:
        raise KeyError("input_length")
    return TraceRow(timestamp=float(row["timestamp"]), output_len=int(row["output_length"]),
                    input_len=int(row["input_length"]) if "input_length" in row else None,
                    prompt=str(row["prompt"]) if "prompt" in row else None)


def trace(rows: list[TraceRow], config: WorkloadConfig, builder: PromptBuilder,
          rng: np.random.Generator) -> Iterator[RequestSpec]:
    """The trace's requests at their timestamps (shifted to start at 0); `length_scale` scales input lengths."""
    first = rows[0].timestamp
    for index, row in enumerate(rows):
        if row.prompt is not None:
            prompt, length = row.prompt, builder.count(row.prompt)
        else:
            length = max(1, round(row.input_len * config.length_scale))
            prompt = builder.build(length, rng)
        yield RequestSpec(index, prompt, length, row.output_len, arrival_s=row.timestamp - first)
