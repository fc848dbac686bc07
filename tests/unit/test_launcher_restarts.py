"""`prfaas up`'s supervision on real processes: restart with backoff, the crash loop, the restart
counter the router exports, and the stop order (router, then workers, then pools; a service's engine
processes are its own to stop, never signalled by the launcher before it has drained)."""
from __future__ import annotations

import json
import re
import sys
import time
from pathlib import Path

import pytest

from services.config import SupervisorConfig
from services.launcher import supervisor
from services.launcher.restarts import Restarts
from services.launcher.watch import Watch
from services.router.metrics import RouterMetrics
from support.deployment import wait_until


@pytest.mark.parametrize("policy, returncode, kind", [
    ("on-failure", 1, "restart"), ("on-failure", -9, "restart"), ("on-failure", 0, "stop"),
    ("always", 0, "restart"), ("never", -9, "stop"),
])
def test_which_exits_restart(policy, returncode, kind):
    assert Restarts(SupervisorConfig(restart=policy)).after_exit(returncode, 0.0).kind == kind


def test_backoff_doubles_within_the_window_up_to_its_cap_then_a_crash_loop():
    restarts = Restarts(SupervisorConfig(restart_backoff_s=1, max_restart_backoff_s=5, crash_loop_restarts=5,
                                         crash_loop_window_s=60))
    delays = [restarts.after_exit(-9, t).delay_s for t in (0, 1, 2, 3, 4)]
    assert delays == [1, 2, 4, 5, 5]
    assert restarts.after_exit(-9, 59).kind == "crash_loop"


def test_restarts_spread_out_are_no_crash_loop_and_back_off_from_the_start():
    restarts = Restarts(SupervisorConfig(crash_loop_restarts=2, crash_loop_window_s=60))
    assert [restarts.after_exit(1, t).delay_s for t in (0, 100, 200, 300)] == [1, 1, 1, 1]


def _child(tmp_path: Path, name: str, code: str, stage: int = supervisor.WORKER_STAGE) -> supervisor.Child:
    return supervisor.Child(name, [sys.executable, "-c", code], tmp_path / f"{name}.log", stage=stage)


def test_a_killed_service_is_restarted_after_the_backoff_and_counted(tmp_path):
    service = _child(tmp_path, "decode-1", "import time; print('serving', flush=True); time.sleep(60)")
    other = _child(tmp_path, "decode-0", "import time; time.sleep(60)")
    stats = tmp_path / "launcher-stats.json"
    said = []
    watch = Watch([service, other], SupervisorConfig(restart_backoff_s=0.5), stats, say=said.append)
    try:
        for child in (service, other):
            child.start()
        first, untouched = service.process.pid, other.process.pid
        assert watch.poll() is None
        service.signal_group(9)
        killed_at = time.monotonic()
        assert wait_until(lambda: watch.poll() is None and service.process.pid != first, 10, interval_s=0.05)
        assert time.monotonic() - killed_at >= 0.5
        assert other.process.pid == untouched and not other.exited
        assert "decode-1 exited unexpectedly (killed by SIGKILL); restart 1 in 0.5 s" in said[0]
        assert said[1].startswith(f"started decode-1 (pid {service.process.pid})")
        assert json.loads(stats.read_text()) == {"restarts": {"decode-1": 1, "decode-0": 0}}
        metrics = RouterMetrics()
        metrics.read_launcher_stats(str(stats))
        assert metrics.registry.get_sample_value("prfaas_launcher_restarts_total", {"service": "decode-1"}) == 1
    finally:
        supervisor.stop_all([service, other], timeout_s=5)


def test_one_of_several_routers_stopped_cleanly_leaves_the_rest_serving_and_the_last_stops_all(tmp_path):
    """A router drained by SIGTERM exits 0: with another router serving, `prfaas up --routers N` goes on."""
    routers = [_child(tmp_path, name, code, stage=supervisor.ROUTER_STAGE)
               for name, code in (("router", "import time; time.sleep(1.0)"), ("router-1", "pass"))]
    said = []
    watch = Watch(routers, SupervisorConfig(), tmp_path / "s.json", say=said.append)
    try:
        for child in routers:
            child.start()
        routers[1].process.wait(5)
        assert watch.poll() is None and watch.poll() is None
        assert said == ["prfaas: router-1 stopped (drained, exit status 0); still serving: router"]
        routers[0].process.wait(5)
        assert "router exited (exit status 0; supervisor.restart: on-failure); stopping" in (watch.poll() or "")
    finally:
        supervisor.stop_all(routers, timeout_s=5)


