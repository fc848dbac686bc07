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
ROUTER_VIEW_TIMEOUT_S = 15.0  # for the router's own health polls to see the workers up
_CREDENTIAL_VARIABLES = ("PRFAAS_GRPC_TOKEN", "PRFAAS_KV_SECRET", "PRFAAS_API_KEYS")  # `up` makes its own

_EXCEPTION_LINE = re.compile(r"^([A-Za-z_][\w.]*(Error|Exception|Interrupt)|Killed)\b")


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
    """A deployment for a test, every service its own process: the one way tests start one.

    ``launcher``: "services" starts each service with the supervisor `prfaas up` uses (one process
    group each, so a test can kill one); "up" runs `prfaas up` itself, as an operator does, which
    starts the services and stops them on SIGTERM. ``prefixes``: per service name, words put before
    its command line (e.g. ``ip netns exec NS``). ``env``: added to the services' environment.
    ``only`` and ``credentials``: start only these services, with another deployment's credentials
    (see ``start_router``)."""

    config: dict
    directory: Path
    children: list = field(default_factory=list)
    security: GrpcSecurity = field(default_factory=GrpcSecurity)
    prefixes: dict[str, list[str]] = field(default_factory=dict)
    launcher: str = "services"
    env: dict[str, str] = field(default_factory=dict)
    only: tuple[str, ...] | None = None
    credentials: dict[str, str] = field(default_factory=dict)
    routers: int = 1  # routers in front of the same workers, on consecutive ports (`prfaas up --routers`)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.config['router']['port']}"

    @property
    def base_urls(self) -> list[str]:
        """Every router's URL, replica 0 first."""
        return [f"http://127.0.0.1:{self.config['router']['port'] + i}" for i in range(self.routers)]

    @property
    def config_path(self) -> Path:
        return self.directory / "config.yaml"

    def start(self) -> "Deployment":
        self.directory.mkdir(parents=True, exist_ok=True)
        self.config_path.write_text(yaml.safe_dump(self.config))
        from services.config import load_config

        parsed = load_config(self.config_path)
        try:
            if self.launcher == "up":
                self._start_up(parsed)
            else:
                self._start_services(parsed)
            self._wait_healthy(parsed)
        except BaseException:  # a failed or interrupted start-up leaves no service running
            self.stop()
            raise
        return self

    def start_router(self, directory: Path, **sections) -> "Deployment":
        """Another router, with its own port and ``sections`` (e.g. ``scheduler={...}``) merged into
        this deployment's config, in front of this deployment's running workers and pools, with
        their credentials: a second router replica, as an operator runs one."""
        config = {**self.config, "router": {**self.config["router"], "port": free_port()}}
        for name, section in sections.items():
            config[name] = section if isinstance(section, list) else {**config.get(name, {}), **section}
        return Deployment(config, directory, only=("router",), credentials=self.credentials).start()

    def _start_services(self, parsed) -> None:
        # closed, as `prfaas up` is: a token and a KV secret made here unless configured
        self.credentials = self.credentials or supervisor.generated_credentials(parsed)
        self._use_token(parsed)
        self.children = [c for c in supervisor.children_for(parsed, self.config_path, self.directory, self.routers)
                         if self.only is None or c.name in self.only]
        for child in self.children:
            child.argv = self.prefixes.get(child.name, []) + child.argv
            child.env = {**self.credentials, **self.env}
            child.start()

    def _start_up(self, parsed) -> None:
        """`prfaas up --log-dir DIRECTORY`: the services' logs and the credentials it generates
        (credentials.env) land in this deployment's directory."""
        up = supervisor.Child("up", [sys.executable, "-m", "services.cli", "up", "--config", str(self.config_path),
                                     "--log-dir", str(self.directory), "--routers", str(self.routers)],
                          self.directory / "up.log")
        up.env = {**{k: "" for k in _CREDENTIAL_VARIABLES if k in os.environ}, **self.env}
        self.children = [up]
        up.start()
        written = self.directory / "credentials.env"
        wait_until(lambda: written.exists() or up.exited, START_TIMEOUT_S)
        if written.exists():
            self.credentials = dict(line.split("=", 1) for line in written.read_text().split())
        self._use_token(parsed)

    def _use_token(self, parsed) -> None:
        self.security = GrpcSecurity.of(parsed)
        if token := self.credentials.get(parsed.security.token_env):
            self.security = dataclasses.replace(self.security, token=token, accepted_tokens=(token,))

    def service_pids(self) -> dict[str, int]:
        """With the "up" launcher: the pid of every service `prfaas up` started, from its output."""
        started = re.findall(r"^started (\S+) \(pid (\d+)\)", self.child("up").log_path.read_text(), re.MULTILINE)
        return {name: int(pid) for name, pid in started}

    def stop(self) -> None:
        # `prfaas up` stops its services in stages (the router's drain, then the workers, then the pools:
        # up to about STOP_TIMEOUT_S each) before it exits itself
        supervisor.stop_all(self.children, timeout_s=supervisor.STOP_TIMEOUT_S * (3 if self.launcher == "up" else 1))

    def child(self, name: str):
        return next(c for c in self.children if c.name == name)

    def kill(self, name: str) -> None:
        if self.launcher == "up":
            os.killpg(self.service_pids()[name], signal.SIGKILL)
            return
        child = self.child(name)
        os.killpg(child.process.pid, signal.SIGKILL)
        child.process.wait()

    def worker_stats(self, name: str) -> pb.WorkerStats:
        worker = next(w for w in self.config["workers"] if w["name"] == name)
        with self.security.channel(f"{worker.get('host', '127.0.0.1')}:{worker['port']}") as channel:
            stub_class = pb_grpc.DecodeWorkerStub if worker.get("service", "decode_worker") == "decode_worker" \
                else pb_grpc.PrefillWorkerStub
            return stub_class(channel).GetStats(pb.StatsRequest(), timeout=5)

    def metrics_text(self, url: str | None = None) -> str:
        with urllib.request.urlopen((url or self.base_url) + "/metrics", timeout=5) as reply:
            return reply.read().decode()

    def metric(self, sample: str, url: str | None = None) -> float:
        """A sample's value on the router's /metrics (``name{labels}`` as exported), 0 when absent."""
        match = re.search(rf"^{re.escape(sample)} (\S+)$", self.metrics_text(url), re.MULTILINE)
        return float(match.group(1)) if match else 0.0

    def routed(self, path: str) -> float:
        return self.metric(f'prfaas_router_routed_requests_total{{path="{path}"}}')

    def logs(self) -> str:
        """Each service's last 40 log lines, then every exception line of every log: a CI log keeps
        only its end, and an engine's root cause sits above its own tail."""
        if self.launcher == "up":  # the services' logs are files in the directory `prfaas up` was given
            texts = {path.stem: path.read_text(errors="replace") for path in sorted(self.directory.glob("*.log"))}
        else:
            texts = {c.name: c.log_tail(10_000) for c in self.children}
        tails = "\n".join(f"--- {name} ---\n" + "\n".join(text.splitlines()[-40:]) for name, text in texts.items())
        errors = [f"{name}: {line.strip()}" for name, text in texts.items() for line in text.splitlines()
                  if _EXCEPTION_LINE.match(line.strip())]
        return tails + "\n--- exceptions in the logs ---\n" + ("\n".join(errors[-20:]) or "(none)")

    def _wait_healthy(self, parsed) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        pending = supervisor.grpc_endpoints(parsed)
        while time.monotonic() < deadline:
            if any(c.exited for c in self.children):
                self.stop()
                raise RuntimeError(f"a service exited during start-up:\n{self.logs()}")
            pending = {n: a for n, a in pending.items() if not supervisor.worker_serving(*a, self.security)}
            if not pending and all(supervisor.router_healthy("127.0.0.1", self.config["router"]["port"] + i)
                                   for i in range(self.routers)):
                for url in self.base_urls:
                    self._wait_router_sees_workers(parsed, url=url)
                return
            time.sleep(1.0)
        self.stop()
        waiting = ", ".join(f"{name} at {host}:{port}" for name, (host, port) in pending.items()) or "the router"
        raise TimeoutError(f"deployment not healthy after {START_TIMEOUT_S:.0f} s: {waiting} not serving\n"
                           f"{self.logs()}")


    def _wait_router_sees_workers(self, parsed, timeout_s: float = ROUTER_VIEW_TIMEOUT_S,
                                  url: str | None = None) -> None:
        """The router marks a worker up on its own next health poll, a moment after the worker serves:
        a request sent in between would be routed as if that worker were down. Waits (a bounded time)
        until the router's `prfaas_router_worker_up` says every worker is up, where it can be read."""
        def seen() -> bool:
            try:
                text = self.metrics_text(url)
            except OSError:  # metrics behind an API key, or not served: nothing to wait for
                return True
            return all(re.search(rf'^prfaas_router_worker_up{{worker="{re.escape(w.name)}"}} 1(\.0)?$', text,
                                 re.MULTILINE) for w in parsed.workers)

        wait_until(seen, timeout_s)


