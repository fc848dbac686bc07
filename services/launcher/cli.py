"""`prfaas up`: run a whole deployment on this machine (the embedded default: deploy/local.yaml)."""
from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

DEFAULT_CONFIG = Path(__file__).resolve().parents[2] / "deploy" / "local.yaml"
START_TIMEOUT_S = 600.0
MAX_ROUTERS = 16
ROUTER_EXIT_S = 10.0  # after router.drain_timeout_s, for its streams' error events and its exit


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "up",
        help="start every service of a deployment on this machine (default: the embedded CPU deployment)",
        description="Start the router, every worker and every cache pool (`cache_pools:`) of the deployment "
        "config as separate processes, wait until all are healthy, print the endpoint, and keep them running. "
        "Restart: a service that exits without being asked to is restarted while the others keep serving "
        "(supervisor.restart: on-failure by default, i.e. after a non-zero status or a signal), once what is left "
        "of it (an engine core) has exited (SIGKILL after 10 s) and its backoff has passed "
        "(supervisor.restart_backoff_s, 1 s, doubling up to supervisor.max_restart_backoff_s, 30 s); one that "
        "exits again after supervisor.crash_loop_restarts (5) restarts within supervisor.crash_loop_window_s "
        "(60 s) stops the deployment, with its last log lines. Restarts are logged here and counted in the "
        "router's /metrics (prfaas_launcher_restarts_total). "
        "Stop: Ctrl-C or SIGTERM drains, in order: the router first (new requests get 503 with Retry-After; those "
        "in flight get router.drain_timeout_s, 30 s, to finish, then a stream still going ends with an error "
        "event), "
        "then the workers, each draining its own calls before it stops its engine (up to 40 s), then the cache "
        "pools. A second Ctrl-C or SIGTERM kills what is left at once. Killed outright, `up` leaves each service "
        "a SIGTERM from the kernel: they drain and stop. "
        "Each service's log goes to <logging.dir>/<name>.log.",
    )
    parser.add_argument("--config", type=Path, default=DEFAULT_CONFIG,
                        help=f"deployment YAML file (default: {DEFAULT_CONFIG.relative_to(DEFAULT_CONFIG.parents[1])})")
    parser.add_argument("--log-dir", type=Path, help="override logging.dir from the config")
    parser.add_argument("--routers", type=int, default=1, metavar="N",
                        help="routers to start in front of the same workers, on consecutive ports from router.port "
                        "(router.port, +1, ...); replica 0 makes the role-flip decisions (default: %(default)s)")
    parser.add_argument("--start-timeout", type=float, default=START_TIMEOUT_S,
                        help="seconds to wait for every service to become healthy (default: %(default)s)")
    parser.set_defaults(func=_run)


