"""Worker choice and prefill path; the policy lives in ``services.scheduling.placement`` (shared with
the simulator) and is re-exported here for the router."""
from __future__ import annotations

from services.scheduling.placement import (PromptCache, Route, WorkerView, choose_route, pick_least_loaded,
                                           pick_prefill)

__all__ = ["PromptCache", "Route", "WorkerView", "choose_route", "pick_least_loaded", "pick_prefill"]
