"""Random YAML trees into the config loader: a valid config or a ConfigError that names a key,
never another exception."""
from __future__ import annotations

import yaml
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from services.config import ConfigError, DeploymentConfig, parse_config

SECTIONS = ["model", "engine", "router", "workers", "cache_pools", "scheduler", "logging", "transport", "security"]
KEYS = SECTIONS + ["name", "path", "port", "kv_port", "host", "role", "service", "cluster", "health_port",
                   "max_model_len", "token", "previous_tokens", "insecure", "secret", "tls_cert",
                   "connections_per_peer", "max_body_bytes", "qos_classes", "offload_threshold_tokens",
                   "memory_budget_gib", "api_keys", "frame_bytes", "max_connections_per_peer", "role_flips"]
SCALARS = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70), st.floats(allow_nan=True),
                    st.text(max_size=12), st.sampled_from(["prefill", "decode", "both", "local", "prfaas",
                                                           "0.0.0.0", "127.0.0.1", "decode_worker"]))
TREES = st.recursive(SCALARS, lambda children: st.one_of(
    st.lists(children, max_size=4), st.dictionaries(st.sampled_from(KEYS) | st.text(max_size=6), children,
                                                   max_size=5)), max_leaves=25)
WORKER = st.fixed_dictionaries({"name": st.text(min_size=1, max_size=4), "port": st.integers(-5, 70000)},
                               optional={"role": SCALARS, "kv_port": st.integers(-5, 70000) | st.none(),
                                         "service": SCALARS, "health_port": SCALARS, "engine": TREES})
DEPLOYMENTS = st.fixed_dictionaries({}, optional={
    **dict.fromkeys(SECTIONS, TREES),
    "workers": st.lists(WORKER, max_size=3)})


def _parse(raw) -> None:
    try:
        config = parse_config(raw)
    except ConfigError as exc:
        assert str(exc) and "Traceback" not in str(exc)
        return
    assert isinstance(config, DeploymentConfig)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(DEPLOYMENTS)
@example({"security": {"grpc_max_message_bytes": 0}})
@example({"router": {"max_body_bytes": -1}})
@example({"transport": {"max_connections_per_peer": 1}})
@example({"workers": [{"name": "a", "port": 1, "health_port": 1}]})
def test_random_deployments_load_or_fail_with_a_config_error(raw):
    _parse(raw)


@settings(max_examples=200, deadline=None)
@given(TREES)
def test_random_yaml_documents_load_or_fail_with_a_config_error(tree):
    _parse(yaml.safe_load(yaml.safe_dump(tree)))
