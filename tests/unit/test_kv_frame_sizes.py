"""The receiver's frame size, announced at the KV handshake: senders cut frames of whole blocks at the
smaller of their own cap and it, refuse a receiver whose announcement is out of bounds, and a
connector whose KV cache is on CUDA asks for 8 MiB frames unless `transport.frame_bytes` says
otherwise."""
from __future__ import annotations

import os
import socket
import threading
import time
from functools import partial
from types import SimpleNamespace

import pytest
import torch

from services.config import ConfigError, parse_config
from services.kv_connector.device.streams import Device
from services.kv_connector.layouts.pages import KVLayout
from services.kv_connector.settings import ConnectorSettings
from services.kv_connector.worker import PrfaasConnectorWorker
from services.kv_transport import Frame, KVTransport, TransferDone, TransportSettings, protocol
from services.kv_transport.protocol import FrameSizes, HandshakeRefused
from services.kv_transport.settings import SettingsError
from support.sync_recorder import recording_syncs

SECRET = "frame-sizes-secret"
BLOCK = 4096


@pytest.fixture
def transports():
    opened: list[KVTransport] = []

    def open_(*args, **kwargs) -> KVTransport:
        opened.append(KVTransport(*args, **kwargs))
        return opened[-1]

    yield open_
    for transport in opened:
        transport.close()


def _sent_frames(rx: KVTransport, tx: KVTransport, transfer_id: str, num_blocks: int,
                 divisible: bool = True) -> list[Frame]:
    """The frames one payload of ``num_blocks`` blocks arrived as, in block order, checked whole."""
    peer, payload = f"127.0.0.1:{rx.port}", os.urandom(num_blocks * BLOCK)
    tx.send(peer, transfer_id, 0, 0, 0, num_blocks, payload, divisible=divisible)
    tx.finish(peer, transfer_id)
    frames, deadline = [], time.monotonic() + 10
    while time.monotonic() < deadline:
        events = [e for e in rx.poll(0.05) if e.transfer_id == transfer_id]
        frames += [e for e in events if isinstance(e, Frame)]
        if any(isinstance(e, TransferDone) for e in events):
            frames.sort(key=lambda f: f.block_start)
            assert b"".join(bytes(f.payload) for f in frames) == payload
            return frames
    raise AssertionError(f"transfer {transfer_id} did not complete")


def test_the_sender_cuts_frames_at_the_size_the_receiver_announces(transports):
    """The receiver asks for 64 KiB (16 blocks); the sender's own cap is the 8 MiB default. The first
    transfer, cut before any handshake, is cut again per connection; later ones at the size itself."""
    rx = transports(TransportSettings(secret=SECRET), listen_port=0, frame_bytes=64 << 10)
    tx = transports(TransportSettings(secret=SECRET, connections_per_peer=1))
    assert rx.receive_frame_bytes == 64 << 10
    first = _sent_frames(rx, tx, "t-first", 40)
    assert all(len(f.payload) <= 64 << 10 for f in first) and len(first) == 3
    assert tx.frame_bytes(f"127.0.0.1:{rx.port}") == 64 << 10
    assert [f.num_blocks for f in _sent_frames(rx, tx, "t-later", 40)] == [16, 16, 8]


def test_the_senders_cap_wins_when_it_is_smaller(transports):
    rx = transports(TransportSettings(secret=SECRET), listen_port=0, frame_bytes=8 << 20)
    tx = transports(TransportSettings(secret=SECRET, connections_per_peer=1, frame_bytes=16 << 10))
    assert rx.receive_frame_bytes == 8 << 20
    assert [f.num_blocks for f in _sent_frames(rx, tx, "t-capped", 10)] == [4, 4, 2]
    assert tx.frame_bytes(f"127.0.0.1:{rx.port}") == 16 << 10


def test_a_payload_that_is_not_whole_blocks_in_a_row_is_cut_at_the_senders_cap_alone(transports):
    """Pieces of heads (a consumer of another TP size) are made at most ``frame_bytes(peer)`` long;
    a finer cut after a handshake would split them across pieces, so only the cap cuts them."""
    rx = transports(TransportSettings(secret=SECRET), listen_port=0, frame_bytes=16 << 10)
    tx = transports(TransportSettings(secret=SECRET, connections_per_peer=1, frame_bytes=64 << 10))
    _sent_frames(rx, tx, "t-open", 1)
    assert [f.num_blocks for f in _sent_frames(rx, tx, "t-pieces", 40, divisible=False)] == [16, 16, 8]


@pytest.mark.parametrize("frame_bytes, max_frame_bytes, service_default, announced", [
    (0, 8 << 20, 512 << 10, 512 << 10),  # unset: the receiving service's default
    (0, 8 << 20, 8 << 20, 8 << 20),
    (0, 1 << 20, 8 << 20, 1 << 20),  # never above what the receiver accepts
    (256 << 10, 8 << 20, 8 << 20, 256 << 10),  # set: it wins over the service's default
])
def test_what_a_receiver_announces(frame_bytes, max_frame_bytes, service_default, announced):
    settings = TransportSettings(frame_bytes=frame_bytes, max_frame_bytes=max_frame_bytes)
    assert settings.frame_sizes(service_default) == FrameSizes(announced, max_frame_bytes)


