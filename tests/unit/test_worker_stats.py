"""The connector's telemetry, from the transport's snapshot to the router's ``WorkerStats``."""
from __future__ import annotations

from types import SimpleNamespace

from services.worker_api import convert
from services.engine.serve import CallerGuard, WorkerIdentity
from services.engine.worker_rpc import stats_message
from services.worker_api.types import EngineStats, LinkStats
from services.kv_connector.snapshot import ConnectorSnapshot, PoolCounters
from services.kv_transport import PROTOCOL_VERSION, PeerSnapshot, TransportSnapshot

SNAPSHOT = ConnectorSnapshot(
    TransportSnapshot(peers=(PeerSnapshot("10.0.0.2:7000", connections=4, bytes_sent=4096, frames_sent=8,
                                          transfers_sent=2, transfers_failed=1, goodput_bps=2.5e9, retransmits=3,
                                          delivery_rate_bps=9_000_000_000, rtt_us=1500, cwnd_segments=40, cpu_s=0.75),),
                      bytes_received=100, frames_rejected=2, connections_refused=1),
    PoolCounters(tokens_loaded=64, tokens_stored=128, loads_failed=1, stores_failed=2))


def test_the_stats_rpc_carries_every_transport_and_pool_figure():
    stats = convert.stats_from_proto(convert.stats_to_proto(EngineStats(kv_connector=SNAPSHOT), worker_name="w"))
    assert stats.kv_links == (LinkStats("10.0.0.2:7000", connections=4, bytes_sent=4096, transfers_sent=2,
                                        transfers_failed=1, goodput_bps=2.5e9, retransmits=3, rtt_ms=1.5,
                                        cwnd_segments=40, delivery_rate_bps=9e9, send_cpu_s=0.75),)
    assert (stats.kv_bytes_received, stats.kv_frames_rejected, stats.kv_connections_refused) == (100, 2, 1)
    assert (stats.kv_pool_tokens_loaded, stats.kv_pool_tokens_stored, stats.kv_pool_loads_failed,
            stats.kv_pool_stores_failed) == (64, 128, 1, 2)
    assert stats.worker_name == "w"


def test_a_worker_without_connector_telemetry_reports_zeros():
    stats = convert.stats_from_proto(convert.stats_to_proto(EngineStats()))
    assert stats.kv_links == () and stats.kv_bytes_received == 0 and stats.kv_pool_tokens_loaded == 0


def test_the_stats_rpc_carries_the_announced_layout():
    stats = convert.stats_from_proto(convert.stats_to_proto(EngineStats(), layout_spec=b'{"version": 1}'))
    assert stats.layout_spec == b'{"version": 1}'
    assert convert.stats_from_proto(convert.stats_to_proto(EngineStats())).layout_spec == b""


def test_a_worker_announces_the_kv_protocol_it_speaks():
    engine = SimpleNamespace(stats=EngineStats, started=False, max_model_len=0, layout_spec=b"")
    guard = CallerGuard(kv_targets=None, rejections=SimpleNamespace(snapshot=dict))
    message = stats_message(engine, WorkerIdentity("w", "decode_worker", "both", "m"), guard)
    assert convert.stats_from_proto(message).kv_protocol_version == PROTOCOL_VERSION > 0
    assert convert.stats_from_proto(convert.stats_to_proto(EngineStats())).kv_protocol_version == 0


def test_a_worker_reports_the_role_it_holds_and_its_hand_off_slots():
    from services.engine.worker_state import HandoffSlots, RoleState

    engine = SimpleNamespace(stats=EngineStats, started=False, max_model_len=0, layout_spec=b"")
    roles, slots = RoleState("decode"), HandoffSlots(2)
    roles.compare_and_set(1, "prefill", True)
    guard = CallerGuard(kv_targets=None, rejections=SimpleNamespace(snapshot=dict), roles=roles, handoffs=slots)
    with slots.held():
        stats = convert.stats_from_proto(stats_message(engine, WorkerIdentity("w", "decode_worker", "decode", "m"),
                                                       guard))
    assert (stats.role, stats.draining, stats.role_generation) == ("prefill", True, 2)
    assert (stats.num_handoffs, stats.max_handoffs, stats.peak_handoffs) == (1, 2, 1)
