"""`prfaas prefill-worker`: run one PrfaaS-cluster prefill worker."""
from __future__ import annotations


def register(subparsers) -> None:
    from services.engine.command import add_worker_command

    add_worker_command(
        subparsers, "prefill-worker",
        help="run a PrfaaS-cluster prefill worker (vLLM engine)",
        description="Run one prefill worker from the deployment config: a vLLM engine behind the "
        "PrefillWorker gRPC service (proto/prfaas/v1/worker.proto) and gRPC health checking.",
        run=_run)


def _run(args) -> int:
    from services.engine.command import run_worker_command
    from services.prefill_worker.server import add_servicer

    return run_worker_command(args, "prefill_worker", add_servicer)
