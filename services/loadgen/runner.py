"""`run_benchmark`: check the endpoint, build the workload, send it on schedule, summarize."""
from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Iterator
from datetime import datetime

import numpy as np

from services.loadgen.arrivals import gamma_arrivals, onoff_arrivals
from services.loadgen.client import EndpointError, OpenAIClient, RequestOutcome
from services.loadgen.config import BenchConfig
from services.loadgen.conversations import Conversations
from services.loadgen.metrics import summarize
from services.loadgen.progress import Progress
from services.loadgen.prompts import PromptBuilder, prompt_builder, tokenizer_source
from services.loadgen.router_metrics import is_router, router_deltas
from services.loadgen.workloads import RequestSpec, make_workload

logger = logging.getLogger(__name__)

WARMUP_SEED_OFFSET = 1_000_003


async def run_benchmark(config: BenchConfig, progress: Progress | None = None,
                        stop: asyncio.Event | None = None) -> dict:
    """Run one benchmark and return its result dict (never raises for endpoint or request errors).

    A setup failure (unreachable endpoint, unknown model) returns a result with `fatal_error` set and
    nothing measured; setting `stop` ends sending early and returns what was measured so far.
    """
    stop = stop or asyncio.Event()
    progress = progress or Progress(config.num_prompts, config.duration_s, enabled=False)
    header = _header(config)
    connections = config.max_concurrency or 0
    async with OpenAIClient(config.root_url, config.api_key, config.timeout_s, connections) as client:
        try:
            model = await resolve_model(client, config.model)
        except EndpointError as exc:
            return {**header, **summarize([], 0.0, config.slo, time.perf_counter()), "fatal_error": str(exc)}
        header["model_id"] = model
        builder = await asyncio.to_thread(_prompt_builder, config)
        header["tokenizer_id"] = builder.tokenizer.name_or_path
        sender = _Sender(client, config, model, builder, progress)
        await _until_stopped(_warm_up(config, builder, sender), stop)
        specs = await _planned_specs(config, builder)
        router_before = await client.get_text("/metrics") if config.scrape_router else None
        progress.start()
        outcomes, started, duration = await _drive(config, specs, sender, stop)
        progress.close()
        router_after = await client.get_text("/metrics") if is_router(router_before) else None
    result = {**header, **summarize(outcomes, duration, config.slo, started), "fatal_error": None,
              "interrupted": stop.is_set()}
    if router_after:
        result["router_metrics"] = router_deltas(router_before, router_after)
    return result


async def resolve_model(client: OpenAIClient, wanted: str | None) -> str:
    """The model to send: `wanted` if the server lists it, the only served model when none is given."""
    models = await client.list_models()
    if wanted is None:
        if len(models) == 1:
            return models[0]
        raise EndpointError(f"give --model; the server serves {', '.join(models) or 'no models'}")
    if wanted not in models:
        raise EndpointError(f"the server does not serve model {wanted!r}; it serves: {', '.join(models) or '(none)'}")
    return wanted


def _header(config: BenchConfig) -> dict:
    rate = config.request_rate
    return {
        "date": datetime.now().strftime("%Y%m%d-%H%M%S"),
        "backend": f"openai-{config.endpoint}",
        "base_url": config.base_url,
        "endpoint": config.endpoint,
        "model_id": config.model,
        "tokenizer_id": config.tokenizer,
        "dataset": config.workload.dataset,
        "num_prompts": config.num_prompts,
        "duration_limit_s": config.duration_s,
        "request_rate": "inf" if math.isinf(rate) else rate,
        "burstiness": config.burstiness,
        "arrivals": config.arrivals,
        "max_concurrency": config.max_concurrency,
        "warmup": config.warmup,
        "ignore_eos": config.ignore_eos,
        "seed": config.seed,
        "slo": config.slo.as_dict(),
    }


def _prompt_builder(config: BenchConfig) -> PromptBuilder:
    return prompt_builder(tokenizer_source(config.tokenizer, config.model))


class _Sender:
    """Turns specs into payloads (adding conversation history) and sends them."""

    def __init__(self, client: OpenAIClient, config: BenchConfig, model: str, builder: PromptBuilder,
                 progress: Progress) -> None:
        self.client = client
        self.config = config
        self.model = model
        self.builder = builder
        self.progress = progress
        self.conversations = Conversations(config.endpoint, builder)
        self.path = "/v1/chat/completions" if config.endpoint == "chat" else "/v1/completions"

    async def send(self, spec: RequestSpec, outcome: RequestOutcome, use_history: bool = True) -> None:
        try:
            history = await self.conversations.history(spec) if use_history else None
            prompt_fields, outcome.input_len = self.conversations.prompt(spec, history)
            await self.client.stream(self.path, self._payload(spec, prompt_fields), outcome)
        finally:
            if use_history:
                self.conversations.finish(spec, outcome.text if outcome.ok else "")
        if outcome.error:
            logger.debug("request %d: %s", spec.index, outcome.error)

    def _payload(self, spec: RequestSpec, prompt_fields: dict) -> dict:
        payload = {"model": self.model, **prompt_fields, "max_tokens": spec.output_len, "stream": True,
                   "stream_options": {"include_usage": True}}
        if self.config.ignore_eos:
            payload.update(ignore_eos=True)
        if self.config.temperature is not None:
            payload["temperature"] = self.config.temperature
        return payload


