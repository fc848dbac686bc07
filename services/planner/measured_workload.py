"""A workload measured from requests, in place of the typed ``workload`` of the planner's inputs.

Two sources: a load-generator result (``prfaas bench`` writes ``input_lens``, ``output_lens``,
``start_times`` and ``statuses`` per request) or a request trace, one request per line: JSON lines
or CSV with a header, naming the arrival time ``arrival_s`` (seconds) or ``timestamp`` (milliseconds,
as in the Mooncake traces), the prompt length ``input_length`` (or ``input_tokens``,
``prompt_tokens``) and optionally the output length ``output_length`` (or ``output_tokens``,
``completion_tokens``).
"""
from __future__ import annotations

import csv
import json
import math
import statistics
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from services.planner.inputs import LengthDistributionSpec, PlanInputError, PlanInputs
from services.planner.workload_fit import ArrivalStats, FitError, arrival_stats, fit_lengths

TIME_KEYS = {"arrival_s": 1.0, "arrival_time": 1.0, "timestamp": 1e-3}
INPUT_KEYS = ("input_length", "input_tokens", "prompt_tokens", "input_len")
OUTPUT_KEYS = ("output_length", "output_tokens", "completion_tokens", "output_len")
LOADGEN_KEYS = ("input_lens", "start_times")


@dataclass(frozen=True, slots=True)
class RequestSample:
    """What a workload file says about its requests; output lengths may be absent."""

    arrival_times_s: tuple[float, ...]
    input_lengths: tuple[int, ...]
    output_lengths: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class MeasuredWorkload:
    source: str
    kind: str
    input_length: LengthDistributionSpec
    mean_input_tokens: float
    output_tokens: int | None
    arrivals: ArrivalStats

    def apply(self, inputs: PlanInputs) -> PlanInputs:
        """The inputs with this workload's lengths (and output length, if measured)."""
        workload = replace(inputs.workload, input_length=self.input_length,
                           output_tokens=self.output_tokens or inputs.workload.output_tokens)
        return replace(inputs, workload=workload)

    def as_dict(self) -> dict[str, Any]:
        spec = self.input_length
        return {"source": self.source, "kind": self.kind, "num_requests": self.arrivals.num_requests,
                "input_length": {"distribution": spec.distribution, "mu": spec.mu, "sigma": spec.sigma,
                                 "min_tokens": spec.min_tokens, "max_tokens": spec.max_tokens,
                                 "sample_mean_tokens": self.mean_input_tokens},
                "output_tokens": self.output_tokens, "duration_s": self.arrivals.duration_s,
                "rate": self.arrivals.rate, "interarrival_cv": self.arrivals.interarrival_cv}


def load_workload(path: str | Path) -> MeasuredWorkload:
    """Read and fit a workload file; every problem is a :class:`PlanInputError` naming the file."""
    path = Path(path)
    kind, sample = read_sample(path)
    try:
        lengths = fit_lengths(sample.input_lengths)
        arrivals = arrival_stats(sample.arrival_times_s)
    except FitError as exc:
        raise PlanInputError(f"{path}: {exc}") from None
    outputs = sample.output_lengths
    return MeasuredWorkload(str(path), kind, lengths, statistics.fmean(sample.input_lengths),
                            round(statistics.fmean(outputs)) if outputs else None, arrivals)


