"""Worker choice and prefill path: pure functions of a frozen snapshot (no I/O, no clock)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from services.scheduling.routing import choose_prefill_site


@dataclass(frozen=True, slots=True)
class WorkerView:
    name: str
    healthy: bool
    role: str = "both"
    cluster: str = "local"
    generates: bool = True
    prefills: bool = False
    receives_kv: bool = False
    num_in_flight: int = 0
    num_active: int = 0
    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0

    @property
    def load(self) -> int:
        return max(self.num_in_flight, self.num_active, self.num_running + self.num_waiting)


@dataclass(frozen=True, slots=True)
class Route:
    """``local``: the decode worker prefills itself; ``pd``: a local prefill-role worker streams the
    KV to it; ``prfaas``: a PrfaaS-cluster prefill worker streams the KV across clusters."""

    path: Literal["local", "pd", "prfaas"]
    decode: str
    prefill: str | None = None


def pick_least_loaded(workers: tuple[WorkerView, ...], exclude: frozenset[str] = frozenset()) -> str | None:
    """The healthy generating worker with the least load (then KV usage, then name); None if none."""
    return _least_loaded([w for w in workers if w.generates and w.name not in exclude])


def choose_route(workers: tuple[WorkerView, ...], incremental_prefill_tokens: int, threshold_tokens: int,
                 exclude: frozenset[str] = frozenset()) -> Route | None:
    """Decode worker first (load-aware), then where its prompt is prefilled. None: nothing can serve."""
    decode_name = pick_least_loaded(workers, exclude)
    if decode_name is None:
        return None
    decode = next(w for w in workers if w.name == decode_name)
    prfaas = _least_loaded([w for w in workers if w.prefills and w.cluster == "prfaas"]) if decode.receives_kv else None
    if choose_prefill_site(incremental_prefill_tokens, threshold_tokens, prfaas is not None) == "prfaas":
        return Route("prfaas", decode_name, prfaas)
    if decode.receives_kv and decode.role == "decode":
        candidates = [w for w in workers if w.prefills and w.cluster == "local" and w.role == "prefill"]
        if prefill := _least_loaded(candidates):
            return Route("pd", decode_name, prefill)
    return Route("local", decode_name)


def _least_loaded(candidates: list[WorkerView]) -> str | None:
    healthy = [w for w in candidates if w.healthy]
    if not healthy:
        return None
    return min(healthy, key=lambda w: (w.load, w.kv_cache_usage, w.name)).name
