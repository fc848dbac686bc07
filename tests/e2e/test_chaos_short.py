"""bench/chaos.py in short, so that it cannot rot, and stopped mid-run, so that it cannot leak.

The short run: one fault (the local cache pool killed and restarted) under about 25 requests; it must
meet the benchmark's own targets: no wrong, hung or lost answer, nothing leaked, and the requests no
killed process held completed. The full run (5 minutes, every fault) is `python bench/chaos.py`;
docs/reliability.md gives its figures.

The stopped run: SIGTERM while its deployment serves (what CI's time limit, a timeout or an operator
does) must leave no process, network namespace, listening socket or shared-memory file of it.
Both need root (skipped otherwise); the second reuses the first one's cached expected answers."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from support import netns
from support.deployment import wait_until
from support.procs import alive, descendants, run_to_end
from services.launcher.supervisor import router_healthy

ROOT = Path(__file__).resolve().parents[2]
SHORT_RUN = ["--minutes", "0.3", "--rate", "0.4", "--seed", "1", "--faults", "kill_pool"]

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]


@pytest.fixture(autouse=True)
def namespaces():
    if (reason := netns.available()) is not None:
        pytest.skip(f"chaos {reason}")


def test_a_short_chaos_run_meets_its_targets(tmp_path):
    run = run_to_end([sys.executable, "bench/chaos.py", *SHORT_RUN, "--out", str(tmp_path)],
                         cwd=ROOT, timeout=800)
    print(run.stdout[-6000:], run.stderr[-3000:])
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert run.stdout.strip().splitlines()[-1].endswith("PASS")
    report = json.loads((tmp_path / "chaos.json").read_text())
    requests = report["summary"]["requests"]
    assert requests["sent"] >= 15 and requests["wrong"] == requests["hung"] == requests["lost"] == 0
    assert [f["name"] for f in report["faults"]] == ["kill_pool"]
    assert (tmp_path / "chaos.png").stat().st_size > 10_000


def test_sigterm_mid_run_leaves_nothing_behind(tmp_path):
    shm_before = set(os.listdir("/dev/shm"))
    bench = subprocess.Popen([sys.executable, "bench/chaos.py", *SHORT_RUN, "--out", str(tmp_path)], cwd=ROOT,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        config_path = tmp_path / "config.yaml"
        assert wait_until(lambda: config_path.exists() or bench.poll() is not None, 600, interval_s=1)
        config = yaml.safe_load(config_path.read_text())
        assert wait_until(lambda: router_healthy("127.0.0.1", config["router"]["port"]) or bench.poll() is not None,
                          300, interval_s=1), "the benchmark's deployment did not start"
        assert bench.poll() is None, "the benchmark ended before it was stopped"
        made = descendants(bench.pid)
        assert len(made) >= 5, made  # router, three workers, two pools (and their engines)
        bench.send_signal(signal.SIGTERM)
        output, _ = bench.communicate(timeout=150)
    finally:
        if bench.poll() is None:
            os.killpg(bench.pid, signal.SIGKILL)
            bench.wait()
    assert wait_until(lambda: not [pid for pid in made if alive(pid)], 15), \
        f"processes left running: {[_command(pid) for pid in made if alive(pid)]}\n{output[-3000:]}"
    tag = f"{bench.pid}x"
    assert not [name for name in _namespaces_and_links() if tag in name]
    ports = [config["router"]["port"]] + [e[k] for e in config["workers"] + config["cache_pools"]
                                         for k in ("port", "kv_port") if e.get(k)]
    assert not [port for port in ports if _listening(port)]
    left = lambda: _unused(set(os.listdir("/dev/shm")) - shm_before)  # noqa: E731
    assert wait_until(lambda: not left(), 15), f"shared memory left: {left()}"


def _command(pid: int) -> str:
    try:
        return open(f"/proc/{pid}/cmdline").read().replace("\0", " ")[:200]
    except OSError:
        return f"pid {pid}"


def _unused(names: set[str]) -> list[str]:
    """The files of /dev/shm among ``names`` that no live process has open or mapped: leaked, not
    in use by something else on the machine."""
    used = set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            used.update(line.split("/dev/shm/", 1)[1].split()[0] for line in open(f"/proc/{entry}/maps")
                        if "/dev/shm/" in line)
            for fd in os.listdir(f"/proc/{entry}/fd"):
                target = os.readlink(f"/proc/{entry}/fd/{fd}")
                if target.startswith("/dev/shm/"):
                    used.add(target[len("/dev/shm/"):].split()[0])
        except OSError:
            continue
    return sorted(name for name in names if name not in used and os.path.exists(f"/dev/shm/{name}"))


def _namespaces_and_links() -> list[str]:
    names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split()
    links = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True).stdout.splitlines()
    return names + [line.split(":")[1].strip().split("@")[0] for line in links]


def _listening(port: int) -> bool:
    with socket.socket() as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(("0.0.0.0", port))
        except OSError:
            return True
    return False
