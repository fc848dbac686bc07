"""The rows of bench/sim_vs_real.py: a load's runs pooled, their errors with intervals, the verdict, the table.

A load may run several times (segments, each drained before the next) until the intervals of the
figures it tests are narrow enough; a row pools its segments request by request. Throughput and mean
TTFT are compared per request (the simulator replays the very requests sent): their interval is a
block bootstrap of the relative error (``_intervals``). Past the knee the load's runs are independent
replications, and the throughput's interval is Student's t over the runs' own errors instead. The
offloaded fraction is the same routing rule applied to the same prompts on both sides, so its error
carries no sampling noise; its interval is the measured share's own (Wilson), for what it would be
against other requests of the same load.
"""
from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass

from _intervals import Interval, paired_error_interval, proportion_interval, replication_interval

TARGETS = {"throughput": 0.10, "offloaded_fraction": 0.10, "ttft_mean": 0.25}
WELL_INSIDE = 0.5               # a tested figure's interval half-width at most this share of its tolerance
GROWING = 1.0                   # requests: mean queue late in the window minus early, to call it growing
WARMUP_FRACTION = 0.1           # the throughput window starts after this share of the arrival window


@dataclass(frozen=True, slots=True)
class PerRequest:
    """One side of one segment, request by request in arrival order."""
    ttfts: list[float]
    done: list[int]     # 1 where the request's last token came inside the throughput window
    window_s: float     # the arrival window
    span_s: float       # the throughput window: the arrival window after its first 10%

    @classmethod
    def of(cls, arrivals: list[float], ttfts: list[float], finishes: list[float]) -> "PerRequest":
        window = max(arrivals)
        begin = WARMUP_FRACTION * window
        return cls(list(ttfts), [int(begin < f <= window) for f in finishes], window, window - begin)

    @property
    def throughput(self) -> float:
        return sum(self.done) / self.span_s if self.span_s else 0.0


@dataclass(frozen=True, slots=True)
class Segment:
    measured: dict
    predicted: dict
    real: PerRequest
    sim: PerRequest
    replay: tuple = ()   # the requests sent, (arrival s, prompt tokens): the simulator replays them again


def tested(index: int, num_rows: int) -> list[str]:
    """The figures held to their tolerance at the ``index``-th load: mean TTFT only below the knee."""
    return ["throughput", "offloaded_fraction"] + (["ttft_mean"] if index < num_rows - 1 else [])


def pooled_row(share: float, offered_rate: float, segments: list[Segment], replications: bool = False) -> dict:
    """The load's figures over its runs; with ``replications`` (independent runs, at least two) the
    throughput's interval is over the runs (``replication_interval``), else request by request."""
    counts = [seg.measured["requests"] for seg in segments]
    total = sum(counts)
    real = [seg.real for seg in segments]
    sim = [seg.sim for seg in segments]

    def weighted(side: str, key: str) -> float:
        return sum(getattr(seg, side)[key] * n for seg, n in zip(segments, counts)) / total

    def side(name: str, per: list[PerRequest]) -> dict:
        return {"throughput": sum(sum(p.done) for p in per) / sum(p.span_s for p in per),
                "offloaded_fraction": weighted(name, "offloaded_fraction"),
                "ttft_mean": statistics.fmean(t for p in per for t in p.ttfts),
                "queue_growth": weighted(name, "queue_growth")}

    measured = {**side("measured", real), "requests": total, "rate": total / sum(p.window_s for p in real)}
    predicted = side("predicted", sim)
    by_runs = replications and len(segments) >= 2 and all(sum(p.done) for p in real)
    intervals = {
        "throughput": replication_interval([sum(p.done) for p in real], [sum(p.done) for p in sim]) if by_runs
        else paired_error_interval([d for p in real for d in p.done], [d for p in sim for d in p.done]),
        "ttft_mean": paired_error_interval([t for p in real for t in p.ttfts], [t for p in sim for t in p.ttfts]),
        "offloaded_fraction": proportion_interval(measured["offloaded_fraction"], total)}
    return {"share": share, "offered_rate": offered_rate, "segments": len(segments), "measured": measured,
            "predicted": predicted, "intervals": {key: asdict(value) for key, value in intervals.items()},
            "throughput_interval": "t over runs" if by_runs else "block bootstrap"}


