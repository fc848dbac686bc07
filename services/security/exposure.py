"""Closed by default: a listener on a non-loopback address needs credentials, or the service refuses
to start (unless ``security.insecure``, the lab opt-out, which is logged at every start).

Credentials per kind of port: gRPC needs the bearer token or mutual TLS, the KV data plane its
shared secret or mutual TLS, the router's HTTP API its API keys.
"""
from __future__ import annotations

import ipaddress
import logging
from dataclasses import dataclass

from services.config.errors import ConfigError

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Listener:
    key: str   # the config key that binds it, e.g. ``workers[0].host``
    host: str
    kind: str  # "grpc", "kv" or "http"


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a name or a wildcard such as "" or "0.0.0.0" is reachable from elsewhere


def worker_listeners(config, worker) -> list[Listener]:
    return _service_listeners("workers", config.workers, worker)


def pool_listeners(config, pool) -> list[Listener]:
    return _service_listeners("cache_pools", config.cache_pools, pool)


def _service_listeners(section: str, entries, entry) -> list[Listener]:
    """``entry`` (possibly with its host overridden on the command line) is ``entries``' namesake."""
    i = next(i for i, e in enumerate(entries) if e.name == entry.name)
    listeners = [Listener(f"{section}[{i}].host", entry.host, "grpc")]
    if entry.kv_port is not None:
        listeners.append(Listener(f"{section}[{i}].kv_port", entry.host, "kv"))
    return listeners


def router_listeners(host: str) -> list[Listener]:
    return [Listener("router.host", host, "http")]


def deployment_listeners(config) -> list[Listener]:
    listeners = router_listeners(config.router.host)
    for worker in config.workers:
        listeners += worker_listeners(config, worker)
    for pool in config.cache_pools:
        listeners += pool_listeners(config, pool)
    return listeners


def check_listeners(config, listeners: list[Listener]) -> None:
    """Raise ``ConfigError`` for the first listener reachable from elsewhere without credentials;
    with ``security.insecure`` log a warning for each instead."""
    from services.kv_transport.settings import TransportSettings

    transport = TransportSettings.of(config.transport)
    has = {"grpc": bool(config.security.token_value) or transport.uses_tls,
           "kv": bool(transport.secret_bytes) or transport.uses_tls,
           "http": bool(config.router.accepted_api_keys)}
    needs = {"grpc": f"security.token (or {config.security.token_env}) or transport.tls_cert/tls_key/tls_ca",
             "kv": f"transport.secret (or {transport.secret_env}) or transport.tls_cert/tls_key/tls_ca",
             "http": f"router.api_keys (or {config.router.api_keys_env})"}
    open_ones = [lst for lst in listeners if not is_loopback(lst.host) and not has[lst.kind]]
    if config.security.insecure:
        logger.warning("security.insecure is set: services accept callers without credentials on non-loopback "
                       "addresses (%s); use it only in a lab",
                       ", ".join(f"{lst.key}={lst.host or '*'}" for lst in open_ones) or "none open now")
        return
    if open_ones:
        first = open_ones[0]
        raise ConfigError(f"{first.key}: {first.host or '*'} is reachable from other hosts, but no credentials are "
                          f"set for its {first.kind} port: set {needs[first.kind]}, bind a loopback address, or "
                          "set security.insecure: true (labs only)")
