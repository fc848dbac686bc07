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
