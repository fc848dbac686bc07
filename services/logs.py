"""Logging set-up shared by every service: plain text or one JSON object per line.

A request keeps one id from the router to the workers (the router's id travels in every gRPC
call); ``bind_request_id`` tags the current task's log lines with it, so JSON lines of the router,
the prefill worker and the decode worker can be joined on ``request_id``.
"""
from __future__ import annotations

import json
import logging
import sys
import time
from contextvars import ContextVar

_REQUEST_ID: ContextVar[str | None] = ContextVar("prfaas_request_id", default=None)


def bind_request_id(request_id: str) -> None:
    """Tag the log lines of the current task (one HTTP request, one gRPC call) with ``request_id``."""
    _REQUEST_ID.set(request_id or None)

PLAIN_FORMAT = "%(asctime)s %(levelname)s [%(service)s] %(name)s: %(message)s"


class _ServiceFilter(logging.Filter):
    def __init__(self, service: str) -> None:
        super().__init__()
        self.service = service

    def filter(self, record: logging.LogRecord) -> bool:
        record.service = self.service
        return True


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "service": getattr(record, "service", ""),
            "logger": record.name,
            "message": record.getMessage(),
        }
        request_id = getattr(record, "request_id", None) or _REQUEST_ID.get()
        if request_id:
            entry["request_id"] = request_id
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry)


def setup_logging(service: str, level: str = "info", json_lines: bool = False) -> None:
    root = logging.getLogger()
    root.handlers[:] = [_handler(service, json_lines)]
    root.setLevel(level.upper())


def setup_package_logging(service: str, level: str = "info", json_lines: bool = False) -> None:
    """Log lines of the project's own modules inside a process another framework set up (the
    engine's worker processes, where only vLLM's loggers have handlers): same format and level as
    the service that started it. Does nothing where the root logger already has handlers."""
    if logging.getLogger().handlers:
        return
    package = logging.getLogger("services")
    package.handlers[:] = [_handler(service, json_lines)]
    package.setLevel(level.upper())
    package.propagate = False


def _handler(service: str, json_lines: bool) -> logging.Handler:
    handler = logging.StreamHandler(sys.stderr)
    handler.addFilter(_ServiceFilter(service))
    handler.setFormatter(JsonFormatter() if json_lines else logging.Formatter(PLAIN_FORMAT))
    return handler
