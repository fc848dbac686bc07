"""gRPC servicer of the cache pool: converts protobuf, serializes calls into the plain ``CachePool``."""
from __future__ import annotations

import logging
import threading
import time
from concurrent import futures
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from prfaas.v1 import cache_pool_pb2 as pb
from prfaas.v1 import cache_pool_pb2_grpc as pb_grpc

from services.cache_pool_client import convert
from services.cache_pool_client.inbox import TransferError, TransferInbox
from services.cache_pool.metrics import PoolMetrics
from services.cache_pool.pool import CachePool
from services.cache_pool.pushes import MAX_PENDING_PUSHES, Push, PushQueue, PushQueueFull
from services.cache_pool_client.types import Block, BlockMissingError, LeaseExpiredError, PoolFullError, PoolStats
from services.kv_transport import KVTransport, TransportSettings
from services.security import GrpcSecurity, KnownPeers, Rejections

logger = logging.getLogger(__name__)

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["CachePool"].full_name
NO_PEERS = KnownPeers(frozenset(), "deployment's other cache pools (cache_pools[].host:kv_port)")


@dataclass(frozen=True, slots=True)
class PoolIdentity:
    name: str
    cluster: str


class CachePoolServicer(pb_grpc.CachePoolServicer):
    def __init__(self, pool: CachePool, identity: PoolIdentity, inbox: TransferInbox | None = None,
                 peers: KnownPeers = NO_PEERS, rejections: Rejections | None = None,
                 max_pending_pushes: int = MAX_PENDING_PUSHES) -> None:
        """The pool's arena (``pool.arena``), when it has one, is offered to clients on this host.
        ``inbox``: the pool's KV transport, for pool-to-pool copies (None: Push and kv Puts refused).
        ``peers``: the other pools' KV addresses, the only ``kv_target``s a Push may name.
        ``max_pending_pushes``: Pushes queued for the KV transport at most (see ``pushes.py``)."""
        self._pool = pool
        self._identity = identity
        self._inbox = inbox
        self._pushes = PushQueue(inbox.transport, max_pending_pushes) if inbox is not None else None
        self._peers = peers
        self.rejections = rejections or Rejections(identity.name)
        self._lock = threading.Lock()
        self.metrics = PoolMetrics(self.snapshot, self.rejections)
        self._stopped = threading.Event()
        if pool.arena is not None:
            threading.Thread(target=self._expire_leases, name="prfaas-pool-leases", daemon=True).start()

    def snapshot(self) -> PoolStats:
        with self._lock:
            return self._pool.stats

    def Lookup(self, request: pb.LookupRequest, context) -> pb.LookupResponse:
        started = time.perf_counter()
        query = _parsed(convert.lookup_query_from_proto, request, context)
        with self._lock:
            result = self._pool.lookup(query)
        self.metrics.observe_lookup(time.perf_counter() - started)
        return convert.lookup_response(result, self._identity.name, self._identity.cluster)

    def Put(self, request: pb.PutRequest, context) -> pb.PutResponse:
        _parsed(convert.check_put, request, context)
        if request.kv_transfer_id:
            blocks = self._received(request, context)
        else:
            blocks = _parsed(convert.blocks_from_proto, request.blocks, context)
        try:
            with self._lock:
                result = self._pool.put(request.model, blocks, request.transfer_id)
        except PoolFullError as exc:
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
        return pb.PutResponse(num_blocks_stored=result.num_blocks_stored, num_bytes_stored=result.num_bytes_stored)

    def Reserve(self, request: pb.ReserveRequest, context) -> pb.ReserveResponse:
        arena = self._pool.arena
        if arena is None:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, "this pool has no arena: send block bytes inline")
        specs = _parsed(convert.block_specs_from_proto, request, context)
        try:
            with self._lock:
                lease = self._pool.reserve(request.model, specs, request.transfer_id)
        except PoolFullError as exc:
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
        return pb.ReserveResponse(lease_id=lease.lease_id, layout=convert.layout_to_proto(arena.layout),
                                  lease_timeout_s=self._pool.lease_timeout_s,
                                  blocks=[convert.arena_ref(slots) for _, slots in lease.entries])

    def Commit(self, request: pb.CommitRequest, context) -> pb.PutResponse:
        try:
            with self._lock:
                if request.abort:
                    self._pool.abort(request.lease_id)
                    return pb.PutResponse()
                result = self._pool.commit(request.lease_id)
        except LeaseExpiredError:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                          f"lease {request.lease_id!r} expired or is unknown: its slots were freed, nothing stored")
        return pb.PutResponse(num_blocks_stored=result.num_blocks_stored, num_bytes_stored=result.num_bytes_stored)

    def Get(self, request: pb.GetRequest, context) -> pb.GetResponse:
        refs = _parsed(convert.block_refs_from_proto, request, context)
        arena = self._pool.arena if request.arena else None
        try:
            with self._lock:
                if request.transfer_id:
                    blocks = self._pool.take_transfer(request.transfer_id)
                else:
                    blocks = self._pool.get(request.model, refs)
                    if arena is None:  # read the slots while no Put can evict them
                        blocks = [Block(b.group_id, b.block_hash, self._pool.data_bytes(b.data)) for b in blocks]
        except BlockMissingError as exc:
            context.abort(grpc.StatusCode.NOT_FOUND, _missing_message(request, exc.args[0]))
        response = pb.GetResponse()
        convert.add_blocks(response.blocks, blocks)
        if arena is not None and arena.layout is not None:
            response.layout.CopyFrom(convert.layout_to_proto(arena.layout))
        return response

    def Push(self, request: pb.PushRequest, context) -> pb.PushResponse:
        """Reads the blocks now and queues them for the KV transport's sender thread; never waits
        for the transport. RESOURCE_EXHAUSTED when ``max_pending_pushes`` pushes are already queued."""
        if self._inbox is None:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, "this pool has no KV transport (set its kv_port)")
        _parsed(convert.check_push, request, context)
        target = self._push_target(request, context)
        refs = [(b.group_id, b.block_hash) for b in request.blocks]
        try:
            with self._lock:
                blocks = [Block(b.group_id, b.block_hash, self._pool.data_bytes(b.data))
                          for b in self._pool.get(request.model, refs)]
        except BlockMissingError as exc:
            context.abort(grpc.StatusCode.NOT_FOUND, _missing_message(request, exc.args[0]))
        try:
            self._pushes.submit(Push(target, request.kv_transfer_id, blocks))
        except PushQueueFull as exc:
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
        return pb.PushResponse(num_blocks=len(blocks), num_bytes=sum(len(b.data) for b in blocks))

    def _push_target(self, request: pb.PushRequest, context) -> str:
        """A configured peer pool, or a port on the caller's own address; PERMISSION_DENIED otherwise."""
        if request.caller_kv_port:
            return f"{_caller_host(context.peer())}:{request.caller_kv_port}"
        if (why := self._peers.refusal(request.kv_target)) is not None:
            self.rejections.count("unknown_peer")
            logger.warning("cache pool %s: refused Push from %s: %s", self._identity.name, context.peer(), why)
            context.abort(grpc.StatusCode.PERMISSION_DENIED, why)
        return request.kv_target

    def Describe(self, request: pb.DescribeRequest, context) -> pb.DescribeResponse:
        response = pb.DescribeResponse(pool=self._identity.name, cluster=self._identity.cluster,
                                       kv_port=self._inbox.transport.port if self._inbox else 0)
        if (arena := self._pool.arena) is not None:
            mapping = arena.mapping
            response.arena.CopyFrom(pb.SharedArena(path=mapping.path, size=mapping.size, token=mapping.token))
        return response

    @property
    def kv_bytes_received(self) -> int:
        return self._inbox.transport.snapshot().bytes_received if self._inbox is not None else 0

    @property
    def kv_port(self) -> int | None:
        return self._inbox.transport.port if self._inbox is not None else None

    @property
    def arena_path(self) -> str | None:
        return self._pool.arena.mapping.path if self._pool.arena is not None else None

    def close(self) -> None:
        self._stopped.set()
        if self._pool.arena is not None:
            with self._lock:
                self._pool.arena.close()
        if self._inbox is not None:
            self._pushes.close()
            self._inbox.close()

    def _received(self, request: pb.PutRequest, context) -> list[Block]:
        """The blocks of a Put whose bytes another pool pushed over the KV transport."""
        if self._inbox is None:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, "this pool has no KV transport (set its kv_port)")
        refs = _parsed(convert.transfer_block_refs, request.blocks, context)
        try:
            frames = self._inbox.take(request.kv_transfer_id, self._inbox.transport.settings.recv_idle_timeout_s,
                                      context.is_active)
        except TransferError as exc:
            context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, str(exc))
        by_index = {frame.block_index: frame for frame in frames}
        if len(frames) != len(refs) or sorted(by_index) != list(range(len(refs))) or any(
                by_index[i].group != group_id or by_index[i].num_blocks != 1 for i, (group_id, _) in enumerate(refs)):
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"KV transfer {request.kv_transfer_id} does not carry "
                          f"one frame per block of the Put ({len(frames)} frames, {len(refs)} blocks)")
        return [Block(group_id, block_hash, bytes(by_index[i].payload))
                for i, (group_id, block_hash) in enumerate(refs)]

    def _expire_leases(self) -> None:
        """Free the slots of Puts never committed (their client died), a few times per lease timeout."""
        while not self._stopped.wait(min(5.0, max(0.05, self._pool.lease_timeout_s / 4))):
            with self._lock:
                if not self._stopped.is_set():
                    self._pool.expire_leases()

    def GetStats(self, request: pb.CachePoolStatsRequest, context) -> pb.CachePoolStats:
        return convert.stats_to_proto(self.snapshot(), self._identity.name, self._identity.cluster,
                                      self.metrics.num_lookups, self.metrics.lookup_seconds_total)


