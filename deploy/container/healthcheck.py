"""The image's HEALTHCHECK: exit 0 when the service in this container reports healthy.

``$PRFAAS_HEALTH`` says what to ask: ``http://HOST:PORT/PATH`` for the router (the default,
``http://127.0.0.1:8000/health``, which is also what `prfaas up` serves), or ``grpc://HOST:PORT`` for
a worker's or cache pool's plaintext ``health_port`` (grpc.health.v1).
"""
import os
import sys
import urllib.request
from urllib.parse import urlsplit

DEFAULT_TARGET = "http://127.0.0.1:8000/health"
TIMEOUT_S = 3.0


def http_healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=TIMEOUT_S) as reply:
            return reply.status == 200
    except OSError:
        return False


def grpc_healthy(address: str) -> bool:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(address) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=TIMEOUT_S)
        except grpc.RpcError:
            return False
    return reply.status == health_pb2.HealthCheckResponse.SERVING


def main() -> int:
    target = os.environ.get("PRFAAS_HEALTH") or DEFAULT_TARGET
    parts = urlsplit(target)
    healthy = grpc_healthy(parts.netloc) if parts.scheme == "grpc" else http_healthy(target)
    return 0 if healthy else 1


if __name__ == "__main__":
    sys.exit(main())
