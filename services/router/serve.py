"""Router process: load config, connect to workers, serve HTTP until SIGTERM/SIGINT."""
from __future__ import annotations

import asyncio
import os
import logging
import signal

from aiohttp import web

from services.cache_pool_client.index import GlobalCacheIndex
from services.config import DeploymentConfig
from services.engine.args import resolve_model_path
from services.router.tools import ToolCalls
from services.router.admission import AdmissionControl, PrefillQueues
from services.router.app import RouterApp
from services.router.dispatch import Dispatcher
from services.router.leadership import Fixed, KubernetesLease, Leadership
from services.router.metrics import RouterMetrics
from services.router.placement import Placement
from services.router.prefix_index import PrefixWatch
from services.router.role_control import RoleControl
from services.router.threshold_control import ThresholdControl
from services.router.tokenizer import PromptTokenizer
from services.router.workers import WorkerPool
from services.scheduling.backoff import BackoffConfig
from services.scheduling.congestion import FixedThreshold
from services.procs import LAUNCHER_STATS
from services.security import GrpcSecurity

logger = logging.getLogger(__name__)

SHUTDOWN_GRACE_S = 5.0  # for the HTTP server's own close, once the router has drained (router.drain_timeout_s)


def api_keys(config: DeploymentConfig) -> frozenset[str]:
    return config.router.accepted_api_keys


async def serve_router(config: DeploymentConfig, host: str, port: int, replica: int = 0) -> None:
    """``replica``: this router's number among several in front of the same workers (0 for one)."""
    metrics = RouterMetrics()
    tokenizer = await asyncio.to_thread(PromptTokenizer, resolve_model_path(config.model))
    tool_calls = ToolCalls(config.model.tool_parser, resolve_model_path(config.model))
    tool_calls.check()
    scheduler = config.scheduler
    pool = WorkerPool(config.workers, config.router, metrics,
                      BackoffConfig(scheduler.worker_backoff_s, scheduler.max_worker_backoff_s),
                      flippable=scheduler.role_flips.enabled, kv_high_watermark=scheduler.kv_high_watermark,
                      security=GrpcSecurity.of(config),
                      tp_sizes={w.name: config.engine_for(w).tensor_parallel_size for w in config.workers})
    queues = PrefillQueues(scheduler.prefill_tokens_per_s, metrics)
    index = GlobalCacheIndex.from_config(config, scheduler.cache_lookup_timeout_ms / 1000) \
        if config.cache_pools else None
    control = _threshold_control(config, pool, metrics, queues)
    threshold = control.controller if control else FixedThreshold(scheduler.offload_threshold_tokens)
    placement = Placement(config, pool, metrics, index, threshold=threshold)
    dispatcher = Dispatcher(pool, config.router, metrics, placement, queues, tokenizer.continuation_text)
    if control is not None:
        pool.on_poll.append(control.on_poll)
        if control.reoptimizer is not None:
            dispatcher.on_request.append(control.reoptimizer.record_request)
    leadership = _leadership(config, replica)
    if scheduler.role_flips.enabled:
        pool.on_poll.append(RoleControl(config, pool, metrics, placement.affinity, leadership=leadership).on_poll)
    admission = None
    if config.scheduler.admission_control:
        admission = AdmissionControl(config, pool, queues, metrics)
    router = RouterApp(
        model_name=config.model.name,
        max_model_len=config.model.max_model_len,
        max_body_bytes=config.router.body_limit(config.model.max_model_len),
        max_sequences=config.router.max_sequences_per_request,
        max_structured_bytes=config.router.max_structured_output_bytes,
        api_keys=api_keys(config),
        tokenizer=tokenizer,
        pool=pool,
        dispatcher=dispatcher,
        metrics=metrics,
        admission=admission,
        tool_calls=tool_calls,
    )
    if stats := os.environ.get(LAUNCHER_STATS):
        metrics.read_launcher_stats(stats)
    runner = web.AppRunner(router.build(), handler_cancellation=True, access_log=None,
                           shutdown_timeout=SHUTDOWN_GRACE_S)
    await runner.setup()
    prefixes = PrefixWatch(pool, placement.prefix_index, retry_s=config.router.stats_interval_s)
    prefixes.start()
    if isinstance(leadership, KubernetesLease):
        leadership.start()
    await pool.start()
    try:
        await web.TCPSite(runner, host, port).start()
        logger.info("router listening on http://%s:%d (model %s, %d workers, auth %s)", host, port,
                    config.model.name, len(config.workers), "on" if router.api_keys else "off")
        await _wait_for_signal()
        await router.drain.run(config.router.drain_timeout_s)
        logger.info("router stopping")
    finally:
        await runner.cleanup()
        await prefixes.close()
        if isinstance(leadership, KubernetesLease):
            await leadership.close()
        await pool.close()
        await placement.close()
        if index is not None:
            await index.close()


def _leadership(config: DeploymentConfig, replica: int) -> Leadership:
    """Who makes role decisions among several routers (router.role_decisions)."""
    if config.router.role_decisions == "kubernetes-lease":
        return KubernetesLease(config.router.lease_name, config.router.lease_duration_s)
    return Fixed(replica == 0)


def _threshold_control(config: DeploymentConfig, pool: WorkerPool, metrics: RouterMetrics,
                       queues: PrefillQueues) -> ThresholdControl | None:
    """The owner of the adaptive threshold, or None when it stays at ``scheduler.offload_threshold_tokens``."""
    for gauge in (metrics.threshold, metrics.threshold_base, metrics.threshold_ceiling):
        gauge.set(config.scheduler.offload_threshold_tokens)
    has_prfaas = any(w.service == "prefill_worker" and w.cluster == "prfaas" for w in config.workers)
    if config.scheduler.adaptive_threshold and has_prfaas:
        return ThresholdControl(config, pool, metrics, queues=queues)
    return None


async def _wait_for_signal() -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