async def _warm_up(config: BenchConfig, builder: PromptBuilder, sender: _Sender) -> None:
    if not config.warmup:
        return
    rng = np.random.default_rng(config.seed + WARMUP_SEED_OFFSET)
    specs = _take(make_workload(config.workload, builder, rng, config.warmup), config.warmup)
    limit = asyncio.Semaphore(config.max_concurrency or config.warmup)

    async def one(spec: RequestSpec) -> RequestOutcome:
        async with limit:
            outcome = RequestOutcome(spec.index, spec.input_len, spec.output_len)
            await sender.send(spec, outcome, use_history=False)
            return outcome

    outcomes = await asyncio.gather(*(one(spec) for spec in specs))
    failed = [o for o in outcomes if not o.ok]
    if failed:
        logger.warning("%d of %d warm-up requests failed (first: %s)", len(failed), len(outcomes), failed[0].error)


async def _planned_specs(config: BenchConfig, builder: PromptBuilder) -> Iterator[RequestSpec]:
    """The measured requests: built before the clock starts when their number is known, else lazily."""
    specs = _take(make_workload(config.workload, builder, np.random.default_rng(config.seed), config.num_prompts),
                  config.num_prompts)
    if config.num_prompts is None:
        return specs
    return iter(await asyncio.to_thread(list, specs))


async def _drive(config: BenchConfig, specs: Iterator[RequestSpec], sender: _Sender,
                 stop: asyncio.Event) -> tuple[list[RequestOutcome], float, float]:
    """Send requests at their arrival times (and within the concurrency limit) until the count or time is up."""
    arrivals = _arrivals(config, np.random.default_rng([config.seed, 1]))
    limit = asyncio.Semaphore(config.max_concurrency) if config.max_concurrency else None
    outcomes: list[RequestOutcome] = []
    tasks: set[asyncio.Task] = set()
    started = time.perf_counter()
    deadline = started + config.duration_s if config.duration_s else math.inf
    try:
        for spec in specs:
            at = started + (spec.arrival_s if spec.arrival_s is not None else next(arrivals))
            if at >= deadline or not await _wait_until(at, stop):
                break
            if limit and not await _acquire(limit, stop):
                break
            if time.perf_counter() >= deadline:
                if limit:
                    limit.release()
                break
            outcome = RequestOutcome(spec.index, spec.input_len, spec.output_len, start=time.perf_counter())
            outcomes.append(outcome)
            tasks.add(asyncio.create_task(_run_one(sender, spec, outcome, limit)))
            sender.progress.sent()
        await _until_stopped(asyncio.gather(*tasks), stop)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    for outcome in outcomes:
        if not outcome.ok and not outcome.error:
            outcome.status, outcome.error = "cancelled", "cancelled: the benchmark was stopped"
    return outcomes, started, time.perf_counter() - started


async def _until_stopped(awaitable, stop: asyncio.Event) -> None:
    """Await `awaitable`, cancelling it if `stop` is set first."""
    work = asyncio.ensure_future(awaitable)
    stopped = asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait({work, stopped}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        stopped.cancel()
        if not work.done():
            work.cancel()
        await asyncio.gather(work, stopped, return_exceptions=True)


async def _run_one(sender: _Sender, spec: RequestSpec, outcome: RequestOutcome, limit: asyncio.Semaphore | None):
    try:
        await sender.send(spec, outcome)
    except Exception as exc:
        logger.exception("request %d: unexpected client error", spec.index)
        outcome.status, outcome.error = "client", f"client error: {exc!r}"
    finally:
        if limit:
            limit.release()
        sender.progress.done(outcome.ok, outcome.rejected)


def _arrivals(config: BenchConfig, rng: np.random.Generator) -> Iterator[float]:
    if config.arrivals == "onoff":
        return onoff_arrivals(config.request_rate, config.burstiness, config.on_s, config.off_s, rng)
    return gamma_arrivals(config.request_rate, config.burstiness, rng)


def _take(specs: Iterator[RequestSpec], count: int | None) -> Iterator[RequestSpec]:
    for number, spec in enumerate(specs):
        if count is not None and number >= count:
            return
        yield spec


async def _wait_until(when: float, stop: asyncio.Event) -> bool:
    """Sleep until perf_counter time `when`; False if `stop` was set first."""
    delay = when - time.perf_counter()
    if delay > 0:
        try:
            await asyncio.wait_for(stop.wait(), delay)
        except asyncio.TimeoutError:
            pass
    return not stop.is_set()


async def _acquire(limit: asyncio.Semaphore, stop: asyncio.Event) -> bool:
    acquire = asyncio.ensure_future(limit.acquire())
    stopped = asyncio.ensure_future(stop.wait())
    await asyncio.wait({acquire, stopped}, return_when=asyncio.FIRST_COMPLETED)
    stopped.cancel()
    if acquire.done() and not acquire.cancelled():
        if stop.is_set():
            limit.release()
            return False
        return True
    acquire.cancel()
    return False
