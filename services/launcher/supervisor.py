"""Start a deployment's services as child processes, wait for health, stop them all cleanly."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.config import DeploymentConfig
from services.procs import group_alive, supervised_env
from services.security import GrpcSecurity

STOP_TIMEOUT_S = 40.0
GROUP_EXIT_S = 10.0  # after a service's main process exits, for the rest of its process group


@dataclass(slots=True)
class Child:
    name: str
    argv: list[str]
    log_path: Path
    process: subprocess.Popen | None = None
    log_file: object = field(default=None, repr=False)
    env: dict[str, str] = field(default_factory=dict, repr=False)  # added to this process' environment

    def start(self) -> None:
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


def children_for(config: DeploymentConfig, config_path: Path, log_dir: Path) -> list[Child]:
    """Cache pools first (workers connect to their cluster's pool), then workers, then the router."""
    base = [sys.executable, "-m", "services.cli"]
    children = [Child(pool.name, base + ["cache-pool", "--config", str(config_path), "--name", pool.name],
                      log_dir / f"{pool.name}.log") for pool in config.cache_pools]
    for worker in config.workers:
        command = "prefill-worker" if worker.service == "prefill_worker" else "decode-worker"
        argv = base + [command, "--config", str(config_path), "--name", worker.name]
        children.append(Child(worker.name, argv, log_dir / f"{worker.name}.log"))
    children.append(Child("router", base + ["router", "--config", str(config_path)], log_dir / "router.log"))
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


def stop_all(children: list[Child], timeout_s: float = STOP_TIMEOUT_S) -> None:
    """SIGTERM every child's process group, wait, then SIGKILL what is left."""
    for child in reversed(children):
        _signal_group(child, signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    for child in children:
        if child.process is None:
            continue
        try:
            child.process.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
        # The rest of the group (vLLM's engine processes, multiprocessing's resource tracker, which
        # unlinks leaked shared memory once its parent exits) gets a moment to finish before SIGKILL.
        _wait_group_empty(child.process.pid, min(GROUP_EXIT_S, max(0.0, deadline - time.monotonic())))
        _signal_group(child, signal.SIGKILL)
        child.process.wait()
        child.log_file.close()


def _wait_group_empty(pgid: int, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and group_alive(pgid):
        time.sleep(0.1)


def _signal_group(child: Child, sig: int) -> None:
    if child.process is None:
        return
    try:
        os.killpg(child.process.pid, sig)
    except ProcessLookupError:
        pass
