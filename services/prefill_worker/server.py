"""The PrfaaS prefill worker's gRPC service: PrefillWorker only (services/engine/servicers.py)."""
from __future__ import annotations

import grpc
from prfaas.v1 import worker_pb2 as pb
from prfaas.v1 import worker_pb2_grpc as pb_grpc

from services.engine.engine import Engine
from services.engine.serve import CallerGuard, WorkerIdentity
from services.engine.servicers import PrefillWorkerServicer


def add_servicer(engine: Engine, identity: WorkerIdentity, server: grpc.aio.Server, guard: CallerGuard) -> str:
    pb_grpc.add_PrefillWorkerServicer_to_server(PrefillWorkerServicer(engine, identity, guard), server)
    return pb.DESCRIPTOR.services_by_name["PrefillWorker"].full_name
