"""Cross-cluster bandwidth traces: ``(time_s, gbps)`` steps, from a string or a file."""
from __future__ import annotations

from pathlib import Path


class TraceError(ValueError):
    pass


def parse_trace(text: str, duration_s: float | None = None) -> tuple[tuple[float, float], ...]:
    """Parse ``"0:100,300:10,600:100"`` (or the same as lines of a file, ``:``/``,``/space separated).

    A time ending in ``%`` is a fraction of ``duration_s`` (the expected length of the run), so
    ``"0:100,33%:10,67%:100"`` drops the link for the middle third of any run.
    """
    path = Path(text)
    if "\n" not in text and path.is_file():
        text = path.read_text()
    lines = [line.split("#", 1)[0] for line in text.splitlines()]
    items = [item for line in lines for item in line.split(",") if item.strip()]
    points = [_point(item, duration_s) for item in items]
    if not points:
        raise TraceError("bandwidth trace: no (time, gbps) points")
    if any(b[0] <= a[0] for a, b in zip(points, points[1:])):
        raise TraceError("bandwidth trace: times must be strictly increasing")
    return tuple(points)


def _point(item: str, duration_s: float | None) -> tuple[float, float]:
    fields = item.replace(":", " ").split()
    if len(fields) != 2:
        raise TraceError(f"bandwidth trace: expected TIME:GBPS, got {item.strip()!r}")
    time_text, gbps_text = fields
    try:
        if time_text.endswith("%"):
            if duration_s is None:
                raise TraceError("bandwidth trace: a time in % needs the run's duration")
            time_s = float(time_text[:-1]) / 100 * duration_s
        else:
            time_s = float(time_text)
        gbps = float(gbps_text)
    except ValueError:
        raise TraceError(f"bandwidth trace: expected numbers, got {item.strip()!r}") from None
    if time_s < 0 or gbps < 0:
        raise TraceError(f"bandwidth trace: time and bandwidth must be non-negative, got {item.strip()!r}")
    return time_s, gbps


def bandwidth_at(trace: tuple[tuple[float, float], ...], t: float, default_gbps: float) -> float:
    gbps = default_gbps
    for time_s, value in trace:
        if time_s > t:
            break
        gbps = value
    return gbps
