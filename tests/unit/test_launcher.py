"""What `prfaas up` starts: cache pools first, then workers, then the router; and what it waits for."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import yaml

from services.config import parse_config
from services.launcher import supervisor
from support.deployment import wait_until
from support.ports import free_port
from support.procs import alive

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


def test_several_routers_get_consecutive_ports_and_their_replica_numbers():
    routers = supervisor.children_for(parse_config(RAW), Path("c.yaml"), Path("/logs"), num_routers=3)[-3:]
    assert [c.name for c in routers] == ["router", "router-1", "router-2"]
    assert [c.argv[-4:] for c in routers] == [["--port", str(18000 + i), "--replica", str(i)] for i in range(3)]
    assert [c.log_path for c in routers] == [Path("/logs/router.log"), Path("/logs/router-1.log"),
                                             Path("/logs/router-2.log")]
    (alone,) = supervisor.children_for(parse_config(RAW), Path("c.yaml"), Path("/logs"))[-1:]
    assert "--replica" not in alone.argv  # one router runs as before


def test_up_refuses_a_router_count_out_of_range():
    result = subprocess.run([sys.executable, "-m", "services.cli", "up", "--routers", "0"], capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 2 and "--routers must be between 1 and 16" in result.stderr


def test_a_deployment_without_pools_starts_no_pool():
    raw = {key: value for key, value in RAW.items() if key != "cache_pools"}
    assert [c.name for c in supervisor.children_for(parse_config(raw), Path("c.yaml"), Path("."))] == \
        ["decode-0", "prefill-0", "router"]



SUPERVISOR = """
import sys, time
sys.path.insert(0, {root!r})
from pathlib import Path
from services.config import load_config
from services.launcher import supervisor
config = load_config(Path({config!r}))
pool = supervisor.children_for(config, Path({config!r}), Path({logs!r}))[0]
pool.env = supervisor.generated_credentials(config)
pool.start()
print(pool.process.pid, flush=True)
time.sleep(600)
"""


def test_a_service_ends_when_its_supervisor_is_killed(tmp_path):
    """`prfaas up` (or a test's deployment) killed by SIGKILL, which it cannot clean up after: the
    services it started get SIGTERM from the kernel and stop, rather than hold their ports for nobody."""
    port = free_port()
    raw = {"model": RAW["model"], "router": {"port": free_port()}, "workers": [{"name": "d", "port": free_port()}],
           "cache_pools": [{"name": "pool-local", "cluster": "local", "port": port, "memory_budget_gib": 0.05}]}
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump(raw))
    log = tmp_path / "pool-local.log"
    script = SUPERVISOR.format(root=str(Path(__file__).resolve().parents[2]), config=str(config), logs=str(tmp_path))
    boss = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    pid = 0
    try:
        pid = int(boss.stdout.readline() or 0)
        assert pid, "the supervisor did not start the pool"
        assert wait_until(lambda: supervisor.worker_serving("127.0.0.1", port) or not alive(pid), 60)
        assert alive(pid), log.read_text()[-3000:]
        boss.kill()
        boss.wait()
        assert wait_until(lambda: not alive(pid), 30), "the cache pool outlived the supervisor that started it"
        assert not supervisor.worker_serving("127.0.0.1", port)
    finally:
        boss.kill()
        boss.wait()
        if pid and alive(pid):
            os.killpg(pid, signal.SIGKILL)
