"""The `prfaas prefill-worker` / `prfaas decode-worker` commands share this runner."""
from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import sys

from services.config import ConfigError, load_config
from services.engine.args import codec_scale_per_tensor
from services.logs import setup_logging
from services.security import check_listeners
from services.security.exposure import worker_listeners

logger = logging.getLogger(__name__)


def add_worker_command(subparsers, command: str, help: str, description: str, run) -> None:
    """A worker service's subcommand: its arguments are the same for every worker service."""
    parser = subparsers.add_parser(command, help=help, description=description)
    add_worker_arguments(parser)
    parser.set_defaults(func=run)


def add_worker_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", required=True, help="deployment YAML file (see deploy/local.yaml)")
    parser.add_argument("--name", required=True, help="which entry of `workers:` in the config to run")
    parser.add_argument("--host", help="override the worker's bind address from the config")
    parser.add_argument("--port", type=int, help="override the worker's gRPC port from the config")
    parser.add_argument("--log-level", choices=["debug", "info", "warning", "error"], help="override logging.level")


def run_worker_command(args: argparse.Namespace, service: str, add_servicer) -> int:
    try:
        config = load_config(args.config)
        worker = config.worker(args.name)
    except ConfigError as exc:
        print(f"prfaas: {exc}", file=sys.stderr)
        return 2
    if worker.service != service:
        print(f"prfaas: worker {worker.name!r} is a {worker.service}, not a {service}", file=sys.stderr)
        return 2
    overrides = {k: v for k, v in (("host", args.host), ("port", args.port)) if v is not None}
    worker = dataclasses.replace(worker, **overrides)
    setup_logging(worker.name, args.log_level or config.logging.level, config.logging.json)
    try:
        check_listeners(config, worker_listeners(config, worker))
    except ConfigError as exc:
        print(f"prfaas: {exc}", file=sys.stderr)
        return 2
    os.environ.update({str(k): str(v) for k, v in worker.env.items()})
    try:
        codec_scale_per_tensor()
    except ValueError as exc:
        print(f"prfaas: worker {worker.name!r}: {exc}", file=sys.stderr)
        return 2
    import uvloop

    from services.engine.serve import serve_worker

    try:
        uvloop.run(serve_worker(config, worker, add_servicer))
    except OSError as exc:
        logger.error("%s", exc)
        return 1
    return 0
