"""Who may call a gRPC service: mutual TLS and a shared bearer token, on every server and channel.

Servers check ``authorization: Bearer <token>`` in an interceptor, comparing in constant time with
each accepted token (the current one and any still accepted during a rotation). A missing or wrong
token is ``UNAUTHENTICATED`` before the request is even parsed. ``grpc.health.v1`` answers without a
token, so orchestrators' probes work; with TLS it still needs a client certificate of the CA.

Channels add the token to every call (a client interceptor, so it works on plain and TLS channels
alike) and, with ``transport.tls_*`` configured, present this service's certificate and trust only
the deployment's CA: one set of certificates serves gRPC and the KV data plane.
"""
from __future__ import annotations

import collections
import hmac
import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import grpc

logger = logging.getLogger(__name__)

HEALTH_PREFIX = "/grpc.health.v1.Health/"
AUTHORIZATION = "authorization"


@dataclass(frozen=True, slots=True)
class GrpcSecurity:
    """What one process needs to serve and call gRPC: its token (sent), the tokens it accepts, the TLS
    files (all three or none), and the bounds every server and channel gets."""
    token: str = ""
    accepted_tokens: tuple[str, ...] = ()
    tls_cert: str = ""
    tls_key: str = ""
    tls_ca: str = ""
    tls_server_name: str = ""
    max_message_bytes: int = 64 << 20
    max_concurrent_streams: int = 256

    @classmethod
    def of(cls, config) -> "GrpcSecurity":
        """From a ``DeploymentConfig``: its ``security`` section and the TLS files of ``transport``."""
        return cls.from_sections(config.security, config.transport)

    @classmethod
    def from_sections(cls, security, transport: dict) -> "GrpcSecurity":
        """From a ``SecurityConfig`` and the raw ``transport`` mapping (whose ``tls_*`` it uses)."""
        from services.kv_transport.settings import TransportSettings

        transport = TransportSettings.of(transport)
        return cls(token=security.token_value, accepted_tokens=security.accepted_tokens,
                   tls_cert=transport.tls_cert, tls_key=transport.tls_key, tls_ca=transport.tls_ca,
                   tls_server_name=transport.tls_server_name,
                   max_message_bytes=security.grpc_max_message_bytes,
                   max_concurrent_streams=security.grpc_max_concurrent_streams)

    @property
    def uses_tls(self) -> bool:
        return bool(self.tls_cert)

    @property
    def checks_token(self) -> bool:
        return bool(self.accepted_tokens)

    @property
    def options(self) -> list[tuple[str, int | str]]:
        options = [("grpc.max_receive_message_length", self.max_message_bytes),
                   ("grpc.max_send_message_length", self.max_message_bytes),
                   ("grpc.max_concurrent_streams", self.max_concurrent_streams),
                   # a server refuses a port another process listens on (gRPC shares it by default,
                   # SO_REUSEPORT, so a second worker or pool on a taken port would get half its calls)
                   ("grpc.so_reuseport", 0)]
        if self.uses_tls and self.tls_server_name:
            options.append(("grpc.ssl_target_name_override", self.tls_server_name))
        return options

    # Servers --------------------------------------------------------------------------------------

    def add_port(self, server, address: str) -> int:
        """Bind ``address`` on ``server`` (TLS when configured); returns the port, 0 when it failed."""
        if not self.uses_tls:
            return server.add_insecure_port(address)
        credentials = grpc.ssl_server_credentials(
            [(_read(self.tls_key), _read(self.tls_cert))], root_certificates=_read(self.tls_ca),
            require_client_auth=True)
        return server.add_secure_port(address, credentials)

    def aio_interceptors(self, rejections: "Rejections") -> list:
        return [_AioTokenCheck(self.accepted_tokens, rejections)] if self.checks_token else []

    def interceptors(self, rejections: "Rejections") -> list:
        return [_TokenCheck(self.accepted_tokens, rejections)] if self.checks_token else []

    # Channels -------------------------------------------------------------------------------------

    def aio_channel(self, address: str, options: Sequence[tuple[str, int | str]] = ()) -> grpc.aio.Channel:
        """``options``: gRPC channel arguments added to the security ones."""
        interceptors = _AioTokenSender.kinds(self.token) if self.token else None
        if self.uses_tls:
            return grpc.aio.secure_channel(address, self._channel_credentials(), options=[*self.options, *options],
                                           interceptors=interceptors)
        return grpc.aio.insecure_channel(address, options=[*self.options, *options], interceptors=interceptors)

    def channel(self, address: str) -> grpc.Channel:
        """A blocking channel (health probes, tests, tools)."""
        if self.uses_tls:
            channel = grpc.secure_channel(address, self._channel_credentials(), options=self.options)
        else:
            channel = grpc.insecure_channel(address, options=self.options)
        return grpc.intercept_channel(channel, _TokenSender(self.token)) if self.token else channel

    def _channel_credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(root_certificates=_read(self.tls_ca), private_key=_read(self.tls_key),
                                            certificate_chain=_read(self.tls_cert))


class Rejections:
    """Calls a server refused, by reason (``missing_token``, ``wrong_token``, ``unknown_peer``): the
    numbers behind ``prfaas_grpc_rejected_total{service,reason}``."""

    def __init__(self, service: str) -> None:
        self.service = service
        self._counts: collections.Counter[str] = collections.Counter()
        self._lock = threading.Lock()

    def count(self, reason: str) -> None:
        with self._lock:
            self._counts[reason] += 1

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self._counts)