@dataclass(slots=True)
class RunningPool:
    """A started pool server; ``port`` is the bound port (useful with port 0)."""

    server: grpc.Server
    servicer: CachePoolServicer
    health: health.HealthServicer
    port: int
    probes: grpc.Server | None = None  # the plaintext health-only server (``health_port``)

    def stop(self, grace_s: float | None = None) -> None:
        self.health.enter_graceful_shutdown()
        self.server.stop(grace_s).wait()
        if self.probes is not None:
            self.probes.stop(0).wait()
        self.servicer.close()


def start_pool_server(pool: CachePool, identity: PoolIdentity, host: str, port: int,
                      max_workers: int = 8, kv_port: int | None = None,
                      transport: TransportSettings | None = None, security: GrpcSecurity = GrpcSecurity(),
                      peers: KnownPeers = NO_PEERS, health_port: int | None = None) -> RunningPool:
    """Serve CachePool and grpc.health.v1 (SERVING once started) on ``host:port`` (0: any free port).
    The pool's arena (``pool.arena``, see ``slots.open_arena``) is offered to clients on this host.
    ``kv_port``: listen there (0: any free port) with a KV transport of ``transport`` settings, for
    copies from and to other pools (see ``inbox``), which ``peers`` lists.
    ``security``: TLS, the accepted bearer tokens and message bounds of the gRPC server.
    ``health_port``: also serve the health service alone there, in plaintext (for probes)."""
    rejections = Rejections(identity.name)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=max_workers), options=security.options,
                         interceptors=security.interceptors(rejections))
    inbox = None
    if kv_port is not None:
        settings = transport or TransportSettings()
        inbox = TransferInbox(KVTransport(settings, listen_host=host, listen_port=kv_port),
                              settings.recv_idle_timeout_s)
    servicer = CachePoolServicer(pool, identity, inbox, peers, rejections)
    pb_grpc.add_CachePoolServicer_to_server(servicer, server)
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    bound = security.add_port(server, f"{host}:{port}")
    if bound == 0:
        raise OSError(f"cannot bind gRPC port {host}:{port}")
    probes = None
    if health_port is not None:
        probes = grpc.server(futures.ThreadPoolExecutor(max_workers=1), options=security.options)
        health_pb2_grpc.add_HealthServicer_to_server(health_servicer, probes)
        if probes.add_insecure_port(f"{host}:{health_port}") == 0:
            raise OSError(f"cannot bind health port {host}:{health_port}")
        probes.start()
    server.start()
    for name in ("", SERVICE_NAME):
        health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    return RunningPool(server, servicer, health_servicer, bound, probes)


def _caller_host(peer: str) -> str:
    """The host part of a gRPC peer string (``ipv4:1.2.3.4:5``, ``ipv6:[::1]:5``)."""
    address = peer.partition(":")[2].rpartition(":")[0]
    return address if address.startswith("[") or ":" not in address else f"[{address}]"


def _parsed(parse, message, context):
    try:
        return parse(message)
    except ValueError as exc:
        context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))


def _missing_message(request, missing) -> str:
    if getattr(request, "transfer_id", ""):
        return f"no transfer {request.transfer_id!r} (never put, or already read)"
    _, group_id, block_hash = missing
    return (f"block group {group_id} hash {block_hash.hex()[:16]}… of model {request.model!r} is not stored "
            "(never stored, evicted, or failed its SSD checksum)")
