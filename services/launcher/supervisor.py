"""Start a deployment's services as child processes, wait for health, stop them all cleanly, in order."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.config import DeploymentConfig
from services.procs import group_alive, supervised_env
from services.security import GrpcSecurity

STOP_TIMEOUT_S = 40.0
GROUP_EXIT_S = 10.0  # after a service's main process exits, for the rest of its process group


ROUTER_STAGE, WORKER_STAGE, POOL_STAGE = 0, 1, 2  # the order in which `stop_all` stops services


@dataclass(slots=True)
class Child:
    name: str
    argv: list[str]
    log_path: Path
    process: subprocess.Popen | None = None
    log_file: object = field(default=None, repr=False)
    env: dict[str, str] = field(default_factory=dict, repr=False)  # added to this process' environment
    stage: int = ROUTER_STAGE

    def start(self) -> None:
        """Start (or, after it exited, start again) in a process group of its own."""
        if self.log_file is not None:
            self.log_file.close()
        self.log_file = open(self.log_path, "ab")
        self.process = subprocess.Popen(self.argv, stdout=self.log_file, stderr=subprocess.STDOUT,
                                        stdin=subprocess.DEVNULL, start_new_session=True,
                                        env={**os.environ, **self.env, **supervised_env()})

    @property
    def exited(self) -> bool:
        return self.process is not None and self.process.poll() is not None

    def log_tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def signal(self, sig: int) -> None:
        """``sig`` to the service's main process only: what it started (vLLM's engine core) is its to stop."""
        if self.process is not None and self.process.returncode is None:
            self.process.send_signal(sig)

    def signal_group(self, sig: int) -> None:
        if self.process is None:
            return
        try:
            os.killpg(self.process.pid, sig)
        except ProcessLookupError:
            pass

    @property
    def group_alive(self) -> bool:
        return self.process is not None and group_alive(self.process.pid)


def router_names(num_routers: int) -> list[str]:
    """``router`` for the first (as with one), ``router-1``, ``router-2``, ... for the others."""
    return ["router"] + [f"router-{i}" for i in range(1, num_routers)]


def children_for(config: DeploymentConfig, config_path: Path, log_dir: Path, num_routers: int = 1) -> list[Child]:
    """Cache pools first (workers connect to their cluster's pool), then workers, then the routers:
    ``num_routers`` of them on consecutive ports from ``router.port``, replica i on port + i."""
    base = [sys.executable, "-m", "services.cli"]
    children = [Child(pool.name, base + ["cache-pool", "--config", str(config_path), "--name", pool.name],
                      log_dir / f"{pool.name}.log", stage=POOL_STAGE) for pool in config.cache_pools]
    for worker in config.workers:
        command = "prefill-worker" if worker.service == "prefill_worker" else "decode-worker"
        argv = base + [command, "--config", str(config_path), "--name", worker.name]
        children.append(Child(worker.name, argv, log_dir / f"{worker.name}.log", stage=WORKER_STAGE))
    for replica, name in enumerate(router_names(num_routers)):
        argv = base + ["router", "--config", str(config_path)]
        if num_routers > 1:
            argv += ["--port", str(config.router.port + replica), "--replica", str(replica)]
        children.append(Child(name, argv, log_dir / f"{name}.log"))
    return children


def grpc_endpoints(config: DeploymentConfig) -> dict[str, tuple[str, int]]:
    """Every gRPC service the supervisor starts (cache pools and workers): name -> (host, port)."""
    endpoints = {pool.name: (pool.host, pool.port) for pool in config.cache_pools}
    endpoints.update({worker.name: (worker.host, worker.port) for worker in config.workers})
    return endpoints


def generated_credentials(config: DeploymentConfig) -> dict[str, str]:
    """Services started together on this machine share credentials made here, passed in their
    environment, for what is not configured: the gRPC bearer token and the KV data-plane secret.
    Returns the environment variables to set (none when both are configured)."""
    import secrets

    from services.kv_transport.settings import TransportSettings

    transport = TransportSettings.of(config.transport)
    return {variable: secrets.token_urlsafe(32)
            for variable, present in ((config.security.token_env, config.security.token_value),
                                      (transport.secret_env, transport.secret_bytes)) if not present}


def worker_serving(host: str, port: int, security: GrpcSecurity = GrpcSecurity()) -> bool:
    """Whether the gRPC service at host:port (a worker or a cache pool) reports SERVING. The health
    service needs no token, but TLS servers want the deployment's client certificate."""
    with security.channel(f"{host}:{port}") as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=1.0)
        except grpc.RpcError:
            return False
    return reply.status == health_pb2.HealthCheckResponse.SERVING


def router_healthy(host: str, port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://{host}:{port}/health", timeout=1.0) as reply:
            return reply.status == 200
    except OSError:
        return False


def stop_all(children: list[Child], timeout_s: float = STOP_TIMEOUT_S, *,
             stage_timeouts_s: dict[int, float] | None = None, hurry: Callable[[], bool] = lambda: False) -> None:
    """Stop in stages: the router first (it drains its HTTP requests), then the workers (each drains its
    own gRPC calls, then stops its engine), then the cache pools. Each service's main process alone gets
    SIGTERM, and a stage's services have ``stage_timeouts_s[stage]`` (else ``timeout_s``) to exit; the
    rest of a service's process group then has a moment to follow before SIGKILL. Once ``hurry()`` is
    true (a second Ctrl-C), whatever is left is killed at once."""
    for stage in sorted({c.stage for c in children}):
        members = [c for c in children if c.stage == stage and c.process is not None]
        _stop_stage(members, (stage_timeouts_s or {}).get(stage, timeout_s), hurry)


def _stop_stage(children: list[Child], timeout_s: float, hurry: Callable[[], bool]) -> None:
    for child in children:
        child.signal(signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    _wait(lambda: all(c.exited for c in children), deadline, hurry)
    # The rest of each group (vLLM's engine processes, multiprocessing's resource tracker, which
    # unlinks leaked shared memory once its parent exits) gets a moment to finish before SIGKILL.
    _wait(lambda: not any(c.group_alive for c in children), min(deadline, time.monotonic() + GROUP_EXIT_S), hurry)
    for child in children:
        child.signal_group(signal.SIGKILL)
        child.process.wait()
        child.log_file.close()


def _wait(done: Callable[[], bool], deadline: float, hurry: Callable[[], bool]) -> None:
    while time.monotonic() < deadline and not done() and not hurry():
        time.sleep(0.1)
