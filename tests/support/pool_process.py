"""`prfaas cache-pool` as a separate process, from a one-pool config written for it."""
from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import grpc
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc
from support.ports import free_port


def write_pool_config(directory: Path, pool: dict, **deployment) -> Path:
    """A deployment config holding one decode worker and ``pool`` (one ``cache_pools`` entry)."""
    config = {"workers": [{"name": "decode-0", "port": free_port()}], "cache_pools": [pool], **deployment}
    path = directory / "deploy.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def start_pool_process(config: Path, name: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "services.cli", "cache-pool", "--config", str(config),
                             "--name", name], stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


def wait_serving(channel: grpc.Channel, process: subprocess.Popen, timeout_s: float = 30.0) -> None:
    health = health_pb2_grpc.HealthStub(channel)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert process.poll() is None, process.stdout.read().decode()
        try:
            status = health.Check(health_pb2.HealthCheckRequest(service="prfaas.v1.CachePool"), timeout=1).status
            if status == health_pb2.HealthCheckResponse.SERVING:
                return
        except grpc.RpcError:
            time.sleep(0.1)
    raise TimeoutError("cache pool did not become SERVING")


def stop(process: subprocess.Popen) -> None:
    """SIGTERM (a clean stop removes the pool's arena), SIGKILL if that does not end it."""
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
    process.wait(10)
    process.stdout.close()
