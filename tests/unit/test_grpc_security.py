"""The gRPC trust boundary on a real pool server (sync gRPC) and a real aio server: bearer tokens,
rotation, the health exemption, mutual TLS against a foreign CA, and which listeners may be open."""
from __future__ import annotations

import asyncio
import dataclasses

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from prfaas.v1 import cache_pool_pb2 as pb
from prfaas.v1 import cache_pool_pb2_grpc as pb_grpc

from support.certs import make_node_cert

from services.config import ConfigError, parse_config
from services.security import GrpcSecurity, Rejections, check_listeners
from services.security.exposure import deployment_listeners, is_loopback

TOKEN = "current-token"


def _stats(security: GrpcSecurity, port: int) -> pb.CachePoolStats:
    with security.channel(f"127.0.0.1:{port}") as channel:
        return pb_grpc.CachePoolStub(channel).GetStats(pb.CachePoolStatsRequest(), timeout=5)


def _health(security: GrpcSecurity, port: int) -> int:
    with security.channel(f"127.0.0.1:{port}") as channel:
        return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5).status


def test_a_token_is_required_and_counted_but_health_answers_without_one(pool_server):
    server = pool_server(security=GrpcSecurity(token=TOKEN, accepted_tokens=(TOKEN,)))
    assert _stats(GrpcSecurity(token=TOKEN), server.port).memory_blocks == 0
    for caller, reason in [(GrpcSecurity(), "missing_token"), (GrpcSecurity(token="guess"), "wrong_token"),
                           (GrpcSecurity(token=TOKEN + "x"), "wrong_token")]:
        with pytest.raises(grpc.RpcError) as error:
            _stats(caller, server.port)
        assert error.value.code() == grpc.StatusCode.UNAUTHENTICATED, reason
        assert "security.token" in error.value.details()
    assert server.servicer.rejections.snapshot() == {"missing_token": 1, "wrong_token": 2}
    assert _health(GrpcSecurity(), server.port) == health_pb2.HealthCheckResponse.SERVING
    metrics = server.servicer.metrics.registry.get_sample_value(
        "prfaas_grpc_rejected_total", {"service": "pool-t", "reason": "wrong_token"})
    assert metrics == 2


def test_a_malformed_authorization_header_is_missing_credentials(pool_server):
    server = pool_server(security=GrpcSecurity(token=TOKEN, accepted_tokens=(TOKEN,)))
    with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        for value in (TOKEN, f"Basic {TOKEN}", "Bearer "):
            with pytest.raises(grpc.RpcError) as error:
                pb_grpc.CachePoolStub(channel).GetStats(pb.CachePoolStatsRequest(), timeout=5,
                                                         metadata=[("authorization", value)])
            assert error.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert server.servicer.rejections.snapshot() == {"missing_token": 3}


def test_rotation_accepts_the_previous_token_until_it_is_removed(pool_server, monkeypatch):
    from services.config.schema import SecurityConfig

    monkeypatch.setenv("PRFAAS_GRPC_PREVIOUS_TOKENS", "old-2, old-3")
    config = SecurityConfig(token="new", previous_tokens=("old-1",))
    assert config.accepted_tokens == ("new", "old-1", "old-2", "old-3")
    server = pool_server(security=GrpcSecurity.from_sections(config, {}))
    for token in ("new", "old-1", "old-3"):
        _stats(GrpcSecurity(token=token), server.port)
    rotated = pool_server(security=GrpcSecurity(token="new", accepted_tokens=("new",)))
    with pytest.raises(grpc.RpcError) as error:
        _stats(GrpcSecurity(token="old-1"), rotated.port)
    assert error.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_mutual_tls_refuses_a_client_of_another_ca_at_the_handshake(pool_server, tmp_path):
    ours = make_node_cert(tmp_path / "ours")
    theirs = make_node_cert(tmp_path / "theirs", ca_name="someone-else")
    tls = {"tls_cert": ours.cert, "tls_key": ours.key, "tls_ca": ours.ca}
    server = pool_server(security=GrpcSecurity(token=TOKEN, accepted_tokens=(TOKEN,), **tls))
    assert _stats(GrpcSecurity(token=TOKEN, **tls), server.port).memory_blocks == 0
    assert _health(GrpcSecurity(**tls), server.port) == health_pb2.HealthCheckResponse.SERVING
    # Their certificate, but trusting our CA: our server refuses their certificate.
    stranger = GrpcSecurity(token=TOKEN, tls_cert=theirs.cert, tls_key=theirs.key, tls_ca=ours.ca)
    # A plaintext client: no TLS handshake at all.
    for caller in (stranger, GrpcSecurity(token=TOKEN)):
        with pytest.raises(grpc.RpcError) as error:
            _stats(caller, server.port)
        assert error.value.code() == grpc.StatusCode.UNAVAILABLE
    assert server.servicer.rejections.snapshot() == {}  # refused before any call reached the interceptor


