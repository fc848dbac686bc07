"""Layout negotiation, the router's half (issue 19): every worker announces its KV layout in its
stats; for each (prefill worker, decode worker) pair the router maps the two once per change of
either announcement, and never routes a prefill to a worker whose layout it cannot reach. A refused
pair is logged once, exported as a gauge and listed in ``/health``; its prompts prefill elsewhere
(locally when no prefill worker can feed the decode worker).

Verdicts: ``mappable``; ``unmappable`` (the two speak different versions of the KV wire protocol,
as in a rolling upgrade; or ``plan_mapping`` found no mapping, or found one that the KV data
path cannot carry yet, ``data_path_problem``: TP sizes must be equal; block sizes may differ between
two of vLLM's CPU engines, whose consumer re-blocks what it receives);
``unknown`` (a side announced nothing, or something this router cannot read): allowed, as before
layouts were announced, and the per-transfer layout fingerprint check stays the backstop.
"""
from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from functools import lru_cache
from typing import Literal

from services.kv_connector.layouts.mapping import Unmappable, data_path_problem, plan_mapping
from services.kv_connector.layouts.spec import LayoutSpec
from services.router.metrics import RouterMetrics

logger = logging.getLogger(__name__)

Verdict = Literal["mappable", "unmappable", "unknown"]


@dataclass(frozen=True, slots=True)
class PairVerdict:
    prefill: str
    decode: str
    verdict: Verdict
    reason: str = ""

    def as_dict(self) -> dict[str, str]:
        return {"prefill": self.prefill, "decode": self.decode, "verdict": self.verdict, "reason": self.reason}


@dataclass(frozen=True, slots=True)
class Announcement:
    """What a worker's stats say about its KV: its rank-0 LayoutSpec (empty: none announced) and the
    KV wire protocol version it speaks (0: not announced)."""
    layout_spec: bytes = b""
    kv_protocol_version: int = 0


def judge(producer: Announcement, consumer: Announcement) -> tuple[Verdict, str]:
    """The verdict on a producer's and a consumer's announcements."""
    versions = producer.kv_protocol_version, consumer.kv_protocol_version
    if all(versions) and versions[0] != versions[1]:
        return "unmappable", (f"the prefill worker speaks KV protocol version {versions[0]}, the decode worker "
                              f"{versions[1]} (upgrade both)")
    return judge_layouts(producer.layout_spec, consumer.layout_spec)


@lru_cache(maxsize=256)
def judge_layouts(producer: bytes, consumer: bytes) -> tuple[Verdict, str]:
    """The verdict on a producer's and a consumer's announced rank-0 specs (empty: none announced)."""
    specs = []
    for side, payload in (("prefill", producer), ("decode", consumer)):
        if not payload:
            return "unknown", f"the {side} worker announces no layout"
        try:
            specs.append(LayoutSpec.from_bytes(payload))
        except ValueError as error:
            return "unknown", f"the {side} worker's layout is unreadable here: {error}"
    src, dst = specs
    result = plan_mapping(_ranks(src), _ranks(dst))
    if isinstance(result, Unmappable):
        return "unmappable", result.reason
    problem = data_path_problem(result, src, dst)
    return ("mappable", "") if problem is None else ("unmappable", problem)


def _ranks(spec: LayoutSpec) -> list[LayoutSpec]:
    return [spec.for_rank(rank) for rank in range(spec.tp_size)]


class LayoutNegotiation:
    """The verdict on every pair of workers that announced layouts. ``update`` is called by the
    worker pool after each poll, on the event loop; it does not block (a verdict is a pure function
    of two announcements, cached)."""

    def __init__(self, metrics: RouterMetrics) -> None:
        self._metrics = metrics
        self._pairs: dict[tuple[str, str], PairVerdict] = {}
        self._refused: dict[str, frozenset[str]] = {}

    @property
    def pairs(self) -> tuple[PairVerdict, ...]:
        return tuple(self._pairs[key] for key in sorted(self._pairs))

    def refused(self, prefill: str) -> frozenset[str]:
        """The decode workers ``prefill`` must not send KV to."""
        return self._refused.get(prefill, frozenset())

    def update(self, producers: Mapping[str, Announcement], consumers: Mapping[str, Announcement]) -> None:
        """Judge each pair of a producer and a consumer (other than itself) from their latest
        announcements; pairs with a worker absent here keep their last verdict."""
        for prefill, produced in producers.items():
            for decode, consumed in consumers.items():
                if prefill != decode:
                    self._record(PairVerdict(prefill, decode, *judge(produced, consumed)))
        unmappable = [pair for pair in self._pairs.values() if pair.verdict == "unmappable"]
        self._refused = {prefill: frozenset(p.decode for p in unmappable if p.prefill == prefill)
                         for prefill in {p.prefill for p in unmappable}}
        self._export(len(unmappable))

    def _record(self, pair: PairVerdict) -> None:
        key = (pair.prefill, pair.decode)
        previous = self._pairs.get(key)
        self._pairs[key] = pair
        if previous == pair:
            return
        if pair.verdict == "unmappable":
            logger.warning("KV layouts of prefill worker %s and decode worker %s do not map: %s; no KV goes from "
                           "one to the other (their prompts prefill elsewhere)", pair.prefill, pair.decode, pair.reason)
        elif pair.verdict == "unknown":
            logger.info("KV layouts of prefill worker %s and decode worker %s unknown (%s); KV may go from one to "
                        "the other", pair.prefill, pair.decode, pair.reason)
        elif previous is not None:
            logger.info("KV layouts of prefill worker %s and decode worker %s map now", pair.prefill, pair.decode)

    def _export(self, num_unmappable: int) -> None:
        for pair in self._pairs.values():
            self._metrics.layout_pair_unmappable.labels(pair.prefill, pair.decode).set(pair.verdict == "unmappable")
        self._metrics.layout_unmappable_pairs.set(num_unmappable)
