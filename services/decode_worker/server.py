"""The decode (PD) worker's gRPC services: DecodeWorker, and PrefillWorker for the router's prefills
(the call itself is the workers' shared runtime, services/engine/worker_rpc.py). Converts protobuf and
calls the engine."""
from __future__ import annotations

import logging

import grpc
from prfaas.v1 import worker_pb2 as pb
from prfaas.v1 import worker_pb2_grpc as pb_grpc

from services.engine import worker_rpc
from services.engine.engine import Engine
from services.engine.serve import CallerGuard, WorkerIdentity
from services.engine.worker_state import Busy
from services.logs import bind_request_id
from services.worker_api import convert
from services.worker_api.types import MAX_TOP_LOGPROBS

logger = logging.getLogger(__name__)


class DecodeWorkerServicer(worker_rpc.WorkerServicer, pb_grpc.DecodeWorkerServicer):
    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext):
        """Streams the request's output; a cancelled call aborts it in the engine."""
        bind_request_id(request.request_id)
        generate_input = convert.generate_input_from_proto(request)
        if not generate_input.prompt_token_ids:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "prompt_token_ids is empty")
        if generate_input.sampling.top_logprobs > MAX_TOP_LOGPROBS:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"sampling.top_logprobs is "
                                f"{generate_input.sampling.top_logprobs}; at most {MAX_TOP_LOGPROBS}")
        try:
            self._guard.roles.check_generate()
        except Busy as exc:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
        logger.debug("request %s: %d prompt tokens", request.request_id, len(request.prompt_token_ids))
        stream = self._engine.generate(generate_input)
        try:
            async for delta in stream:
                yield convert.delta_to_proto(delta)
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        finally:
            await stream.aclose()


class PdPrefillServicer(worker_rpc.PrefillServicer, pb_grpc.PrefillWorkerServicer):
    """The PrefillWorker API of a PD worker, for the prefills the router sends to a prefill role."""


def add_servicer(engine: Engine, identity: WorkerIdentity, server: grpc.aio.Server, guard: CallerGuard) -> str:
    """Registers DecodeWorker and PrefillWorker, whatever the configured role: the engine's connector
    is ``kv_both``, so the router can flip a local PD worker between prefill and decode at run time
    (``scheduler.role_flips``) without telling the worker; it sends prefills only to prefill roles."""
    pb_grpc.add_DecodeWorkerServicer_to_server(DecodeWorkerServicer(engine, identity, guard), server)
    pb_grpc.add_PrefillWorkerServicer_to_server(PdPrefillServicer(engine, identity, guard), server)
    return pb.DESCRIPTOR.services_by_name["DecodeWorker"].full_name
