"""The benchmarks' last lines, read back: figure, target, baseline and verdict, and the table of a run.

Every benchmark ends with one headline, ``_common.verdict``'s form or one close to it:

    <what>: <figure> (<detail>)[; baseline <baseline>]; target <target>: PASS|FAIL

The figure is the first number after the name; the target is what follows ``target`` up to the
verdict; the baseline, where a benchmark names one, what follows ``baseline``. A line that does not
fit still makes a row, with the figure unknown and the exit status deciding. Pure functions only:
bench/run_all.py runs the benchmarks and writes what these return.
"""
from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass
from pathlib import Path

RUN_NAME = re.compile(r"^\d{8}-\d{6}$")  # bench/results/<run>.json, e.g. 20261127-213000
FIGURE = re.compile(r"[-+]?(?:\d[\d,]*\.?\d*|\.\d+)(?:[eE][-+]?\d+)?")
TARGET = re.compile(r"target (?P<target>.+?):\s*(?P<verdict>PASS|FAIL)\s*$")
BASELINE = re.compile(r"\bbaseline (?P<baseline>[^;]+)")


@dataclass(frozen=True, slots=True)
class Result:
    name: str
    exit_code: int
    seconds: float
    last_line: str
    figure: float | None = None
    target: str = ""
    baseline: str = ""
    verdict: str = ""       # as printed; empty when the line has none

    @property
    def passed(self) -> bool:
        return self.exit_code == 0 and self.verdict != "FAIL"


def last_line(output: str) -> str:
    lines = [line for line in output.splitlines() if line.strip()]
    return lines[-1].strip() if lines else ""


def parse(name: str, exit_code: int, seconds: float, line: str) -> Result:
    """A benchmark's row from its last line of output and its exit status."""
    head, _, rest = line.partition(": ")
    figure = FIGURE.search(rest) if rest else None
    target = TARGET.search(line)
    baseline = BASELINE.search(line)
    value = float(figure.group().replace(",", "")) if figure and figure.group() not in "+-" else None
    return Result(name, exit_code, seconds, line, value, target["target"] if target else "",
                  baseline["baseline"].strip() if baseline else "", target["verdict"] if target else "")


def earlier_runs(results: Path, before: str) -> list[Path]:
    """The ``<run>.json`` files in ``results`` earlier than the run named ``before``, oldest first."""
    return sorted(p for p in results.glob("*.json") if RUN_NAME.match(p.stem) and p.stem < before)


def previous_figures(results: Path, before: str) -> dict[str, tuple[float | None, str]]:
    """Each benchmark's figure in the latest run earlier than ``before`` that ran it, with that run's
    name: a run of a few benchmarks by name (``--only``) leaves the others' last figures standing."""
    found: dict[str, tuple[float | None, str]] = {}
    for path in reversed(earlier_runs(results, before)):
        try:
            rows = json.loads(path.read_text())["results"]
        except (OSError, ValueError, KeyError):
            continue
        for row in rows:
            found.setdefault(row["name"], (row.get("figure"), path.stem))
    return found


def as_json(run: str, commit: str, results: list[Result], earlier: dict[str, tuple[float | None, str]]) -> str:
    return json.dumps({"run": run, "commit": commit,
                       "previous": {r.name: earlier[r.name][1] for r in results if r.name in earlier},
                       "results": [asdict(r) for r in results]}, indent=2)


def _number(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:,.0f}" if abs(value) >= 1000 else f"{value:.4g}"


def _cell(text: str) -> str:
    return (text or "-").replace("|", "\\|")


def table(run: str, commit: str, results: list[Result], earlier: dict[str, tuple[float | None, str]]) -> str:
    """The run as a markdown table: one row per benchmark, its figure in the latest earlier run beside it."""
    runs = sorted({earlier[r.name][1] for r in results if r.name in earlier}, reverse=True)
    since = f"previous figures from {', '.join(runs)}" if runs else "no previous run"
    lines = [f"# Benchmarks {run} (commit {commit}; {since})", "",
             "| benchmark | figure | previous | target | baseline | result | exit | time s |",
             "| --- | ---: | ---: | --- | --- | --- | ---: | ---: |"]
    for r in results:
        lines.append(f"| {r.name} | {_number(r.figure)} | {_number(earlier.get(r.name, (None, ''))[0])} | "
                     f"{_cell(r.target)} | {_cell(r.baseline)} | {'PASS' if r.passed else 'FAIL'} | {r.exit_code} | "
                     f"{r.seconds:.0f} |")
    lines += ["", f"{sum(r.passed for r in results)} of {len(results)} passed. Last lines:", ""]
    lines += [f"- {r.name}: `{r.last_line or '(no output)'}`" for r in results]
    return "\n".join(lines) + "\n"
