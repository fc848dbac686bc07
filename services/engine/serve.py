"""Process runtime shared by both worker services: gRPC server, health, engine, shutdown.

The engine starts first (its start blocks the process for ~20 s with a tiny model on CPU, minutes
with a large one on a GPU), then the gRPC server binds and reports SERVING on the standard health
service: vLLM may fork its engine-core process from the worker's, and gRPC's core does not survive
a fork, so the worker starts no gRPC before it. Orchestrators probe start-up with a startup probe
(refused connections until then); the ports are checked free before the engine loads. SIGTERM or
SIGINT stops accepting new calls and gives in-flight ones ``grace_s`` to finish (during the engine's
start: once it is up).
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import socket
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from vllm.utils.gc_utils import freeze_gc_heap

from services.config import DeploymentConfig, WorkerConfig
from services.engine.args import engine_args, kv_transfer_config
from services.engine import ipc_dir, shm_ledger
from services.engine.cpus import confine_worker, engine_core_forks, model_in_engine_core
from services.engine.engine import Engine
from services.engine.prefix_events import PrefixCacheIndex, follow_engine_events
from services.engine.worker_state import HandoffSlots, RoleState
from services.security import GrpcSecurity, KnownPeers, Rejections
from services.security.peers import decode_kv_targets

logger = logging.getLogger(__name__)

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
ENGINE_WATCH_INTERVAL_S = 2.0


@dataclass(frozen=True, slots=True)
class WorkerIdentity:
    worker_name: str
    service: str
    role: str
    model: str

    @classmethod
    def of(cls, config: DeploymentConfig, worker: WorkerConfig) -> "WorkerIdentity":
        return cls(worker.name, worker.service, worker.role, config.model.name)


@dataclass(frozen=True, slots=True)
class CallerGuard:
    """What a worker's servicers enforce beyond the token check: the KV targets a Prefill may name,
    the count of refused calls (reported in ``WorkerStats.grpc_rejected``), and the state every router
    must agree on: the run-time role (``SetRole``) and the hand-off slots."""
    kv_targets: KnownPeers
    rejections: Rejections
    roles: RoleState = field(default_factory=lambda: RoleState("both"))
    handoffs: HandoffSlots = field(default_factory=lambda: HandoffSlots(0))
    prefix_cache: PrefixCacheIndex | None = None  # what the engine's prefix cache holds (WatchPrefixCache)


AddServicer = Callable[[Engine, WorkerIdentity, grpc.aio.Server, CallerGuard], str]


async def serve_worker(
    config: DeploymentConfig, worker: WorkerConfig, add_servicer: AddServicer, grace_s: float = 30.0
) -> None:
    """Run one worker until SIGTERM/SIGINT. ``add_servicer`` registers the service, returns its name."""
    confine_worker()
    fork_core = engine_core_forks(model_in_engine_core(config.engine_for(worker).tensor_parallel_size))
    _check_free(worker.host, [worker.port, worker.health_port])
    ipc = ipc_dir.prepare()
    events_endpoint = f"ipc://{ipc}/kv-events"  # the worker's private directory: no other user connects
    engine = Engine(engine_args(config.model_for(worker), config.engine_for(worker),
                                kv_transfer_config=kv_transfer_config(config, worker, stats_dir=ipc),
                                kv_events_endpoint=events_endpoint),
                    stats_dir=ipc, fork_core=fork_core)
    ledger = shm_ledger.ledger_path(worker.name, worker.host, worker.port)
    shm_ledger.sweep(ledger)
    server = probes = events = None
    try:
        # The engine first: vLLM may fork its engine-core process from this one (always on a GPU host,
        # and here where engine_core_forks), which must not have started gRPC's threads by then.
        logger.info("%s %s starting engine", worker.service, worker.name)
        with _signals_held() as asked:
            await engine.start()
            stop = _stop_event()  # the event loop's handlers from now on: the engine core is started
        if asked:
            return
        shm_ledger.record(ledger)
        # What start-up built (vLLM, torch, the tokenizer: millions of objects) stays for the process's
        # life: frozen, the collector skips it while serving, as vLLM's own API server does once it is up,
        # and at exit (a full collection of it kept a stopping worker's process 1-2.6 s past its last log
        # line on the 2-core machine; 0.3 s frozen).
        freeze_gc_heap()
        security = GrpcSecurity.of(config)
        guard = CallerGuard(decode_kv_targets(config), Rejections(worker.name), RoleState(worker.role),
                            HandoffSlots(config.router.max_handoffs_per_prefill_worker),
                            PrefixCacheIndex() if config.engine_for(worker).enable_prefix_caching else None)
        if guard.prefix_cache is not None:  # subscribed before the engine serves anything
            events = asyncio.create_task(follow_engine_events(guard.prefix_cache, events_endpoint))
        server = grpc.aio.server(options=security.options, interceptors=security.aio_interceptors(guard.rejections))
        health_servicer = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
        service_name = add_servicer(engine, WorkerIdentity.of(config, worker), server, guard)
        address = f"{worker.host}:{worker.port}"
        if security.add_port(server, address) == 0:
            raise OSError(f"cannot bind gRPC port {address}")
        await _set_health(health_servicer, service_name, SERVING)
        probes = await _start_health_port(health_servicer, worker.host, worker.health_port, security)
        await server.start()
        logger.info("%s %s ready: listening on %s (%s)", worker.service, worker.name, address, _describe(security))
        await _watch_engine(engine, stop)
        await _set_health(health_servicer, service_name, NOT_SERVING)
        logger.info("%s %s stopping: draining for up to %.0f s", worker.service, worker.name, grace_s)
        await server.stop(grace_s)
    finally:
        if events is not None:
            events.cancel()
            await asyncio.gather(events, return_exceptions=True)
        if server is not None:
            await server.stop(0)
        if probes is not None:
            await probes.stop(0)
        engine.shutdown()
        ipc_dir.remove(ipc)
        shm_ledger.forget(ledger)
        logger.info("%s %s stopped", worker.service, worker.name)


def _check_free(host: str, ports: list[int | None]) -> None:
    """Fail at once, not after the engine loaded, when another process listens on a port the worker
    will serve (the gRPC server binds only once the engine is up)."""
    host = host.strip("[]")
    for port in ports:
        if not port:
            continue
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as gRPC binds: past TIME_WAIT
            try:
                probe.bind((host, port))
            except OSError as exc:
                raise OSError(f"cannot bind {host}:{port}: {exc.strerror}") from exc


@contextlib.contextmanager
def _signals_held():
    """SIGTERM and SIGINT while the engine starts (which blocks the event loop) are remembered, in the
    list this yields, and acted on once it is up. Plain handlers, not the event loop's: a process
    forked meanwhile (vLLM's engine core) must not inherit the loop's wakeup socket, through which its
    own signals would reach this process's loop. On leaving, a handler installed meanwhile (the loop's)
    stays; the earlier one comes back where none was."""
    asked: list[int] = []

    def hold(signum, frame) -> None:
        asked.append(signum)

    previous = {sig: signal.signal(sig, hold) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield asked
    finally:
        for sig, handler in previous.items():
            if signal.getsignal(sig) is hold:
                signal.signal(sig, handler)


async def _start_health_port(servicer: health.aio.HealthServicer, host: str, port: int | None,
                             security: GrpcSecurity) -> grpc.aio.Server | None:
    """A plaintext server with nothing but the health service (``health_port``), for probes that
    cannot do TLS; it shares the main server's health states."""
    if port is None:
        return None
    probes = grpc.aio.server(options=security.options)
    health_pb2_grpc.add_HealthServicer_to_server(servicer, probes)
    if probes.add_insecure_port(f"{host}:{port}") == 0:
        raise OSError(f"cannot bind health port {host}:{port}")
    await probes.start()
    return probes


def _describe(security: GrpcSecurity) -> str:
    parts = ["mutual TLS" if security.uses_tls else "plaintext",
             "bearer token required" if security.checks_token else "NO token check"]
    return ", ".join(parts)


async def _watch_engine(engine: Engine, stop: asyncio.Event) -> None:
    """Return when asked to stop; raise if the engine dies."""
    while not stop.is_set():
        try:
            await asyncio.wait_for(stop.wait(), ENGINE_WATCH_INTERVAL_S)
        except TimeoutError:
            await engine.check_health()


async def _set_health(servicer: health.aio.HealthServicer, service_name: str, status) -> None:
    await servicer.set("", status)
    await servicer.set(service_name, status)


def _stop_event() -> asyncio.Event:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    return stop