def test_the_aio_interceptor_refuses_streaming_calls_too():
    """Workers serve grpc.aio with a server-streaming Generate: the refusal must keep its kind."""
    from prfaas.v1 import worker_pb2 as wpb
    from prfaas.v1 import worker_pb2_grpc as wpb_grpc

    class Decode(wpb_grpc.DecodeWorkerServicer):
        async def Generate(self, request, context):
            yield wpb.GenerateResponse(token_ids=[1])

    async def main():
        rejections = Rejections("decode-t")
        security = GrpcSecurity(token=TOKEN, accepted_tokens=(TOKEN,))
        server = grpc.aio.server(interceptors=security.aio_interceptors(rejections))
        wpb_grpc.add_DecodeWorkerServicer_to_server(Decode(), server)
        health_pb2_grpc.add_HealthServicer_to_server(health.aio.HealthServicer(), server)
        port = security.add_port(server, "127.0.0.1:0")
        await server.start()
        try:
            async with security.aio_channel(f"127.0.0.1:{port}") as channel:
                replies = [r async for r in wpb_grpc.DecodeWorkerStub(channel).Generate(wpb.GenerateRequest())]
            async with GrpcSecurity().aio_channel(f"127.0.0.1:{port}") as channel:
                with pytest.raises(grpc.aio.AioRpcError) as error:
                    [r async for r in wpb_grpc.DecodeWorkerStub(channel).Generate(wpb.GenerateRequest())]
                status = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest())
            return replies, error.value.code(), status.status, rejections.snapshot()
        finally:
            await server.stop(0)

    replies, code, status, counts = asyncio.run(main())
    assert [list(r.token_ids) for r in replies] == [[1]]
    assert code == grpc.StatusCode.UNAUTHENTICATED and counts == {"missing_token": 1}
    assert status == health_pb2.HealthCheckResponse.SERVING


def test_message_size_and_stream_bounds_are_explicit(pool_server):
    server = pool_server(security=GrpcSecurity(max_message_bytes=1 << 20))
    with grpc.insecure_channel(f"127.0.0.1:{server.port}",
                               options=[("grpc.max_send_message_length", 8 << 20)]) as channel:
        request = pb.PutRequest(model="m", blocks=[pb.CacheBlock(group_id=0, block_hash=b"h" * 16,
                                                                 data=b"x" * (2 << 20))])
        with pytest.raises(grpc.RpcError) as error:
            pb_grpc.CachePoolStub(channel).Put(request, timeout=5)
    assert error.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    options = dict(GrpcSecurity().options)
    assert options["grpc.max_receive_message_length"] == 64 << 20 and options["grpc.max_concurrent_streams"] == 256


# Closed by default -----------------------------------------------------------------------------

def _config(**sections) -> dict:
    config = {"router": {"host": "127.0.0.1"},
              "workers": [{"name": "d", "host": "127.0.0.1", "port": 50071, "kv_port": 50072}]}
    for name, section in sections.items():
        config[name] = {**config.get(name, {}), **section} if isinstance(section, dict) else section
    return config


@pytest.mark.parametrize("host, loopback", [("127.0.0.1", True), ("127.3.0.9", True), ("::1", True),
                                            ("localhost", True), ("0.0.0.0", False), ("", False),
                                            ("10.1.2.3", False), ("decode-0.prfaas.svc", False), ("::", False)])
def test_loopback_addresses(host, loopback):
    assert is_loopback(host) == loopback


