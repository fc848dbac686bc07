"""The `prfaas` command: one entry point, one sub-command per job.

Each sub-command lives next to the code it runs and exposes ``register(subparsers)``,
which adds its parser and sets ``func`` (called with the parsed args, returns an exit code).
Modules are imported only to build the parser, so they keep heavy imports (vLLM, torch)
inside the functions that need them.
"""
from __future__ import annotations

import argparse
import importlib
import sys

from services.procs import end_with_supervisor

COMMAND_MODULES = (
    "services.launcher.cli",        # up
    "services.router.cli",          # router
    "services.prefill_worker.cli",  # prefill-worker
    "services.decode_worker.cli",   # decode-worker
    "services.cache_pool.cli",      # cache-pool
    "services.planner.cli",         # plan
    "services.simulator.cli",       # simulate
    "services.loadgen.cli",         # bench
    "services.profiler.cli",        # profile
    "services.models.cli",          # model
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="prfaas",
        description="PrfaaS: Prefill-as-a-Service LLM serving (router, prefill and decode workers, "
        "cache pool), capacity planning and load testing.",
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    end_with_supervisor()  # started by `prfaas up` or a deployment of the tests: end with it
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