def too_wide(row: dict, keys: list[str]) -> list[str]:
    """The paired figures among ``keys`` whose interval is not yet well inside their tolerance."""
    return [key for key in keys if key != "offloaded_fraction"
            and Interval(**row["intervals"][key]).half_width > WELL_INSIDE * TARGETS[key]]


def enough_runs(runs: int, wide: list[str], least: int, most: int) -> bool:
    """Whether a load has run enough: ``most`` runs, or at least ``least`` with no tested interval too wide."""
    return runs >= most or (runs >= least and not wide)


def compare(rows: list[dict]) -> tuple[float, list[str]]:
    """The worst ratio of error to its target (<= 1 passes) and what failed."""
    worst, failures = 0.0, []
    for index, row in enumerate(rows):
        real, sim = row["measured"], row["predicted"]
        for key in tested(index, len(rows)):
            error = abs(sim[key] - real[key]) / real[key] if real[key] else abs(sim[key])
            row.setdefault("errors", {})[key] = error
            worst = max(worst, error / TARGETS[key])
            if error > TARGETS[key]:
                failures.append(f"{key} at {row['share']:.2f}x the knee: predicted {sim[key]:.3f}, measured "
                                f"{real[key]:.3f} ({error:.0%} off, target {TARGETS[key]:.0%})")
    last = rows[-1]
    for side in ("measured", "predicted"):
        if last[side]["queue_growth"] < GROWING:
            failures.append(f"overload: the {side} queue does not grow ({last[side]['queue_growth']:+.1f} requests)")
    return worst, failures


def _error(interval: dict) -> str:
    return f"{interval['estimate']:>+6.1%} [{interval['low']:>+6.1%},{interval['high']:>+6.1%}]"


def table(rows: list[dict]) -> str:
    """Real and simulated figures per load; for throughput and mean TTFT the relative error of the
    prediction with its 95% interval, for the offloaded fraction the measured share's 95% interval."""
    lines = [f"{'load':>11} {'rate':>6} {'reqs':>5} | {'throughput req/s, error [95% CI]':^40} | "
             f"{'offloaded [95% CI]':^27} | {'mean TTFT s, error [95% CI]':^40} | {'queue growth':^13}",
             f"{'':>11} {'req/s':>6} {'':>5} | {'real':>7} {'sim':>7} {'':24} | {'real':>6} {'sim':>6} {'':13} | "
             f"{'real':>7} {'sim':>7} {'':24} | {'real':>6} {'sim':>6}"]
    for row in rows:
        real, sim, ci = row["measured"], row["predicted"], row["intervals"]
        offload = ci["offloaded_fraction"]
        lines.append(f"{row['share']:>6.2f}x kn {real['rate']:>6.3f} {real['requests']:>5} | "
                     f"{real['throughput']:>7.3f} {sim['throughput']:>7.3f} {_error(ci['throughput'])} | "
                     f"{real['offloaded_fraction']:>6.3f} {sim['offloaded_fraction']:>6.3f} "
                     f"[{offload['low']:.3f},{offload['high']:.3f}] | "
                     f"{real['ttft_mean']:>7.3f} {sim['ttft_mean']:>7.3f} {_error(ci['ttft_mean'])} | "
                     f"{real['queue_growth']:>+6.1f} {sim['queue_growth']:>+6.1f}")
    return "\n".join(lines)


def plot(rows: list[dict], path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, 3, figsize=(13, 4))
    rates = [row["measured"]["rate"] for row in rows]
    for axis, key, title in zip(axes, ("throughput", "offloaded_fraction", "ttft_mean"),
                                ("throughput (req/s)", "offloaded fraction", "mean TTFT (s)")):
        axis.plot(rates, [row["measured"][key] for row in rows], "o-", label="measured")
        axis.plot(rates, [row["predicted"][key] for row in rows], "s--", label="simulated")
        axis.set_xlabel("offered load (req/s)")
        axis.set_title(title)
        axis.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=110)
