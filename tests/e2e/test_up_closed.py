"""`prfaas up` on the embedded default is closed: it generates a gRPC token and a KV secret, the
services refuse callers without them, and a tool on the machine can use them from the file `up`
writes. A config that would open a port to other hosts without credentials is refused at once."""
from __future__ import annotations

import os
import signal
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path

import grpc
import openai
import pytest
import yaml
from prfaas.v1 import worker_pb2 as pb
from prfaas.v1 import worker_pb2_grpc as pb_grpc

from services.kv_transport import protocol
from services.launcher.cli import DEFAULT_CONFIG
from services.security import GrpcSecurity
from support.ports import free_port

ROOT = Path(__file__).resolve().parents[2]


def _embedded_default_on_free_ports(tmp_path: Path) -> tuple[Path, dict]:
    """deploy/local.yaml, unchanged but for its ports (a test must not take 8000)."""
    config = yaml.safe_load(DEFAULT_CONFIG.read_text())
    config["router"]["port"] = free_port()
    for worker in config["workers"]:
        worker["port"] = free_port()
        if "kv_port" in worker:
            worker["kv_port"] = free_port()
    path = tmp_path / "local.yaml"
    path.write_text(yaml.safe_dump(config))
    return path, config


def _environment() -> dict:
    return {k: v for k, v in os.environ.items()
            if k not in ("PRFAAS_GRPC_TOKEN", "PRFAAS_KV_SECRET", "PRFAAS_API_KEYS")}


@pytest.mark.e2e
def test_up_with_the_embedded_default_is_closed(tmp_path):
    path, config = _embedded_default_on_free_ports(tmp_path)
    logs = tmp_path / "logs"
    up = subprocess.Popen([sys.executable, "-m", "services.cli", "up", "--config", str(path), "--log-dir", str(logs)],
                          cwd=ROOT, env=_environment(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          start_new_session=True)
    output = []
    try:
        deadline = time.monotonic() + 400
        while time.monotonic() < deadline:
            line = up.stdout.readline()
            if not line:
                break
            output.append(line)
            if "PrfaaS is up" in line:
                break
        assert any("PrfaaS is up" in line for line in output), "".join(output)
        credentials = logs / "credentials.env"
        assert stat.S_IMODE(credentials.stat().st_mode) == 0o600
        values = dict(line.split("=", 1) for line in credentials.read_text().split())
        assert set(values) == {"PRFAAS_GRPC_TOKEN", "PRFAAS_KV_SECRET"}
        decode = next(w for w in config["workers"] if w["name"] == "decode-0")

        def stats(security: GrpcSecurity):
            with security.channel(f"127.0.0.1:{decode['port']}") as channel:
                return pb_grpc.DecodeWorkerStub(channel).GetStats(pb.StatsRequest(), timeout=10)

        with pytest.raises(grpc.RpcError) as error:
            stats(GrpcSecurity())
        assert error.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert stats(GrpcSecurity(token=values["PRFAAS_GRPC_TOKEN"])).worker_name == "decode-0"
        with socket.create_connection(("127.0.0.1", decode["kv_port"]), timeout=10) as sock:
            with pytest.raises((protocol.HandshakeRefused, ConnectionError)):
                protocol.client_handshake(sock, b"")  # no secret: refused
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{config['router']['port']}/v1", api_key="none",
                               max_retries=0, timeout=120)
        reply = client.chat.completions.create(model=config["model"]["name"], max_tokens=8, temperature=0,
                                               messages=[{"role": "user", "content": "Name a colour."}])
        assert reply.choices[0].message.content
    finally:
        os.killpg(up.pid, signal.SIGTERM)
        try:
            up.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(up.pid, signal.SIGKILL)
            up.wait()
    assert up.returncode == 0, "".join(output) + up.stdout.read()


def test_up_refuses_a_config_open_to_other_hosts_before_starting_anything(tmp_path):
    path, config = _embedded_default_on_free_ports(tmp_path)
    config["router"]["host"] = "0.0.0.0"
    path.write_text(yaml.safe_dump(config))
    result = subprocess.run([sys.executable, "-m", "services.cli", "up", "--config", str(path),
                             "--log-dir", str(tmp_path / "logs")], cwd=ROOT, env=_environment(),
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert "router.host: 0.0.0.0 is reachable from other hosts, but no credentials are set for its http port: " \
           "set router.api_keys (or PRFAAS_API_KEYS)" in result.stderr
    assert "started" not in result.stdout