@pytest.mark.parametrize("raw, env, error", [
    (_config(), {}, None),
    (_config(workers=[{"name": "d", "host": "0.0.0.0", "port": 1}]), {}, "workers[0].host: 0.0.0.0 is reachable"),
    (_config(workers=[{"name": "d", "host": "0.0.0.0", "port": 1}]), {"PRFAAS_GRPC_TOKEN": "t"}, None),
    (_config(workers=[{"name": "d", "host": "0.0.0.0", "port": 1, "kv_port": 2}]), {"PRFAAS_GRPC_TOKEN": "t"},
     "workers[0].kv_port: 0.0.0.0 is reachable from other hosts, but no credentials are set for its kv port: set "
     "transport.secret (or PRFAAS_KV_SECRET)"),
    (_config(workers=[{"name": "d", "host": "0.0.0.0", "port": 1, "kv_port": 2}], transport={"secret": "s"},
             security={"token": "t"}), {}, None),
    (_config(router={"host": "0.0.0.0"}), {}, "router.host: 0.0.0.0 is reachable from other hosts, but no "
     "credentials are set for its http port: set router.api_keys (or PRFAAS_API_KEYS)"),
    (_config(router={"host": "0.0.0.0"}), {"PRFAAS_API_KEYS": "k1,k2"}, None),
    (_config(router={"host": "0.0.0.0"}, security={"insecure": True}), {}, None),
    (_config(cache_pools=[{"name": "p", "host": "10.0.0.5", "port": 3, "kv_port": 4}], security={"token": "t"}),
     {}, "cache_pools[0].kv_port: 10.0.0.5 is reachable"),
])
def test_a_listener_reachable_from_elsewhere_needs_credentials(raw, env, error, monkeypatch):
    for variable in ("PRFAAS_GRPC_TOKEN", "PRFAAS_KV_SECRET", "PRFAAS_API_KEYS"):
        monkeypatch.delenv(variable, raising=False)
    for variable, value in env.items():
        monkeypatch.setenv(variable, value)
    config = parse_config(raw)
    if error is None:
        check_listeners(config, deployment_listeners(config))
        return
    with pytest.raises(ConfigError) as raised:
        check_listeners(config, deployment_listeners(config))
    assert str(raised.value).startswith(error)


def test_mutual_tls_counts_as_credentials_for_grpc_and_kv(tmp_path, monkeypatch):
    monkeypatch.delenv("PRFAAS_GRPC_TOKEN", raising=False)
    monkeypatch.delenv("PRFAAS_KV_SECRET", raising=False)
    cert = make_node_cert(tmp_path)
    config = parse_config(_config(workers=[{"name": "d", "host": "0.0.0.0", "port": 1, "kv_port": 2}],
                                  transport=cert.transport()))
    check_listeners(config, deployment_listeners(config))


def test_the_insecure_opt_out_is_logged(caplog, monkeypatch):
    monkeypatch.delenv("PRFAAS_GRPC_TOKEN", raising=False)
    config = parse_config(_config(workers=[{"name": "d", "host": "0.0.0.0", "port": 1}], security={"insecure": True}))
    check_listeners(config, deployment_listeners(config))
    assert "security.insecure is set" in caplog.text and "workers[0].host=0.0.0.0" in caplog.text


def test_generated_credentials_fill_only_what_is_not_configured(monkeypatch):
    from services.launcher.supervisor import generated_credentials

    monkeypatch.delenv("PRFAAS_GRPC_TOKEN", raising=False)
    monkeypatch.delenv("PRFAAS_KV_SECRET", raising=False)
    made = generated_credentials(parse_config(_config()))
    assert set(made) == {"PRFAAS_GRPC_TOKEN", "PRFAAS_KV_SECRET"} and all(len(v) >= 40 for v in made.values())
    assert made != generated_credentials(parse_config(_config()))  # random each run
    assert generated_credentials(parse_config(_config(security={"token": "t"}, transport={"secret": "s"}))) == {}


def test_bad_security_settings_name_the_key():
    with pytest.raises(ConfigError, match="security.grpc_max_message_bytes: must be positive"):
        parse_config(_config(security={"grpc_max_message_bytes": 0}))
    with pytest.raises(ConfigError, match="transport.max_connections_per_peer: 4 is below connections_per_peer"):
        parse_config(_config(transport={"max_connections_per_peer": 4}))


def test_security_reaches_the_connector_without_losing_lists():
    """The worker hands its security section to the connector (in the engine) through vLLM's extra
    config; it must rebuild the same credentials there."""
    from services.engine.args import _plain
    from services.kv_connector.settings import ConnectorSettings

    config = parse_config(_config(security={"token": "t", "previous_tokens": ["a", "b"]}))
    settings = ConnectorSettings(security=_plain(config.security))
    assert settings.grpc_security == dataclasses.replace(GrpcSecurity.of(config))
    assert settings.grpc_security.accepted_tokens == ("t", "a", "b")
