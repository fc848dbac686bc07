"""`prfaas up` on the embedded default is closed: it generates a gRPC token and a KV secret, the
services refuse callers without them, and a tool on the machine can use them from the file `up`
writes. A config that would open a port to other hosts without credentials is refused at once."""
from __future__ import annotations

import os
import socket
import stat
import subprocess
import sys
from pathlib import Path

import grpc
import openai
import pytest
import yaml
from prfaas.v1 import worker_pb2 as pb
from prfaas.v1 import worker_pb2_grpc as pb_grpc

from services.kv_transport import protocol
from services.security import GrpcSecurity
from support.embedded import API_KEY, embedded_default_on_free_ports

ROOT = Path(__file__).resolve().parents[3]


def _environment() -> dict:
    return {k: v for k, v in os.environ.items()
            if k not in ("PRFAAS_GRPC_TOKEN", "PRFAAS_KV_SECRET", "PRFAAS_API_KEYS")}


@pytest.mark.e2e
def test_up_with_the_embedded_default_is_closed(embedded):
    credentials = embedded.directory / "credentials.env"
    assert stat.S_IMODE(credentials.stat().st_mode) == 0o600
    values = dict(line.split("=", 1) for line in credentials.read_text().split())
    assert set(values) == {"PRFAAS_GRPC_TOKEN", "PRFAAS_KV_SECRET"}
    assert "generated credentials for this run" in embedded.child("up").log_path.read_text()
    decode = next(w for w in embedded.config["workers"] if w["name"] == "decode-0")

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
    with pytest.raises(openai.AuthenticationError):  # the router's key came from PRFAAS_API_KEYS
        openai.OpenAI(base_url=embedded.base_url + "/v1", api_key="none", max_retries=0).models.list()
    client = openai.OpenAI(base_url=embedded.base_url + "/v1", api_key=API_KEY, max_retries=0, timeout=120)
    reply = client.chat.completions.create(model=embedded.config["model"]["name"], max_tokens=8, temperature=0,
                                           messages=[{"role": "user", "content": "Name a colour."}])
    assert reply.choices[0].message.content


def test_up_refuses_a_config_open_to_other_hosts_before_starting_anything(tmp_path):
    config = embedded_default_on_free_ports()
    config["router"]["host"] = "0.0.0.0"
    path = tmp_path / "local.yaml"
    path.write_text(yaml.safe_dump(config))
    result = subprocess.run([sys.executable, "-m", "services.cli", "up", "--config", str(path),
                             "--log-dir", str(tmp_path / "logs")], cwd=ROOT, env=_environment(),
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert "router.host: 0.0.0.0 is reachable from other hosts, but no credentials are set for its http port: " \
           "set router.api_keys (or PRFAAS_API_KEYS)" in result.stderr
    assert "started" not in result.stdout
