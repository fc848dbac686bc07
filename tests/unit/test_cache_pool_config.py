"""The `cache_pools:` config section and the `prfaas cache-pool` command's start-up errors."""
import subprocess
import sys

import pytest
import yaml

from services.config import ConfigError, load_config, parse_config

WORKERS = [{"name": "decode-0", "port": 50061}]


def test_existing_configs_have_no_cache_pools():
    assert load_config("deploy/local.yaml").cache_pools == ()


def test_cache_pool_section_parses():
    config = parse_config({"workers": WORKERS, "cache_pools": [
        {"name": "pool-a", "cluster": "prfaas", "port": 50090, "memory_budget_gib": 0.5, "ssd_dir": "/tmp/ssd"}]})
    pool = config.cache_pool("pool-a")
    assert (pool.memory_budget_bytes, pool.ssd_budget_bytes, pool.metrics_port) == (1 << 29, 16 << 30, None)


@pytest.mark.parametrize("pools, message", [
    ([{"name": "a", "port": 50090}, {"name": "a", "cluster": "prfaas", "port": 50091}],
     "cache_pools[1].name: duplicate cache pool name 'a'"),
    ([{"name": "a", "port": 50090}, {"name": "b", "port": 50091}],
     "cache_pools[1].cluster: cluster 'local' already has a cache pool"),
    ([{"name": "a", "port": 50061}], "cache_pools[0].port: 127.0.0.1:50061 is already used"),
    ([{"name": "a", "port": 50090, "metrics_port": 70000}], "cache_pools[0].metrics_port: 70000 is not a TCP port"),
    ([{"name": "a", "port": 50090, "memory_budget_gib": 0}], "cache_pools[0].memory_budget_gib: must be positive"),
    ([{"name": "a", "port": 50090, "lease_timeout_s": 0}], "cache_pools[0].lease_timeout_s: must be positive"),
    ([{"name": "a", "port": 50090, "arena_slot_kib": -4}], "cache_pools[0].arena_slot_kib: must be positive"),
    ([{"name": "a", "port": 50090, "cluster": "x"}], "cache_pools[0].cluster: 'x' is not allowed"),
    ([{"name": "a"}], "cache_pools[0].port: required key is missing"),
])
def test_bad_cache_pool_sections_name_the_key(pools, message):
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("]", r"\]")):
        parse_config({"workers": WORKERS, "cache_pools": pools})


def test_command_is_listed_and_rejects_an_unknown_pool(tmp_path):
    out = subprocess.run([sys.executable, "-m", "services.cli", "--help"], capture_output=True, text=True,
                         check=True).stdout
    assert "cache-pool" in out
    path = tmp_path / "deploy.yaml"
    path.write_text(yaml.safe_dump({"workers": WORKERS, "cache_pools": [{"name": "pool-a", "port": 50090}]}))
    result = subprocess.run([sys.executable, "-m", "services.cli", "cache-pool", "--config", str(path),
                             "--name", "nope"], capture_output=True, text=True)
    assert result.returncode == 2
    assert "no cache pool named 'nope' (configured: pool-a)" in result.stderr
