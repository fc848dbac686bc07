"""Where one producer rank sends a request's KV (issue 19): to which consumer ranks, under which wire
id, and which pieces of each layer.

A consumer engine with TP size M receives on M ports: rank r at the worker's ``kv_port + r``. With
equal TP sizes producer rank r sends its whole pages to consumer rank r. With different TP sizes it
plans the ``LayoutMap`` from its own spec and the same model at the consumer's TP size, and sends
each consumer rank that owns some of its units those pieces, layer by layer, in the map's order
(the consumer plans the same map from the announcements and reads them in that order). A producer
engine with several ranks names each rank's stream ``<transfer id>#p<rank>``, so that a consumer rank
fed by several producer ranks completes the transfer only when every one of them has finished.

Where the consumer holds a unit on several ranks (more TP ranks than KV heads, which vLLM replicates),
the unit still crosses the link once: the consumer rank that receives it passes each frame on to its
replicas over the host's loopback, as the stream ``<stream id>#f<its rank>``.
"""
from __future__ import annotations

from dataclasses import dataclass

from services.kv_connector.layouts.mapping import Piece, Unmappable, data_path_problem, plan_mapping
from services.kv_connector.layouts.spec import SLICEABLE_LAYOUTS, LayoutSpec, describe_layout

WIRE_SEPARATOR = "#p"
FORWARD_SEPARATOR = "#f"


@dataclass(frozen=True, slots=True)
class Route:
    """One consumer rank and what goes there: ``pieces`` by layer name (empty: only the announcement,
    which that rank will refuse), or None for whole pages."""
    dst_rank: int
    pieces: dict[str, tuple[Piece, ...]] | None = None


def wire_id(transfer_id: str, spec: LayoutSpec | None) -> str:
    """The id of this rank's stream of ``transfer_id``."""
    return transfer_id if spec is None or spec.tp_size == 1 else f"{transfer_id}{WIRE_SEPARATOR}{spec.tp_rank}"


def forwarded_id(wire: str, via: int) -> str:
    """The id of a stream passed on by consumer rank ``via`` to a rank that replicates its units."""
    return f"{wire}{FORWARD_SEPARATOR}{via}"


def transfer_of(wire: str) -> str:
    """The transfer a stream belongs to."""
    return wire.split("#", 1)[0]


def via_of(wire: str) -> int | None:
    """The consumer rank that passed this stream on, or None for a stream from the producer."""
    _, separator, rank = wire.rpartition(FORWARD_SEPARATOR)
    return int(rank) if separator and rank.isdigit() else None


def expected_wire_ids(transfer_id: str, src: LayoutSpec | None, sources: tuple[tuple[int, int | None], ...],
                      wire: str) -> frozenset[str]:
    """The streams a consumer rank waits for (``layout_map.sources_of``), learnt from one
    announcement."""
    if src is None or not sources:
        return frozenset({wire})
    return frozenset(wire_id(transfer_id, src.for_rank(rank)) if via is None
                     else forwarded_id(wire_id(transfer_id, src.for_rank(rank)), via) for rank, via in sources)


def rank_peer(peer: str, rank: int) -> str:
    """Consumer rank ``rank``'s KV address, from the engine's (rank 0's) ``host:port``."""
    if rank == 0:
        return peer
    host, _, port = peer.rpartition(":")
    return f"{host}:{int(port) + rank}"


def plan_routes(spec: LayoutSpec | None, consumer_tp: int) -> tuple[list[Route], str | None]:
    """This rank's routes to a consumer engine of ``consumer_tp`` ranks, and, where no pieces can be
    planned, why: then every consumer rank gets the announcement alone, refuses it at once and the
    consumer recomputes the prompt (the router does not pair such workers)."""
    announce_only = [Route(rank, {}) for rank in range(consumer_tp)]
    if spec is None:
        return ([Route(0)], None) if consumer_tp == 1 else (announce_only, "this engine's layout has no description")
    if consumer_tp == spec.tp_size:
        return [Route(spec.tp_rank)], None
    fallback = announce_only
    try:
        consumer = spec.at_tp(consumer_tp)
    except ValueError as error:
        return fallback, f"the model does not split over the consumer's TP {consumer_tp}: {error}"
    result = plan_mapping([spec.for_rank(r) for r in range(spec.tp_size)],
                          [consumer.for_rank(r) for r in range(consumer_tp)])
    if isinstance(result, Unmappable):
        return fallback, result.reason
    if spec.cache_layout not in SLICEABLE_LAYOUTS:
        return fallback, (f"head slicing reads the cache layouts this connector maps only "
                          f"(this engine's: {describe_layout(spec.cache_layout)})")
    if problem := data_path_problem(result, spec, consumer.for_rank(0)):
        return fallback, problem
    routes = []
    for dst_rank in range(consumer_tp):
        pieces: dict[str, list[Piece]] = {}
        for piece in result.pieces_to(dst_rank):
            if piece.src_rank == spec.tp_rank:
                pieces.setdefault(spec.layers[piece.layer].name, []).append(piece)
        if pieces:
            routes.append(Route(dst_rank, {name: tuple(group) for name, group in pieces.items()}))
    return routes, None
