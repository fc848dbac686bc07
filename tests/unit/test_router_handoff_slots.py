"""A router's count of a prefill worker's hand-off slots between polls (``handoffs_held``): the other
routers' as of the worker's last stats answer, this router's own as they are now. One router frees
and retakes its own slots at once, with no stats call in between (before, every hand-off it started
since the last answer counted until the next one: one router could start no more than the limit per
stats call, where three could start three times that)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from services.router.workers import handoffs_held
from services.worker_api.types import WorkerStats


@pytest.mark.parametrize("reported, ours_then, ours_now, held", [
    (0, 0, 0, 0),
    (2, 2, 0, 0),   # one router: both of its hand-offs ended since the answer, both slots are free to it
    (2, 2, 1, 1),
    (2, 0, 0, 2),   # another router's two, as of the answer
    (2, 1, 2, 3),   # one of theirs, and two of ours now
    (1, 2, 0, 0),   # one of ours ended before the worker answered: never below zero for the others
])
def test_handoffs_held(reported, ours_then, ours_now, held):
    handle = SimpleNamespace(stats=WorkerStats(num_handoffs=reported, max_handoffs=2),
                             num_handoffs_open_at_poll=ours_then, num_handoffs_open=ours_now)
    assert handoffs_held(handle) == held