def _announcing(frames: FrameSizes) -> tuple[socket.socket, list[str]]:
    """A receiver that announces ``frames``; what its handshakes ended with."""
    listener, outcomes = socket.create_server(("127.0.0.1", 0)), []

    def serve() -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            with conn:
                try:
                    protocol.server_handshake(conn, SECRET.encode(), frames=frames)
                    outcomes.append("admitted")
                except (HandshakeRefused, protocol.ProtocolError, OSError) as exc:
                    outcomes.append(str(exc))

    threading.Thread(target=serve, daemon=True).start()
    return listener, outcomes


@pytest.mark.parametrize("frames", [FrameSizes(0, 8 << 20), FrameSizes((8 << 20) + 1, 8 << 20)],
                         ids=["empty", "above-its-limit"])
def test_a_receiver_announcing_frame_sizes_out_of_bounds_is_refused_with_the_reason(transports, frames):
    listener, outcomes = _announcing(frames)
    peer = f"127.0.0.1:{listener.getsockname()[1]}"
    try:
        with socket.create_connection(("127.0.0.1", listener.getsockname()[1]), timeout=5) as sock, \
                pytest.raises(HandshakeRefused, match=f"announced frames of {frames.preferred} bytes with a limit"):
            protocol.client_handshake(sock, SECRET.encode())
        tx = transports(TransportSettings(secret=SECRET, connections_per_peer=1))
        tx.send(peer, "t-refused", 0, 0, 0, 1, os.urandom(BLOCK))
        deadline = time.monotonic() + 10
        while not tx.snapshot().sends_failed and time.monotonic() < deadline:
            time.sleep(0.05)
        [(transfer_id, reason)] = tx.snapshot().sends_failed
        assert transfer_id == "t-refused" and f"announced frames of {frames.preferred} bytes" in reason
        assert outcomes and all("refused its frame sizes" in outcome for outcome in outcomes)
    finally:
        listener.close()


def test_a_receiver_within_bounds_is_admitted_and_its_sizes_reach_the_sender():
    listener, outcomes = _announcing(FrameSizes(8 << 20, 8 << 20))
    try:
        with socket.create_connection(("127.0.0.1", listener.getsockname()[1]), timeout=5) as sock:
            assert protocol.client_handshake(sock, SECRET.encode()).frames == FrameSizes(8 << 20, 8 << 20)
        deadline = time.monotonic() + 5
        while not outcomes and time.monotonic() < deadline:
            time.sleep(0.01)
        assert outcomes == ["admitted"]
    finally:
        listener.close()


def _layout() -> KVLayout:
    spec = SimpleNamespace(block_size=16, num_kv_heads=2, head_size=8, dtype=torch.bfloat16)
    config = SimpleNamespace(num_blocks=4, kv_cache_groups=[SimpleNamespace(layer_names=["l0"], kv_cache_spec=spec)])
    return KVLayout(config, {"l0": torch.zeros(4, 2, 16, 16, dtype=torch.bfloat16)})


@pytest.mark.parametrize("cuda, transport, announced", [
    (True, {}, 8 << 20),
    (False, {}, 512 << 10),
    (True, {"frame_bytes": 1 << 20}, 1 << 20),  # the deployment's setting wins over the device's default
    (True, {"max_frame_bytes": 2 << 20}, 2 << 20),
])
def test_a_consumer_announces_its_devices_frame_size(cuda, transport, announced):
    """The connector's worker core on the CPU stand-in of a CUDA device (the one the connector's other
    unit tests drive its CUDA branches with), and on CPU: what a producer's handshake tells it."""
    settings = ConnectorSettings(listen_port=0, transport={"secret": SECRET, **transport}, host_ring_bytes=1 << 20,
                                 host_ring_slot_bytes=64 << 10)
    with recording_syncs() as (device_of, _):
        worker = PrfaasConnectorWorker(partial(settings.open_streams, 0), settings.worker_settings,
                                       device_of=device_of if cuda else Device)
        worker.register_kv_caches(_layout())
    try:
        assert worker.streams.receive_frame_bytes == announced
        with socket.create_connection(("127.0.0.1", worker.streams.port), timeout=5) as sock:
            assert protocol.client_handshake(sock, SECRET.encode()).frames.preferred == announced
    finally:
        worker.shutdown()


@pytest.mark.parametrize("transport, why", [
    ({"frame_bytes": -1}, "transport.frame_bytes: must be 0 (each end's default) or positive, got -1"),
    ({"frame_bytes": 16 << 20}, "transport.frame_bytes: 16777216 is above max_frame_bytes (8388608)"),
    ({"max_frame_bytes": 1 << 64}, "transport.max_frame_bytes: 18446744073709551616 does not fit"),
    ({"max_frame_bytes": 0}, "transport.max_frame_bytes: must be positive, got 0"),
])
def test_bad_frame_sizes_are_configuration_errors_that_name_the_key(transport, why):
    with pytest.raises(SettingsError, match=why.replace("(", r"\(").replace(")", r"\)")):
        TransportSettings.of(transport)
    with pytest.raises(ConfigError, match=r"^transport\.(max_)?frame_bytes: "):
        parse_config({"transport": transport})
