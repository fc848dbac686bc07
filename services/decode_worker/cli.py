"""`prfaas decode-worker`: run one local PD-cluster worker."""
from __future__ import annotations


def register(subparsers) -> None:
    from services.engine.command import add_worker_command

    add_worker_command(
        subparsers, "decode-worker",
        help="run a local PD-cluster worker (vLLM engine; role prefill, decode or both)",
        description="Run one decode worker from the deployment config: a vLLM engine behind the "
        "DecodeWorker gRPC service (proto/prfaas/v1/worker.proto) and gRPC health checking.",
        run=_run)


def _run(args) -> int:
    from services.decode_worker.server import add_servicer
    from services.engine.command import run_worker_command

    return run_worker_command(args, "decode_worker", add_servicer)