def _run(args) -> int:
    from services.config import ConfigError, load_config
    from services.engine.args import resolve_model_path
    from services.launcher import supervisor
    from services.launcher.watch import STATS_FILE, Watch
    from services.procs import LAUNCHER_STATS

    from services.security import check_listeners
    from services.security.exposure import deployment_listeners

    if not 1 <= args.routers <= MAX_ROUTERS:
        print(f"prfaas: --routers must be between 1 and {MAX_ROUTERS}, got {args.routers}", file=sys.stderr)
        return 2
    try:
        config = load_config(args.config)
        made = supervisor.generated_credentials(config)
        os.environ.update(made)  # the services inherit them
        check_listeners(config, deployment_listeners(config))
    except ConfigError as exc:
        print(f"prfaas: {exc}", file=sys.stderr)
        return 2
    log_dir = args.log_dir or Path(config.logging.dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    if made:
        path = _write_credentials(log_dir, made)
        print(f"generated credentials for this run: {', '.join(made)} (random; in {path}, mode 0600; set the "
              "variables to choose your own)", flush=True)
    print(f"preparing model {config.model.name} ({config.model.path}) ...", flush=True)
    resolve_model_path(config.model)
    children = supervisor.children_for(config, args.config.resolve(), log_dir, args.routers)
    stats_path = log_dir / STATS_FILE
    for router in children[-args.routers:]:  # the routers export the restart counts
        router.env = {LAUNCHER_STATS: str(stats_path.resolve())}
    stop = _StopRequest()
    signal.signal(signal.SIGTERM, stop.ask)
    signal.signal(signal.SIGINT, stop.ask)
    try:
        for child in children:
            child.start()
            print(f"started {child.name} (pid {child.process.pid}), log: {child.log_path}", flush=True)
        if not _wait_healthy(config, children, args.start_timeout, stop, args.routers):
            return 0 if stop.asked else 1
        _print_ready(config, args.routers)
        watch = Watch(children, config.supervisor, stats_path, say=lambda line: print(line, flush=True))
        while not stop.asked:
            if reason := watch.poll():
                print(reason, file=sys.stderr, flush=True)
                return 1
            time.sleep(0.25)
        return 0
    finally:
        print(f"stopping: the router drains (up to {config.router.drain_timeout_s:.0f} s), then the workers, then "
              "the cache pools; Ctrl-C again stops at once ...", flush=True)
        supervisor.stop_all(children, stage_timeouts_s={supervisor.ROUTER_STAGE: config.router.drain_timeout_s
                                                        + ROUTER_EXIT_S}, hurry=lambda: stop.immediate)
        print("stopped" + (" at once" if stop.immediate else ""), flush=True)


class _StopRequest:
    """The first SIGTERM or SIGINT asks for a draining stop; a second one for an immediate one."""

    def __init__(self) -> None:
        self.count = 0

    def ask(self, signum, frame) -> None:
        self.count += 1

    @property
    def asked(self) -> bool:
        return self.count > 0

    @property
    def immediate(self) -> bool:
        return self.count > 1


def _write_credentials(log_dir: Path, variables: dict[str, str]) -> Path:
    """``NAME=value`` lines, readable by this user only, for tools that call the services directly."""
    path = log_dir / "credentials.env"
    path.unlink(missing_ok=True)
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(descriptor, "w") as file:
        file.writelines(f"{name}={value}\n" for name, value in variables.items())
    return path


def _wait_healthy(config, children, timeout_s: float, stop: _StopRequest, num_routers: int = 1) -> bool:
    from services.launcher import supervisor

    from services.security import GrpcSecurity

    security = GrpcSecurity.of(config)
    pending = supervisor.grpc_endpoints(config)
    deadline = time.monotonic() + timeout_s
    next_note = 0.0
    while time.monotonic() < deadline and not stop.asked:
        if failed := [c for c in children if c.exited]:
            print(f"prfaas: {failed[0].name} exited during start-up; last log lines:\n{failed[0].log_tail()}",
                  file=sys.stderr)
            return False
        pending = {n: a for n, a in pending.items() if not supervisor.worker_serving(*a, security)}
        if not pending and all(supervisor.router_healthy(config.router.host, config.router.port + replica)
                               for replica in range(num_routers)):
            return True
        if time.monotonic() >= next_note:
            waiting = ", ".join(pending) or "router"
            print(f"waiting for {waiting} (vLLM engines take ~30-60 s to start on CPU) ...", flush=True)
            next_note = time.monotonic() + 10
        time.sleep(1.0)
    if not stop.asked:
        print(f"prfaas: services not healthy after {timeout_s:.0f} s; see the logs", file=sys.stderr)
    return False


def _print_ready(config, num_routers: int = 1) -> None:
    from services.router.serve import api_keys

    base = f"http://{config.router.host}:{config.router.port}"
    auth = " -H 'Authorization: Bearer <API key>'" if api_keys(config) else ""
    print(f"\nPrfaaS is up: {base}/v1 (model {config.model.name})")
    for replica in range(1, num_routers):
        print(f"router {replica}: http://{config.router.host}:{config.router.port + replica}/v1 (same workers)")
    print(f"metrics: {base}/metrics    health: {base}/health    Ctrl-C stops everything\n")
    print(f"""try:
  curl {base}/v1/chat/completions -H 'Content-Type: application/json'{auth} \\
    -d '{{"model": "{config.model.name}", "messages": [{{"role": "user", "content": "What is the capital of France?"}}], "max_tokens": 32}}'
""", flush=True)  # noqa: E501  (a command to copy, on one line)
