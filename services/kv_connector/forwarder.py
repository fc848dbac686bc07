"""Passing received KV on to the engine's other TP ranks that replicate it (``tp_routes``).

A consumer engine with more TP ranks than KV heads holds each head on several ranks; the head crosses
the link once, to one of them, which passes each frame on to the others over the host's loopback.
That rank must not send from its engine step: a send waits for room when the sibling's receiver is
full, the sibling empties its receiver only in its own next step, and vLLM starts that step only once
every rank, this one included, has finished the current one. So the sends run here, on a thread of
their own, in the order they were handed over (a stream's LAYOUT frame, its KV, then its end). What
waits here is at most the KV this rank received for the transfers it passes on.
"""
from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable

logger = logging.getLogger(__name__)


class Forwarder:
    def __init__(self) -> None:
        self._queue: queue.Queue[tuple[Callable[..., None], tuple] | None] = queue.Queue()
        self._thread: threading.Thread | None = None

    def put(self, send: Callable[..., None], *args) -> None:
        """Run ``send(*args)`` on the forwarding thread, after everything handed over before it."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, daemon=True, name="prfaas-kv-forward")
            self._thread.start()
        self._queue.put((send, args))

    def wait_idle(self) -> None:
        """Block until everything handed over so far has been sent (tests)."""
        self._queue.join()

    def close(self, timeout_s: float = 5.0) -> None:
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join(timeout_s)

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            send, args = item
            try:
                send(*args)
            except Exception:  # one failed hand-over must not stop the others
                logger.exception("passing KV on to a sibling TP rank failed")
            finally:
                self._queue.task_done()
        self._queue.task_done()