def wait_until(predicate, timeout_s: float, interval_s: float = 0.25) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval_s)
    return predicate()


def at_rest(read, timeout_s: float = 10.0, interval_s: float = 0.5):
    """``read()`` once two readings ``interval_s`` apart agree. Workers publish their connector's
    counters every 0.25 s (``kv_connector.stats_file.PUBLISH_S``) and a transfer or store may end
    after its request has answered, so a counter read at once can lag a peer's. Raises if the
    readings are still changing after ``timeout_s``."""
    deadline, last = time.monotonic() + timeout_s, read()
    while time.monotonic() < deadline:
        time.sleep(interval_s)
        current = read()
        if current == last:
            return current
        last = current
    raise AssertionError(f"the reading kept changing for {timeout_s:.0f} s (last {last!r})")


def python() -> str:
    return sys.executable


def run_python(code: str, env: dict | None = None, timeout: float = 600) -> str:
    """Run ``code`` in a fresh interpreter (engines need their own process); returns stdout. The
    interpreter and whatever it starts (vLLM's engine processes) are one process group, killed
    whole on a timeout or an interrupt."""
    process = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True, env={**os.environ, **(env or {})}, start_new_session=True)
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    except BaseException:
        _end_group(process, signal.SIGTERM, grace_s=5.0)
        raise
    # What the interpreter left (vLLM's engine processes, multiprocessing's resource tracker, which
    # unlinks leaked shared memory once its parent is gone) gets a moment, then is killed.
    _end_group(process, None, grace_s=10.0)
    if process.returncode != 0:
        raise RuntimeError(f"subprocess failed ({process.returncode}):\n{stderr[-4000:]}")
    return stdout


def _end_group(process: subprocess.Popen, sig: int | None, grace_s: float) -> None:
    """Send ``sig`` (if any) to the process' group, wait up to ``grace_s`` for the group to empty,
    then SIGKILL what is left; the process itself is reaped."""
    deadline = time.monotonic() + grace_s
    if sig is not None:
        _signal_group(process.pid, sig)
    while time.monotonic() < deadline:
        process.poll()
        if not _signal_group(process.pid, 0):
            break
        time.sleep(0.1)
    _signal_group(process.pid, signal.SIGKILL)
    process.wait()


def _signal_group(pgid: int, sig: int) -> bool:
    """Whether the group had a member to signal."""
    try:
        os.killpg(pgid, sig)
        return True
    except ProcessLookupError:
        return False
