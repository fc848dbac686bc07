"""`prfaas router`: run the OpenAI-compatible router."""
from __future__ import annotations

import sys


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "router",
        help="run the OpenAI-compatible HTTP router",
        description="Serve /v1/models, /v1/completions, /v1/chat/completions, /health and /metrics, "
        "routing each request to the workers listed in the deployment config.",
    )
    parser.add_argument("--config", required=True, help="deployment YAML file (see deploy/local.yaml)")
    parser.add_argument("--host", help="override router.host from the config")
    parser.add_argument("--port", type=int, help="override router.port from the config")
    parser.add_argument("--replica", type=int, default=0,
                        help="this router's number among several in front of the same workers (default 0); with "
                        "router.role_decisions: replica-0, only replica 0 makes role-flip decisions")
    parser.add_argument("--log-level", choices=["debug", "info", "warning", "error"], help="override logging.level")
    parser.set_defaults(func=_run)


def _run(args) -> int:
    import uvloop

    from services.config import ConfigError, load_config
    from services.logs import setup_logging
    from services.router.serve import serve_router

    try:
        config = load_config(args.config)
    except ConfigError as exc:
        print(f"prfaas: {exc}", file=sys.stderr)
        return 2
    setup_logging("router", args.log_level or config.logging.level, config.logging.json)
    host = args.host or config.router.host
    port = args.port if args.port is not None else config.router.port
    from services.security import check_listeners
    from services.security.exposure import router_listeners

    try:
        check_listeners(config, router_listeners(host))
    except ConfigError as exc:
        print(f"prfaas: {exc}", file=sys.stderr)
        return 2
    try:
        uvloop.run(serve_router(config, host, port, args.replica))
    except OSError as exc:
        print(f"prfaas: router cannot start: {exc}", file=sys.stderr)
        return 1
    return 0
