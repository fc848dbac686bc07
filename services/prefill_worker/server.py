"""The PrfaaS prefill worker's gRPC service: PrefillWorker only. The call itself is the workers'
shared runtime (services/engine/worker_rpc.py), which a PD worker serves too."""
from __future__ import annotations

import grpc
from prfaas.v1 import worker_pb2 as pb
from prfaas.v1 import worker_pb2_grpc as pb_grpc

from services.engine import worker_rpc
from services.engine.engine import Engine
from services.engine.serve import CallerGuard, WorkerIdentity


class PrefillWorkerServicer(worker_rpc.PrefillServicer, pb_grpc.PrefillWorkerServicer):
    """PrefillWorker as worker_rpc serves it."""


def add_servicer(engine: Engine, identity: WorkerIdentity, server: grpc.aio.Server, guard: CallerGuard) -> str:
    pb_grpc.add_PrefillWorkerServicer_to_server(PrefillWorkerServicer(engine, identity, guard), server)
    return pb.DESCRIPTOR.services_by_name["PrefillWorker"].full_name
