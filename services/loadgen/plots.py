"""PNG plots of a result dict: latency CDFs and a timeline. matplotlib is imported only here, lazily."""
from __future__ import annotations

import logging
from pathlib import Path

import numpy as np

logger = logging.getLogger(__name__)

BIN_S = 1.0


def write_plots(result: dict, directory: Path) -> list[Path]:
    """Write `latency_cdf.png` and `timeline.png` into `directory`; [] (with a warning) without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        logger.warning("matplotlib is not installed; skipping plots (pip install matplotlib)")
        return []
    directory.mkdir(parents=True, exist_ok=True)
    paths = [_latency_cdf(plt, result, directory / "latency_cdf.png"),
             _timeline(plt, result, directory / "timeline.png")]
    plt.close("all")
    return paths


def successful(result: dict) -> list[int]:
    return [i for i, error in enumerate(result.get("errors", [])) if not error]


def tpots_ms(result: dict) -> list[float]:
    values = []
    for i in successful(result):
        tokens = result["output_lens"][i]
        if tokens > 1:
            values.append((result["e2els"][i] - result["ttfts"][i]) / (tokens - 1) * 1000.0)
    return values


def in_flight(result: dict) -> tuple[np.ndarray, np.ndarray]:
    """Step function of requests in flight: (times, counts after each time)."""
    events = [(s, 1) for s in result["start_times"]]
    events += [(s + e, -1) for s, e in zip(result["start_times"], result["e2els"])]
    events.sort()
    times = np.array([t for t, _ in events])
    counts = np.cumsum([d for _, d in events])
    return times, counts


def token_times(result: dict) -> np.ndarray:
    """When each streamed chunk arrived, in seconds from the start."""
    times = []
    for i in successful(result):
        first = result["start_times"][i] + result["ttfts"][i]
        times.append(first)
        times.extend(first + np.cumsum(result["itls"][i]))
    return np.array(times)


def _cdf(axis, values: list[float], title: str) -> None:
    if values:
        ordered = np.sort(values)
        axis.plot(ordered, np.arange(1, len(ordered) + 1) / len(ordered))
    axis.set_title(title)
    axis.set_xlabel("ms")
    axis.set_ylabel("fraction of requests")
    axis.grid(alpha=0.3)


def _latency_cdf(plt, result: dict, path: Path) -> Path:
    figure, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    _cdf(left, [result["ttfts"][i] * 1000.0 for i in successful(result)], "TTFT CDF")
    _cdf(right, tpots_ms(result), "TPOT CDF")
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    return path


def _timeline(plt, result: dict, path: Path) -> Path:
    figure, (top, bottom) = plt.subplots(2, 1, figsize=(10, 6), sharex=True)
    if result.get("start_times"):
        times, counts = in_flight(result)
        top.step(times, counts, where="post")
        stamps = token_times(result)
        if len(stamps):
            bins = np.arange(0.0, stamps.max() + BIN_S, BIN_S)
            histogram, edges = np.histogram(stamps, bins=bins)
            bottom.step(edges[:-1], histogram / BIN_S, where="post")
    top.set_ylabel("requests in flight")
    bottom.set_ylabel("output tokens/s (streamed)")
    bottom.set_xlabel("seconds since start")
    for axis in (top, bottom):
        axis.grid(alpha=0.3)
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    return path
