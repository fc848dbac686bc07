"""Predicted decode load at a request's completion (admission, paper section 3.4.3).

A request admitted now holds KV for ``prompt + max_tokens`` tokens on its decode worker by the time
it finishes, and so do the requests already running there. A decode worker *fits* the request when,
with it added, its running requests stay within ``max_running`` and its predicted KV usage at
completion stays within ``kv_limit``:

    predicted = max(kv_usage now, committed tokens / capacity) + (prompt + max_tokens) / capacity

where ``committed`` is the router's count of the tokens its in-flight requests on that worker will
hold at completion (prompt + max_tokens each). A worker whose KV capacity in tokens is unknown (0)
is judged on running requests alone. Pure: no I/O, no clock.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class DecodeLoad:
    name: str
    num_running: int
    max_running: int
    kv_usage: float = 0.0
    num_committed_tokens: int = 0
    kv_capacity_tokens: int = 0

    def predicted_kv_usage(self, num_request_tokens: int) -> float | None:
        """KV usage at the request's completion; None when the capacity is unknown."""
        if self.kv_capacity_tokens <= 0:
            return None
        held = max(self.kv_usage, self.num_committed_tokens / self.kv_capacity_tokens)
        return held + num_request_tokens / self.kv_capacity_tokens

    def fits(self, num_request_tokens: int, kv_limit: float) -> bool:
        if self.num_running + 1 > self.max_running:
            return False
        predicted = self.predicted_kv_usage(num_request_tokens)
        return predicted is None or predicted <= kv_limit


def decode_overload(workers: tuple[DecodeLoad, ...], num_request_tokens: int, kv_limit: float) -> str | None:
    """None when some decode worker fits the request; otherwise why none does (for the 429 message)."""
    if any(w.fits(num_request_tokens, kv_limit) for w in workers):
        return None
    if not workers:
        return "no decode worker reports its load"
    best = min(workers, key=lambda w: (w.predicted_kv_usage(num_request_tokens) or 0.0, w.num_running))
    predicted = best.predicted_kv_usage(num_request_tokens)
    kv = f", predicted KV usage at completion {predicted:.0%} (limit {kv_limit:.0%})" if predicted is not None else ""
    return (f"no decode worker can take {num_request_tokens} more KV tokens: least loaded {best.name} runs "
            f"{best.num_running}/{best.max_running} requests{kv}")
