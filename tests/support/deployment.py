"""Real deployments for end-to-end tests: every service a separate process on loopback."""
from __future__ import annotations

import dataclasses
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import yaml
from prfaas.v1 import worker_pb2 as pb
from prfaas.v1 import worker_pb2_grpc as pb_grpc

from services.launcher import supervisor
from services.security import GrpcSecurity
from support.ports import free_port

START_TIMEOUT_S = 300.0


def deployment_config(workers: list[dict], model_path: str = "builtin:smollm2-135m-instruct",
                      model_name: str = "smollm2-135m-instruct", **sections) -> dict:
    """A config dict with free ports for the router and every worker (``workers`` lack ports)."""
    config = {
        "model": {"name": model_name, "path": model_path, "max_model_len": 2048},
        "engine": {"enforce_eager": True, "cpu_kvcache_space_gib": 1},
        "router": {"host": "127.0.0.1", "port": free_port(), "stats_interval_s": 0.5},
        "workers": [{"port": free_port(), **w} for w in workers],
        "logging": {"level": "info"},
    }
    for name, section in sections.items():
        config[name] = section if isinstance(section, list) else {**config.get(name, {}), **section}
    return config


@dataclass
class Deployment:
    """Services started with the same supervisor `prfaas up` uses, one process group each.
    ``prefixes``: per service name, words put before its command line (e.g. ``ip netns exec NS``)."""

    config: dict
    directory: Path
    children: list = field(default_factory=list)
    security: GrpcSecurity = field(default_factory=GrpcSecurity)
    prefixes: dict[str, list[str]] = field(default_factory=dict)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.config['router']['port']}"

    @property
    def config_path(self) -> Path:
        return self.directory / "config.yaml"

    def start(self) -> "Deployment":
        self.config_path.write_text(yaml.safe_dump(self.config))
        from services.config import load_config

        parsed = load_config(self.config_path)
        credentials = supervisor.generated_credentials(parsed)  # closed, as `prfaas up` is
        self.security = GrpcSecurity.of(parsed)
        if token := credentials.get(parsed.security.token_env):
            self.security = dataclasses.replace(self.security, token=token, accepted_tokens=(token,))
        self.children = supervisor.children_for(parsed, self.config_path, self.directory)
        for child in self.children:
            child.argv = self.prefixes.get(child.name, []) + child.argv
            child.env = credentials
            child.start()
        self._wait_healthy(parsed)
        return self

    def stop(self) -> None:
        supervisor.stop_all(self.children)

    def child(self, name: str):
        return next(c for c in self.children if c.name == name)

    def kill(self, name: str) -> None:
        child = self.child(name)
        os.killpg(child.process.pid, signal.SIGKILL)
        child.process.wait()

    def worker_stats(self, name: str) -> pb.WorkerStats:
        worker = next(w for w in self.config["workers"] if w["name"] == name)
        with self.security.channel(f"{worker.get('host', '127.0.0.1')}:{worker['port']}") as channel:
            stub_class = pb_grpc.DecodeWorkerStub if worker.get("service", "decode_worker") == "decode_worker" \
                else pb_grpc.PrefillWorkerStub
            return stub_class(channel).GetStats(pb.StatsRequest(), timeout=5)

    def metrics_text(self) -> str:
        with urllib.request.urlopen(self.base_url + "/metrics", timeout=5) as reply:
            return reply.read().decode()

    def metric(self, sample: str) -> float:
        """A sample's value on the router's /metrics (``name{labels}`` as exported), 0 when absent."""
        match = re.search(rf"^{re.escape(sample)} (\S+)$", self.metrics_text(), re.MULTILINE)
        return float(match.group(1)) if match else 0.0

    def routed(self, path: str) -> float:
        return self.metric(f'prfaas_router_routed_requests_total{{path="{path}"}}')

    def logs(self) -> str:
        return "\n".join(f"--- {c.name} ---\n{c.log_tail(40)}" for c in self.children)

    def _wait_healthy(self, parsed) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        pending = supervisor.grpc_endpoints(parsed)
        while time.monotonic() < deadline:
            if any(c.exited for c in self.children):
                self.stop()
                raise RuntimeError(f"a service exited during start-up:\n{self.logs()}")
            pending = {n: a for n, a in pending.items() if not supervisor.worker_serving(*a, self.security)}
            if not pending and supervisor.router_healthy("127.0.0.1", self.config["router"]["port"]):
                return
            time.sleep(1.0)
        self.stop()
        waiting = ", ".join(f"{name} at {host}:{port}" for name, (host, port) in pending.items()) or "the router"
        raise TimeoutError(f"deployment not healthy after {START_TIMEOUT_S:.0f} s: {waiting} not serving\n"
                           f"{self.logs()}")


def wait_until(predicate, timeout_s: float, interval_s: float = 0.25) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval_s)
    return predicate()


def python() -> str:
    return sys.executable


def run_python(code: str, env: dict | None = None, timeout: float = 600) -> str:
    """Run ``code`` in a fresh interpreter (engines need their own process); returns stdout."""
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout,
                            env={**os.environ, **(env or {})})
    if result.returncode != 0:
        raise RuntimeError(f"subprocess failed ({result.returncode}):\n{result.stderr[-4000:]}")
    return result.stdout