def test_a_crash_loop_stops_the_deployment_with_the_service_log(tmp_path):
    service = _child(tmp_path, "router", "import sys; print('no model here', flush=True); sys.exit(3)")
    watch = Watch([service], SupervisorConfig(restart_backoff_s=0, crash_loop_restarts=2), tmp_path / "s.json",
                  say=lambda line: None)
    service.start()
    try:
        reasons = []
        assert wait_until(lambda: bool(reasons.append(watch.poll()) or reasons[-1]), 20, interval_s=0.05)
        assert "router exited (exit status 3) after 2 restarts in 60 s: a crash loop" in reasons[-1]
        assert "no model here" in reasons[-1]
    finally:
        supervisor.stop_all([service], timeout_s=5)


SERVICE = """
import os, signal, subprocess, sys, time
log = open({log!r}, "a", buffering=1)
engine = subprocess.Popen([sys.executable, "-c", {engine!r}])
def stop(*_):
    log.write(f"{name} SIGTERM {{time.monotonic()}}\\n")
    time.sleep({drain_s})                 # drains
    engine.terminate(); engine.wait()    # then stops its engine
    log.write(f"{name} exit {{time.monotonic()}}\\n")
    sys.exit(0)
signal.signal(signal.SIGTERM, stop)
print("ready", flush=True)
time.sleep(60)
"""
ENGINE = """
import signal, sys, time
log = open({log!r}, "a", buffering=1)
def stop(*_):
    log.write(f"{name}-engine SIGTERM {{time.monotonic()}}\\n"); sys.exit(0)
signal.signal(signal.SIGTERM, stop)
time.sleep(60)
"""


def test_stop_goes_router_then_workers_then_pools_and_never_signals_an_engine_first(tmp_path):
    events = tmp_path / "events"
    children = []
    for name, stage in (("pool", supervisor.POOL_STAGE), ("worker", supervisor.WORKER_STAGE),
                        ("router", supervisor.ROUTER_STAGE)):
        engine = ENGINE.format(log=str(events), name=name)
        code = SERVICE.format(log=str(events), engine=engine, name=name, drain_s=0.3)
        children.append(_child(tmp_path, name, code, stage))
    for child in children:
        child.start()
    assert wait_until(lambda: all("ready" in c.log_path.read_text() for c in children), 20)
    supervisor.stop_all(children, timeout_s=10)
    lines = [line.split() for line in events.read_text().splitlines()]
    assert [line[:2] for line in lines] == [
        ["router", "SIGTERM"], ["router-engine", "SIGTERM"], ["router", "exit"],
        ["worker", "SIGTERM"], ["worker-engine", "SIGTERM"], ["worker", "exit"],
        ["pool", "SIGTERM"], ["pool-engine", "SIGTERM"], ["pool", "exit"]]
    assert float(lines[1][2]) - float(lines[0][2]) >= 0.3  # the engine only after its service drained
    assert all(not c.group_alive for c in children)


def test_hurry_kills_what_is_left_at_once(tmp_path):
    slow = _child(tmp_path, "worker", SERVICE.format(log=str(tmp_path / "e"), engine=ENGINE.format(
        log=str(tmp_path / "e"), name="worker"), name="worker", drain_s=30))
    slow.start()
    assert wait_until(lambda: "ready" in slow.log_path.read_text(), 20)
    asked = time.monotonic()
    supervisor.stop_all([slow], timeout_s=60, hurry=lambda: time.monotonic() - asked > 0.5)
    assert time.monotonic() - asked < 5
    assert not slow.group_alive


def test_up_help_names_the_settings_with_their_defaults():
    import subprocess

    from services.config import RouterConfig

    out = subprocess.run([sys.executable, "-m", "services.cli", "up", "--help"], capture_output=True, text=True,
                         check=True).stdout
    text = re.sub(r"-\s+", "-", " ".join(out.split()))  # argparse wraps lines, also after a hyphen
    restart, router = SupervisorConfig(), RouterConfig()
    for phrase in (f"supervisor.restart: {restart.restart} by default",
                   f"supervisor.restart_backoff_s, {restart.restart_backoff_s:.0f} s",
                   f"supervisor.max_restart_backoff_s, {restart.max_restart_backoff_s:.0f} s",
                   f"supervisor.crash_loop_restarts ({restart.crash_loop_restarts})",
                   f"supervisor.crash_loop_window_s ({restart.crash_loop_window_s:.0f} s)",
                   f"router.drain_timeout_s, {router.drain_timeout_s:.0f} s",
                   f"up to {supervisor.STOP_TIMEOUT_S:.0f} s", "second Ctrl-C or SIGTERM kills what is left at once"):
        assert phrase in text, phrase
