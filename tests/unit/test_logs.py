"""JSON log lines carry the id of the request whose task wrote them."""
from __future__ import annotations

import asyncio
import json
import logging

from services.logs import JsonFormatter, bind_request_id


def test_each_task_tags_its_own_lines():
    records: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(self.format(record))

    handler = Collect()
    handler.setFormatter(JsonFormatter())
    logger = logging.getLogger("prfaas-test-request-ids")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)

    async def serve(request_id: str) -> None:
        bind_request_id(request_id)
        for step in range(3):
            logger.info("step %d of %s", step, request_id)
            await asyncio.sleep(0)

    async def main() -> None:
        await asyncio.gather(serve("req-a"), serve("req-b"))
        logger.info("outside any request")

    try:
        asyncio.run(main())
    finally:
        logger.removeHandler(handler)
    lines = [json.loads(r) for r in records]
    assert len(lines) == 7
    for line in lines[:-1]:
        assert line["message"].endswith(line["request_id"])
    assert "request_id" not in lines[-1]


def test_the_connector_logs_in_the_engines_processes_in_the_workers_format():
    """vLLM's worker processes give only vLLM's loggers a handler: the project's lines would reach
    Python's last-resort handler (warnings only, no format) without ``setup_package_logging``."""
    import subprocess
    import sys

    code = ("import logging; from services.logs import setup_package_logging\n"
            "setup_package_logging('pd-d', 'debug')\n"
            "logging.getLogger('services.kv_connector.worker').debug('request r1: KV received')\n"
            "logging.getLogger('vllm').warning('not ours')\n")
    err = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stderr
    assert "DEBUG [pd-d] services.kv_connector.worker: request r1: KV received" in err
    assert "[pd-d]" not in err.split("KV received", 1)[1]  # other loggers are left as they were