def read_sample(path: str | Path) -> tuple[str, RequestSample]:
    """The file's kind (load-generator result or trace) and its requests, in arrival order."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise PlanInputError(f"{path}: cannot read: {exc.strerror}") from None
    kind, sample = _parse(path, text)
    order = sorted(range(len(sample.arrival_times_s)), key=sample.arrival_times_s.__getitem__)
    if order != list(range(len(order))):
        sample = RequestSample(tuple(sample.arrival_times_s[i] for i in order),
                               tuple(sample.input_lengths[i] for i in order), sample.output_lengths)
    return kind, sample


def workload_text(measured: dict[str, Any]) -> str:
    """One line for the console: where the workload came from and what was fitted."""
    spec = measured["input_length"]
    output = f"{measured['output_tokens']} output tokens" if measured["output_tokens"] else "output tokens from config"
    return (f"workload: measured from {measured['source']} ({measured['kind']}, {measured['num_requests']} "
            f"requests): input lengths truncated log-normal mu = {spec['mu']:.3f}, sigma = {spec['sigma']:.3f}, "
            f"{spec['min_tokens']:,.1f} .. {spec['max_tokens']:,.1f} tokens (sample mean "
            f"{spec['sample_mean_tokens']:,.0f}), {output}, {measured['rate']:.3f} req/s, "
            f"inter-arrival CV {measured['interarrival_cv']:.2f}")


def _parse(path: Path, text: str) -> tuple[str, RequestSample]:
    if path.suffix.lower() == ".csv":
        return "trace", _trace(path, _csv_rows(text))
    try:
        whole = json.loads(text)
    except ValueError:
        whole = None
    if isinstance(whole, dict) and all(key in whole for key in LOADGEN_KEYS):
        return "load-generator result", _loadgen(path, whole)
    if isinstance(whole, dict) and "input_lens" not in whole and len(text.strip().splitlines()) > 1:
        raise PlanInputError(f"{path}: a JSON object that is not a load-generator result (no {LOADGEN_KEYS})")
    return "trace", _trace(path, _json_rows(path, text))


def _loadgen(path: Path, result: dict[str, Any]) -> RequestSample:
    inputs, starts = result["input_lens"], result["start_times"]
    outputs = result.get("output_lens") or []
    statuses = result.get("statuses") or []
    if not isinstance(inputs, list) or not isinstance(starts, list) or len(inputs) != len(starts):
        raise PlanInputError(f"{path}: input_lens and start_times must be lists of equal length")
    ok = [i for i, n in enumerate(outputs) if n and (not statuses or statuses[i:i + 1] == [200])]
    try:
        return RequestSample(tuple(float(t) for t in starts), tuple(int(n) for n in inputs),
                             tuple(int(outputs[i]) for i in ok))
    except (TypeError, ValueError):
        raise PlanInputError(f"{path}: input_lens, start_times and output_lens must hold numbers") from None


def _trace(path: Path, rows: Iterator[tuple[int, dict[str, Any]]]) -> RequestSample:
    times: list[float] = []
    inputs: list[int] = []
    outputs: list[int] = []
    for line, row in rows:
        times.append(_time(path, line, row))
        inputs.append(_length(path, line, row, INPUT_KEYS, required=True))
        output = _length(path, line, row, OUTPUT_KEYS, required=False)
        if output:
            outputs.append(output)
    return RequestSample(tuple(times), tuple(inputs), tuple(outputs))


def _json_rows(path: Path, text: str) -> Iterator[tuple[int, dict[str, Any]]]:
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError:
            raise PlanInputError(f"{path}:{number}: not a JSON object (a trace is one JSON object per line, "
                                 "or CSV with a .csv name)") from None
        if not isinstance(row, dict):
            raise PlanInputError(f"{path}:{number}: expected a JSON object, got {type(row).__name__}")
        yield number, row


def _csv_rows(text: str) -> Iterator[tuple[int, dict[str, Any]]]:
    for number, row in enumerate(csv.DictReader(text.splitlines()), start=2):
        yield number, {key.strip(): value for key, value in row.items() if key is not None}


def _time(path: Path, line: int, row: dict[str, Any]) -> float:
    key = next((k for k in TIME_KEYS if row.get(k) not in (None, "")), None)
    if key is None:
        raise PlanInputError(f"{path}:{line}: no arrival time (one of: {', '.join(TIME_KEYS)})")
    return _number(path, line, key, row[key]) * TIME_KEYS[key]


def _length(path: Path, line: int, row: dict[str, Any], keys: Sequence[str], required: bool) -> int:
    key = next((k for k in keys if row.get(k) not in (None, "")), None)
    if key is None:
        if required:
            raise PlanInputError(f"{path}:{line}: no input length (one of: {', '.join(keys)})")
        return 0
    value = _number(path, line, key, row[key])
    if value < (1 if required else 0) or value != int(value):
        raise PlanInputError(f"{path}:{line}: {key}: expected a whole number of tokens, got {row[key]!r}")
    return int(value)


def _number(path: Path, line: int, key: str, raw: object) -> float:
    try:
        value = float(raw)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise PlanInputError(f"{path}:{line}: {key}: expected a number, got {raw!r}") from None
    if isinstance(raw, bool) or not math.isfinite(value):
        raise PlanInputError(f"{path}:{line}: {key}: expected a number, got {raw!r}")
    return value
