"""What `prfaas up` starts: cache pools first, then workers, then the router; and what it waits for."""
from __future__ import annotations

from pathlib import Path

from services.config import parse_config
from services.launcher import supervisor

RAW = {
    "model": {"name": "m", "path": "builtin:smollm2-135m-instruct"},
    "router": {"port": 18000},
    "workers": [{"name": "decode-0", "port": 50100}, {"name": "prefill-0", "service": "prefill_worker",
                                                      "cluster": "prfaas", "port": 50101}],
    "cache_pools": [{"name": "pool-local", "cluster": "local", "port": 50110},
                    {"name": "pool-prfaas", "cluster": "prfaas", "port": 50111}],
}


def test_cache_pools_start_before_the_workers_that_use_them():
    children = supervisor.children_for(parse_config(RAW), Path("/etc/prfaas.yaml"), Path("/logs"))
    assert [c.name for c in children] == ["pool-local", "pool-prfaas", "decode-0", "prefill-0", "router"]
    pool = children[0]
    assert pool.argv[-5:] == ["cache-pool", "--config", "/etc/prfaas.yaml", "--name", "pool-local"]
    assert pool.log_path == Path("/logs/pool-local.log")


def test_start_up_waits_for_every_pool_and_worker():
    endpoints = supervisor.grpc_endpoints(parse_config(RAW))
    assert endpoints == {"pool-local": ("127.0.0.1", 50110), "pool-prfaas": ("127.0.0.1", 50111),
                         "decode-0": ("127.0.0.1", 50100), "prefill-0": ("127.0.0.1", 50101)}


def test_a_deployment_without_pools_starts_no_pool():
    raw = {key: value for key, value in RAW.items() if key != "cache_pools"}
    assert [c.name for c in supervisor.children_for(parse_config(raw), Path("c.yaml"), Path("."))] == \
        ["decode-0", "prefill-0", "router"]