def _read(path: str) -> bytes:
    return Path(path).read_bytes()


def _rejection(accepted: tuple[str, ...], method: str, metadata) -> str | None:
    """Why a call must be refused (a reason label), or None when it may go on."""
    if method.startswith(HEALTH_PREFIX):
        return None
    values = [value for key, value in (metadata or ()) if key == AUTHORIZATION]
    if not values:
        return "missing_token"
    value = values[0] if isinstance(values[0], str) else values[0].decode(errors="replace")
    scheme, _, presented = value.partition(" ")
    if scheme.lower() != "bearer" or not presented:
        return "missing_token"
    matched = False
    for token in accepted:  # no early exit: the time taken does not tell which token came closest
        matched |= hmac.compare_digest(presented.encode(), token.encode())
    return None if matched else "wrong_token"


def _message(reason: str) -> str:
    if reason == "missing_token":
        return "missing credentials: send 'authorization: Bearer <token>' (security.token)"
    return "invalid credentials: the bearer token is not accepted here (security.token)"


def _refused(handler: grpc.RpcMethodHandler, abort: Callable, aio: bool) -> grpc.RpcMethodHandler:
    """A handler of the same kind as ``handler`` that only aborts (its request is never parsed)."""
    serializer = handler.response_serializer
    if aio:
        async def unary(request, context):
            await abort(context)

        async def stream(request, context):
            await abort(context)
            yield  # pragma: no cover (never reached: abort raises)
    else:
        def unary(request, context):
            abort(context)

        def stream(request, context):
            abort(context)
            yield  # pragma: no cover
    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(stream, None, serializer)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(unary, None, serializer)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(stream, None, serializer)
    return grpc.unary_unary_rpc_method_handler(unary, None, serializer)


class _TokenCheck(grpc.ServerInterceptor):
    def __init__(self, accepted: tuple[str, ...], rejections: Rejections) -> None:
        self._accepted = accepted
        self._rejections = rejections

    def intercept_service(self, continuation, details):
        handler = continuation(details)
        reason = _rejection(self._accepted, details.method, details.invocation_metadata)
        if reason is None or handler is None:
            return handler
        self._rejections.count(reason)
        logger.warning("%s: refused %s: %s", self._rejections.service, details.method, reason)
        return _refused(handler, lambda context: context.abort(grpc.StatusCode.UNAUTHENTICATED, _message(reason)),
                        aio=False)


class _AioTokenCheck(grpc.aio.ServerInterceptor):
    def __init__(self, accepted: tuple[str, ...], rejections: Rejections) -> None:
        self._accepted = accepted
        self._rejections = rejections

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        reason = _rejection(self._accepted, details.method, details.invocation_metadata)
        if reason is None or handler is None:
            return handler
        self._rejections.count(reason)
        logger.warning("%s: refused %s: %s", self._rejections.service, details.method, reason)

        async def abort(context):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, _message(reason))

        return _refused(handler, abort, aio=True)


class _CallDetails(collections.namedtuple(
        "_CallDetails", ("method", "timeout", "metadata", "credentials", "wait_for_ready", "compression")),
        grpc.ClientCallDetails):
    pass


class _TokenSender(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor,
                   grpc.StreamUnaryClientInterceptor, grpc.StreamStreamClientInterceptor):
    def __init__(self, token: str) -> None:
        self._header = (AUTHORIZATION, f"Bearer {token}")

    def _details(self, details) -> _CallDetails:
        metadata = [*(details.metadata or ()), self._header]
        return _CallDetails(details.method, details.timeout, metadata, details.credentials,
                            getattr(details, "wait_for_ready", None), getattr(details, "compression", None))

    def intercept_unary_unary(self, continuation, details, request):
        return continuation(self._details(details), request)

    def intercept_unary_stream(self, continuation, details, request):
        return continuation(self._details(details), request)

    def intercept_stream_unary(self, continuation, details, requests):
        return continuation(self._details(details), requests)

    def intercept_stream_stream(self, continuation, details, requests):
        return continuation(self._details(details), requests)


class _AioTokenSender:
    """Adds the token to a call's metadata. grpc.aio files an interceptor under one call kind only,
    so ``kinds`` makes one instance per kind."""

    def __init__(self, token: str) -> None:
        self._header = (AUTHORIZATION, f"Bearer {token}")

    @classmethod
    def kinds(cls, token: str) -> list:
        return [kind(token) for kind in (_AioUnaryUnary, _AioUnaryStream, _AioStreamUnary, _AioStreamStream)]

    def _details(self, details: grpc.aio.ClientCallDetails) -> grpc.aio.ClientCallDetails:
        metadata = grpc.aio.Metadata(*(details.metadata or ()), self._header)
        return grpc.aio.ClientCallDetails(details.method, details.timeout, metadata, details.credentials,
                                          details.wait_for_ready)


class _AioUnaryUnary(_AioTokenSender, grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation, details, request):
        return await continuation(self._details(details), request)


class _AioUnaryStream(_AioTokenSender, grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(self, continuation, details, request):
        return await continuation(self._details(details), request)


class _AioStreamUnary(_AioTokenSender, grpc.aio.StreamUnaryClientInterceptor):
    async def intercept_stream_unary(self, continuation, details, requests):
        return await continuation(self._details(details), requests)


class _AioStreamStream(_AioTokenSender, grpc.aio.StreamStreamClientInterceptor):
    async def intercept_stream_stream(self, continuation, details, requests):
        return await continuation(self._details(details), requests)
