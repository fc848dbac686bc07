"""The KV transport on real loopback sockets: reassembly, authentication, bad frames, backpressure."""
from __future__ import annotations

import logging
import os
import socket
import struct
import subprocess
import threading
import time

import pytest

from services.kv_transport import Frame, KVTransport, TransferDone, TransferFailed, TransportSettings
from services.kv_transport import protocol, telemetry
from services.kv_transport.settings import SettingsError

SECRET = "test-secret"


@pytest.fixture
def pair():
    transports = []

    def make(rx_settings=None, tx_settings=None):
        rx = KVTransport(rx_settings or TransportSettings(secret=SECRET), listen_port=0)
        tx = KVTransport(tx_settings or TransportSettings(secret=SECRET))
        transports.extend([rx, tx])
        return rx, tx, f"127.0.0.1:{rx.port}"

    yield make
    for transport in transports:
        transport.close()


def collect(rx: KVTransport, transfer_id: str, timeout: float = 10.0):
    """Frames of one transfer and how it ended (TransferDone / TransferFailed)."""
    frames, deadline = [], time.monotonic() + timeout
    while time.monotonic() < deadline:
        for event in rx.poll(0.05):
            if event.transfer_id != transfer_id:
                continue
            if isinstance(event, Frame):
                frames.append(event)
            else:
                return frames, event
    return frames, None


@pytest.mark.parametrize("io_threads", [1, 3])
def test_every_frame_arrives_before_its_end_whichever_thread_sent_or_read_it(pair, io_threads):
    """Several I/O threads per side: frames cut as they go out (small unsent allowances) on 6
    connections driven by 3 threads, read by 3; the END frame counts every part, each transfer's
    frames come before its TransferDone, and every byte arrives once."""
    settings = TransportSettings(secret=SECRET, connections_per_peer=6, io_threads=io_threads, frame_bytes=1 << 20,
                                 notsent_lowat_bytes=1 << 16)
    rx, tx, peer = pair(TransportSettings(secret=SECRET, io_threads=io_threads), settings)
    data = {f"t-{i}": os.urandom(64 * 4096) for i in range(8)}
    for transfer_id, payload in data.items():
        for layer in range(4):
            tx.send(peer, transfer_id, layer, 0, 0, 64, payload, divisible=True)
        tx.finish(peer, transfer_id)
    frames: dict[str, list[Frame]] = {transfer_id: [] for transfer_id in data}
    done, deadline = set(), time.monotonic() + 20
    while len(done) < len(data) and time.monotonic() < deadline:
        for event in rx.poll(0.05):
            assert event.transfer_id not in done, f"{event} after its transfer ended"
            if isinstance(event, Frame):
                frames[event.transfer_id].append(event)
            else:
                assert isinstance(event, TransferDone), event
                done.add(event.transfer_id)
    assert done == set(data)
    for transfer_id, payload in data.items():
        for layer in range(4):
            parts = sorted((f for f in frames[transfer_id] if f.layer == layer), key=lambda f: f.block_start)
            assert b"".join(bytes(f.payload) for f in parts) == payload
    assert len(tx._links[peer]._threads) == io_threads
    assert tx.snapshot().peers[0].cpu_s > 0


def test_striped_transfer_reassembles_in_full(pair):
    rx, tx, peer = pair(tx_settings=TransportSettings(secret=SECRET, connections_per_peer=4, frame_bytes=1 << 16))
    layers = {layer: os.urandom(40 * 4096) for layer in range(6)}
    for layer, data in layers.items():
        tx.send(peer, "t-1", layer, layer % 2, 0, 40, data)
    tx.finish(peer, "t-1")
    frames, end = collect(rx, "t-1")
    assert isinstance(end, TransferDone)
    assert len(frames) == 6 * 3  # 40 blocks of 4 KiB in frames of at most 16 blocks
    for layer, data in layers.items():
        parts = sorted((f for f in frames if f.layer == layer), key=lambda f: f.block_start)
        assert b"".join(bytes(f.payload) for f in parts) == data
        assert [f.group for f in parts] == [layer % 2] * 3
    assert len({p.connections for p in tx.snapshot().peers}) == 1
    deadline = time.monotonic() + 5  # the sender counts the transfer once its END frame is written,
    while tx.snapshot().peers[0].transfers_sent != 1 and time.monotonic() < deadline:
        time.sleep(0.01)  # which can be just after the receiver has it
    assert tx.snapshot().peers[0].transfers_sent == 1
    assert rx.snapshot().bytes_received == sum(map(len, layers.values()))


def test_a_layout_frame_and_whole_blocks_have_their_own_meaning_on_the_wire(pair):
    """The layout fingerprint is a LAYOUT frame (counted by END like the data), not a fake layer;
    a pool's one-block frames number their blocks with ``block_index``."""
    rx, tx, peer = pair()
    tx.send_layout(peer, "t-layout", b"fingerprint")
    tx.send(peer, "t-layout", 0xFFFF, 0, 0, 1, b"k" * 64)
    for index in range(3):
        tx.send_block(peer, "t-layout", index, 1, bytes([index]) * 32)
    tx.finish(peer, "t-layout")
    frames, end = collect(rx, "t-layout")
    assert isinstance(end, TransferDone) and len(frames) == 5
    (layout,) = [f for f in frames if f.is_layout]
    assert bytes(layout.payload) == b"fingerprint" and layout.kind == protocol.LAYOUT
    assert [f.layer for f in frames if not f.is_layout and f.num_blocks == 1 and len(f.payload) == 64] == [0xFFFF]
    blocks = sorted((f for f in frames if len(f.payload) == 32), key=lambda f: f.block_index)
    assert [(f.block_index, f.group, bytes(f.payload)[0]) for f in blocks] == [(0, 1, 0), (1, 1, 1), (2, 1, 2)]


def test_telemetry_samples_tcp_info(pair):
    rx, tx, peer = pair()
    tx.send(peer, "t-2", 0, 0, 0, 64, os.urandom(64 << 16))
    tx.finish(peer, "t-2")
    assert isinstance(collect(rx, "t-2")[1], TransferDone)
    link = tx.snapshot().peers[0]
    assert link.rtt_us > 0 and link.cwnd_segments > 0 and link.goodput_bps > 0


def test_telemetry_counts_the_senders_cpu(pair):
    """The I/O thread's own CPU time: more than nothing for 4 MiB written, and far less than the wall
    time of the whole test process (the sending thread is not the one that counted)."""
    rx, tx, peer = pair()
    wall, process = time.monotonic(), time.process_time()
    tx.send(peer, "t-cpu", 0, 0, 0, 64, os.urandom(64 << 16))
    tx.finish(peer, "t-cpu")
    assert isinstance(collect(rx, "t-cpu")[1], TransferDone)
    cpu = tx.snapshot().peers[0].cpu_s
    assert 0 < cpu <= time.process_time() - process + 0.05 and cpu < time.monotonic() - wall + 0.05
    tx.send(peer, "t-cpu2", 0, 0, 0, 64, os.urandom(64 << 16))
    tx.finish(peer, "t-cpu2")
    assert isinstance(collect(rx, "t-cpu2")[1], TransferDone)
    assert tx.snapshot().peers[0].cpu_s > cpu      # cumulative


def test_an_idle_connections_rtt_goes_stale(monkeypatch):
    """A connection that stopped sending keeps the RTT it had (a squeezed link's full queue): the
    snapshot reads RTT only from connections that heard an ACK in the last RTT_FRESH_S."""
    now = [100.0]
    monkeypatch.setattr(telemetry.time, "monotonic", lambda: now[0])
    link = telemetry.PeerTelemetry("peer")
    link.on_sample(1, {"rtt_us": 18_000, "last_ack_recv_ms": 0, "snd_cwnd": 10})
    assert link.snapshot().rtt_us == 18_000
    now[0] += 1.0
    link.on_sample(2, {"rtt_us": 2_000, "last_ack_recv_ms": 50, "snd_cwnd": 10})
    assert link.snapshot().rtt_us == 18_000          # both fresh: the worse one
    now[0] += telemetry.RTT_FRESH_S
    link.on_sample(2, {"rtt_us": 2_500, "last_ack_recv_ms": 10, "snd_cwnd": 10})
    assert link.snapshot().rtt_us == 2_500           # connection 1 has been idle too long
    link.on_sample(2, {"rtt_us": 2_500, "last_ack_recv_ms": int(telemetry.RTT_FRESH_S * 1000) + 1})
    snapshot = link.snapshot()
    assert snapshot.rtt_us == 0 and snapshot.cwnd_segments == 10  # no ACK lately: no reading


def test_wrong_secret_is_refused_at_connect(pair, caplog):
    rx, tx, peer = pair(tx_settings=TransportSettings(secret="other"))
    with caplog.at_level(logging.WARNING):
        tx.send(peer, "t-3", 0, 0, 0, 1, b"x" * 64)
        tx.finish(peer, "t-3")
        deadline = time.monotonic() + 5
        while rx.snapshot().connections_refused == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.2)
    assert rx.snapshot().connections_refused >= 1
    assert tx.snapshot().peers[0].transfers_failed == 1
    assert any("different transport secret" in r.getMessage() for r in caplog.records)
    assert rx.poll(0.1) == []


def _raw_client(port: int, secret: str = SECRET) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=5)
    protocol.client_handshake(sock, secret.encode())
    return sock


def _frame(kind, tid, layer, payload, *, digest=None, length=None, seq=0, num_blocks=1) -> bytes:
    header = protocol.encode_header(kind, tid, layer, 0, 0, num_blocks, seq, payload)
    if digest is not None or length is not None:
        fields = list(protocol.HEADER.unpack(header[:protocol.HEADER.size]))
        fields[-1] = digest if digest is not None else fields[-1]
        fields[-2] = length if length is not None else fields[-2]
        header = protocol.HEADER.pack(*fields) + header[protocol.HEADER.size:]
    return header + payload


def test_version_mismatch_is_refused_with_a_reason(pair, caplog):
    rx, _, _ = pair()
    with caplog.at_level(logging.WARNING), socket.create_connection(("127.0.0.1", rx.port), timeout=5) as sock:
        sock.sendall(struct.pack("!4sH32s", protocol.MAGIC, protocol.PROTOCOL_VERSION + 1, os.urandom(32)))
        magic, version, status = struct.unpack("!4sHB", protocol.recv_exactly(sock, 7))
        (length,) = struct.unpack("!H", protocol.recv_exactly(sock, 2))
        reason = protocol.recv_exactly(sock, length).decode()
    assert status == 1 and version == protocol.PROTOCOL_VERSION
    assert f"protocol version {protocol.PROTOCOL_VERSION + 1} is not supported" in reason
    time.sleep(0.1)
    assert any("refused KV connection" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("case", ["corrupted", "truncated", "oversized"])
def test_bad_frames_fail_their_transfer_and_the_receiver_keeps_serving(pair, case):
    rx, tx, peer = pair(rx_settings=TransportSettings(secret=SECRET, max_frame_bytes=1 << 20))
    payload = os.urandom(4096)
    sock = _raw_client(rx.port)
    if case == "corrupted":
        sock.sendall(_frame(protocol.DATA, "bad", 0, payload, digest=protocol.checksum(payload) ^ 1))
    elif case == "truncated":
        sock.sendall(_frame(protocol.DATA, "bad", 0, payload)[:-100])
        sock.close()
    else:
        sock.sendall(_frame(protocol.DATA, "bad", 0, b"", length=(1 << 20) + 1))
    frames, end = collect(rx, "bad")
    sock.close()
    assert frames == [] and isinstance(end, TransferFailed)
    assert rx.snapshot().frames_rejected == 1
    tx.send(peer, "good", 0, 0, 0, 1, payload)
    tx.finish(peer, "good")
    frames, end = collect(rx, "good")
    assert isinstance(end, TransferDone) and bytes(frames[0].payload) == payload


def test_end_frame_waits_for_frames_from_other_connections(pair):
    rx, _, _ = pair()
    first, second = _raw_client(rx.port), _raw_client(rx.port)
    first.sendall(_frame(protocol.END, "t-4", 0, b"", seq=2, num_blocks=0))
    assert collect(rx, "t-4", timeout=0.3) == ([], None)
    second.sendall(_frame(protocol.DATA, "t-4", 0, b"a" * 16) + _frame(protocol.DATA, "t-4", 1, b"b" * 16))
    frames, end = collect(rx, "t-4")
    assert [f.layer for f in frames] == [0, 1] and isinstance(end, TransferDone)
    first.close()
    second.close()


def test_a_receiver_that_stops_reading_slows_the_sender_without_unbounded_memory(pair):
    limit = 1 << 20
    rx, tx, peer = pair(rx_settings=TransportSettings(secret=SECRET, max_staging_bytes=limit, max_frame_bytes=1 << 18),
                        tx_settings=TransportSettings(secret=SECRET, max_inflight_bytes=limit, connections_per_peer=1,
                                                      max_frame_bytes=1 << 18, send_timeout_s=1.0))
    started = time.monotonic()
    tx.send(peer, "t-5", 0, 0, 0, 1024, bytes(1024 << 17))  # 128 MiB: beyond both budgets and socket buffers
    assert time.monotonic() - started >= 0.9  # the sender was held back ...
    assert rx._receiver.staging.used <= limit + (1 << 18)  # ... and the receiver staged no more than its budget
    assert tx.snapshot().peers[0].transfers_failed == 1


def test_mutual_tls(pair, tmp_path):
    def run(*argv):
        subprocess.run(["openssl", *argv], check=True, capture_output=True, cwd=tmp_path)

    run("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.pem", "-days", "1",
        "-subj", "/CN=prfaas-test-ca")
    run("req", "-newkey", "rsa:2048", "-nodes", "-keyout", "node.key", "-out", "node.csr", "-subj", "/CN=node")
    run("x509", "-req", "-in", "node.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
        "-out", "node.pem", "-days", "1")
    settings = TransportSettings(secret=SECRET, tls_cert=str(tmp_path / "node.pem"),
                                 tls_key=str(tmp_path / "node.key"), tls_ca=str(tmp_path / "ca.pem"))
    rx, tx, peer = pair(settings, settings)
    tx.send(peer, "t-6", 0, 0, 0, 4, os.urandom(4 * 4096))
    payload = os.urandom(64 << 20)  # 128 frames: non-blocking TLS writes fill the sockets
    tx.send(peer, "t-6", 1, 0, 0, 1024, payload)
    tx.finish(peer, "t-6")
    frames, end = collect(rx, "t-6")
    small = [f for f in frames if f.layer == 0]
    large = sorted((f for f in frames if f.layer == 1), key=lambda f: f.block_start)
    assert isinstance(end, TransferDone) and [len(f.payload) for f in small] == [4 * 4096]
    assert b"".join(bytes(f.payload) for f in large) == payload


@pytest.mark.parametrize("raw, error", [
    ({"connections_per_peer": 0}, "transport.connections_per_peer: must be positive"),
    ({"connections": 8}, "transport.connections: unknown key"),
    ({"io_timeout_s": "fast"}, "transport.io_timeout_s: expected float"),
    ({"tls_cert": "a.pem"}, "transport.tls_cert: tls_cert, tls_key and tls_ca go together"),
    ({"notsent_lowat_bytes": 1 << 32}, "transport.notsent_lowat_bytes: .*below 2 GiB"),
    ({"io_threads": 0}, "transport.io_threads: must be positive"),
    ({"io_threads": 65}, "transport.io_threads: 65 is above 64"),
])
def test_settings_errors_name_the_key(raw, error):
    with pytest.raises(SettingsError, match=error):
        TransportSettings.of(raw)


def _silent_peer(read_bytes: int = 0):
    """A peer that completes the handshake, reads ``read_bytes`` and then neither reads nor closes
    (0), or closes after them (> 0). Returns its listening socket and address."""
    listener = socket.create_server(("127.0.0.1", 0))
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 16)
    held = []

    def serve():
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            held.append(conn)
            try:
                protocol.server_handshake(conn, SECRET.encode())
                if read_bytes:
                    protocol.recv_exactly(conn, read_bytes)
                    conn.close()
            except (protocol.ProtocolError, protocol.HandshakeRefused, OSError):
                conn.close()  # the sender gave up on this connection first

    threading.Thread(target=serve, daemon=True).start()
    return listener, held, f"127.0.0.1:{listener.getsockname()[1]}"


def _wait_failed(tx: KVTransport, count: int, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if sum(p.transfers_failed for p in tx.snapshot().peers) >= count:
            return True
        time.sleep(0.05)
    return False


@pytest.mark.parametrize("read_bytes", [0, 1 << 20], ids=["stalls", "resets"])
def test_a_stalled_or_broken_connection_fails_its_transfer_and_other_peers_keep_flowing(pair, read_bytes):
    rx, tx, healthy = pair(tx_settings=TransportSettings(secret=SECRET, io_timeout_s=1.0, connections_per_peer=2))
    listener, held, bad = _silent_peer(read_bytes)
    try:
        # 4 MiB in frames of the 512 KiB the peer announces: more than the sockets hold
        tx.send(bad, "t-bad", 0, 0, 0, 64, os.urandom(64 << 16), divisible=True)
        tx.finish(bad, "t-bad")
        tx.send(healthy, "t-ok", 0, 0, 0, 4, os.urandom(4 * 4096))
        tx.finish(healthy, "t-ok")
        assert isinstance(collect(rx, "t-ok")[1], TransferDone)
        assert _wait_failed(tx, 1, 10.0)  # the stall is found after io_timeout_s; a reset at once
        bad_link = next(p for p in tx.snapshot().peers if p.peer == bad)
        assert bad_link.transfers_failed == 1 and bad_link.transfers_sent == 0
    finally:
        listener.close()
        for conn in held:
            conn.close()


def test_a_sender_that_stalls_mid_frame_fails_its_transfer_and_the_receiver_keeps_serving(pair):
    rx, tx, peer = pair(rx_settings=TransportSettings(secret=SECRET, io_timeout_s=1.0))
    payload = os.urandom(1 << 16)
    sock = _raw_client(rx.port)
    try:
        sock.sendall(_frame(protocol.DATA, "stuck", 0, payload)[:-1000])  # then nothing, and no close
        started = time.monotonic()
        frames, end = collect(rx, "stuck", timeout=10.0)
        assert frames == [] and isinstance(end, TransferFailed) and "middle of a frame" in end.reason
        assert 0.9 <= time.monotonic() - started < 5.0
        tx.send(peer, "after", 0, 0, 0, 1, payload)
        tx.finish(peer, "after")
        frames, end = collect(rx, "after")
        assert isinstance(end, TransferDone) and bytes(frames[0].payload) == payload
    finally:
        sock.close()


def test_waiting_for_a_slow_consumer_is_not_a_stalled_connection(pair):
    """While staging is full the receiver stops reading; a connection whose frame was half in when
    reading stopped, and whose rest waits unread in its socket, is not timed out for that."""
    rx, _, _ = pair(rx_settings=TransportSettings(secret=SECRET, io_timeout_s=0.5, max_staging_bytes=64 << 10))
    first, second = _raw_client(rx.port), _raw_client(rx.port)
    small, large = os.urandom(4 << 10), os.urandom(60 << 10)
    split = _frame(protocol.DATA, "t-split", 0, small)
    first.sendall(split[:len(split) // 2])  # staged (4 KiB); half of its payload is in
    time.sleep(0.2)
    # 4 + 60 KiB fill the budget; the second 60 KiB frame waits for the consumer
    second.sendall(_frame(protocol.DATA, "t-full", 0, large) + _frame(protocol.DATA, "t-full", 1, large, seq=1)
                   + _frame(protocol.END, "t-full", 0, b"", seq=2, num_blocks=0))
    time.sleep(0.2)
    first.sendall(split[len(split) // 2:] + _frame(protocol.END, "t-split", 0, b"", seq=1, num_blocks=0))
    time.sleep(2.0)  # nothing polls for four io_timeout_s
    try:
        events = {}
        deadline = time.monotonic() + 10
        while len(events) < 2 and time.monotonic() < deadline:
            for event in rx.poll(0.05):
                if not isinstance(event, Frame):
                    events[event.transfer_id] = event
        assert all(isinstance(e, TransferDone) for e in events.values()) and set(events) == {"t-split", "t-full"}
    finally:
        first.close()
        second.close()


def test_closing_the_receiver_closes_its_connections(pair):
    rx, _, _ = pair()
    sock = _raw_client(rx.port)
    time.sleep(0.2)  # the connection joins the reading thread
    rx.close()
    sock.settimeout(5)
    assert sock.recv(1) == b""  # the receiver's end was closed
    sock.close()


def test_a_peer_that_hangs_up_during_the_handshake_fails_the_transfer_not_the_sender(pair):
    _, tx, _ = pair()
    listener = socket.create_server(("127.0.0.1", 0))

    def hang_up():
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            protocol.recv_exactly(conn, 38)  # the whole HELLO; then leave without answering
            conn.close()

    threading.Thread(target=hang_up, daemon=True).start()
    peer = f"127.0.0.1:{listener.getsockname()[1]}"
    try:
        tx.send(peer, "t-hangup", 0, 0, 0, 1, b"x" * 4096)
        tx.finish(peer, "t-hangup")
        assert _wait_failed(tx, 1, 5.0)
        time.sleep(1.1)  # past the reconnect back-off: the link tries again, and fails again
        tx.send(peer, "t-hangup-2", 0, 0, 0, 1, b"x" * 4096)
        tx.finish(peer, "t-hangup-2")
        assert _wait_failed(tx, 2, 5.0)
        assert all(thread.is_alive() for thread in tx._links[peer]._threads)
    finally:
        listener.close()


def test_an_unexpected_error_on_one_connection_leaves_the_receiver_serving(pair, monkeypatch, caplog):
    rx, tx, peer = pair(tx_settings=TransportSettings(secret=SECRET, connections_per_peer=1))
    receiver, real = rx._receiver, rx._receiver.on_payload
    calls = []

    def failing_once(*args):
        calls.append(args)
        if len(calls) == 1:
            raise RuntimeError("bug")
        return real(*args)

    monkeypatch.setattr(receiver, "on_payload", failing_once)
    with caplog.at_level(logging.ERROR):
        tx.send(peer, "first", 0, 0, 0, 1, b"a" * 4096)
        tx.finish(peer, "first")
        assert isinstance(collect(rx, "first")[1], TransferFailed)
    assert any("unexpected error" in r.getMessage() for r in caplog.records)
    time.sleep(1.1)  # the sender reconnects after its back-off
    tx.send(peer, "second", 0, 0, 0, 1, b"b" * 4096)
    tx.finish(peer, "second")
    frames, end = collect(rx, "second")
    assert isinstance(end, TransferDone) and bytes(frames[0].payload) == b"b" * 4096


def test_the_first_transfer_after_the_receiver_restarts_goes_through(pair):
    """A restarted decode worker: the sender's old connections were closed by the peer while idle;
    they are noticed and replaced before they carry a frame, so no transfer is lost to them."""
    rx, tx, peer = pair()
    tx.send(peer, "before", 0, 0, 0, 64, os.urandom(64 << 14))
    tx.finish(peer, "before")
    assert isinstance(collect(rx, "before")[1], TransferDone)
    port = rx.port
    rx.close()
    time.sleep(0.7)  # past IDLE_CHECK_S
    restarted = KVTransport(TransportSettings(secret=SECRET), listen_port=port)
    try:
        data = os.urandom(64 << 14)
        tx.send(peer, "after", 0, 0, 0, 64, data)
        tx.finish(peer, "after")
        frames, end = collect(restarted, "after")
        assert isinstance(end, TransferDone)
        assert b"".join(bytes(f.payload) for f in sorted(frames, key=lambda f: f.block_start)) == data
    finally:
        restarted.close()


@pytest.mark.parametrize("pacing_bytes_per_s, expected", [
    (14e6, 140_000),         # one of 8 connections on a 1 Gbit/s WAN: 10 ms of it
    (2e6, 128 << 10),        # slower still: the floor
    (40e9, 1 << 20),         # loopback: the configured ceiling
    (None, 1 << 20),         # no sample: unchanged
])
def test_each_connection_queues_about_ten_ms_of_unsent_bytes(pacing_bytes_per_s, expected):
    from services.kv_transport.sender import PeerLink, _Connection
    from services.kv_transport.telemetry import Clock
    link = PeerLink("127.0.0.1:1", TransportSettings(secret=SECRET), None)
    listener = socket.create_server(("127.0.0.1", 0))
    try:
        with socket.create_connection(listener.getsockname()) as sock:
            conn = _Connection(0, Clock(1.0), sock=sock, notsent_lowat=1 << 20)
            info = None if pacing_bytes_per_s is None else {"pacing_rate_bps": int(pacing_bytes_per_s * 8)}
            link._tune_notsent_lowat(conn, info)
            assert conn.notsent_lowat == expected
            if pacing_bytes_per_s is not None and expected != 1 << 20:
                assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NOTSENT_LOWAT) == expected
            link._tune_notsent_lowat(conn, {"pacing_rate_bps": int(expected * 1.1 * 100 * 8)})  # 10% more:
            assert conn.notsent_lowat == expected  # not worth a system call
    finally:
        listener.close()
        link.close()


def test_a_closed_wake_pipe_never_writes_to_a_reused_descriptor():
    from services.kv_transport.wakeup import WakePipe
    pipe = WakePipe()
    pipe.wake()
    pipe.drain()
    pipe.close()
    reused_r, reused_w = os.pipe2(os.O_NONBLOCK)  # likely the numbers the closed pipe had
    try:
        pipe.wake()  # a late wake-up from another thread
        with pytest.raises(BlockingIOError):
            os.read(reused_r, 1)
    finally:
        os.close(reused_r)
        os.close(reused_w)


def _idle_connection(port: int, source: str) -> socket.socket:
    sock = socket.socket()
    sock.bind((source, 0))
    sock.connect(("127.0.0.1", port))
    return sock


def _closed_by_peer(sock: socket.socket, timeout: float) -> bool:
    sock.settimeout(timeout)
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


def test_connections_that_never_authenticate_are_bounded_and_a_good_sender_goes_on(pair):
    """One address opening many idle connections: at most ``max_pending_handshakes`` stay open (each
    newcomer displaces the oldest), the last ones are closed at the handshake deadline; meanwhile a
    sender from another address completes its transfer."""
    rx_settings = TransportSettings(secret=SECRET, handshake_timeout_s=1.0, max_pending_handshakes=10)
    rx, tx, peer = pair(rx_settings, TransportSettings(secret=SECRET, connections_per_peer=2))
    idle = [_idle_connection(rx.port, "127.0.0.2") for _ in range(40)]
    try:
        assert wait_for(lambda: rx.snapshot().connections_refused >= 30, 5.0)
        payload = os.urandom(1 << 20)
        tx.send(peer, "t-good", 0, 0, 0, 1, payload)
        tx.finish(peer, "t-good")
        frames, end = collect(rx, "t-good")
        assert isinstance(end, TransferDone) and bytes(frames[0].payload) == payload
        started = time.monotonic()
        assert all(_closed_by_peer(sock, 5.0) for sock in idle)  # displaced at once, or at the deadline
        assert time.monotonic() - started < 4.0
        # 30 displaced, 10 at the handshake deadline (counted just after the close the client saw)
        assert wait_for(lambda: rx.snapshot().connections_refused == 40, 2.0), rx.snapshot().connections_refused
    finally:
        for sock in idle:
            sock.close()


def test_a_flood_of_unauthenticated_connections_from_the_peers_own_address_does_not_lock_it_out(pair, caplog):
    """300 idle connections (after a few garbage payloads) from 127.0.0.1, the sender's own address:
    they never count against its ``max_connections_per_peer``, at most ``max_pending_handshakes`` of
    them stay open, and the sender's transfer goes through at once."""
    rx, tx, peer = pair(TransportSettings(secret=SECRET, max_connections_per_peer=8, max_pending_handshakes=16),
                        TransportSettings(secret=SECRET, connections_per_peer=8))
    flood = []
    try:
        for garbage in (b"GET / HTTP/1.1\r\n\r\n", os.urandom(64), b"\x00" * 4096):
            sock = _idle_connection(rx.port, "127.0.0.1")
            sock.sendall(garbage)
            flood.append(sock)
        flood += [_idle_connection(rx.port, "127.0.0.1") for _ in range(300)]
        assert wait_for(lambda: rx.snapshot().connections_refused >= 303 - 16, 5.0), rx.snapshot().connections_refused
        open_now = [sock for sock in flood if not _closed_by_peer(sock, 0.01)]
        assert len(open_now) <= 16
        started = time.monotonic()
        payload = os.urandom(4 << 20)
        tx.send(peer, "t-peer", 0, 0, 0, 16, payload, divisible=True)
        tx.finish(peer, "t-peer")
        frames, end = collect(rx, "t-peer")
        assert isinstance(end, TransferDone), end
        assert b"".join(bytes(f.payload) for f in sorted(frames, key=lambda f: f.block_start)) == payload
        assert time.monotonic() - started < 2.0
        assert tx.snapshot().peers[0].transfers_failed == 0
        assert "max_connections_per_peer" not in caplog.text
    finally:
        for sock in flood:
            sock.close()


def test_authenticated_connections_beyond_the_per_peer_cap_are_refused_with_the_reason(pair, caplog):
    """Two authenticated connections from one address are held open; a third proves the secret and
    is refused at the end of its handshake, with the reason (dialled by hand: a sender dials its
    connections as it has frames for them, so whether it ever opens a third is a matter of timing)."""
    rx, _, _ = pair(TransportSettings(secret=SECRET, max_connections_per_peer=2))
    secret = TransportSettings(secret=SECRET).secret_bytes
    held = []
    try:
        for _ in range(2):
            held.append(socket.create_connection(("127.0.0.1", rx.port), timeout=5))
            protocol.client_handshake(held[-1], secret)
        held.append(socket.create_connection(("127.0.0.1", rx.port), timeout=5))
        with pytest.raises((protocol.HandshakeRefused, ConnectionError)):
            protocol.client_handshake(held[-1], secret)
        assert wait_for(lambda: rx.snapshot().connections_refused >= 1, 5.0)
        assert "2 authenticated connections from 127.0.0.1 already open (max_connections_per_peer)" in caplog.text
    finally:
        for sock in held:
            sock.close()


def wait_for(predicate, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return predicate()


def test_a_payload_is_released_once_all_its_frames_are_sent(pair):
    rx, tx, peer = pair(tx_settings=TransportSettings(secret=SECRET, frame_bytes=1 << 16))
    released = threading.Event()
    data = os.urandom(40 * 4096)
    tx.send(peer, "t-sent", 0, 0, 0, 40, data, on_sent=released.set)  # three frames
    tx.finish(peer, "t-sent")
    frames, end = collect(rx, "t-sent")
    assert isinstance(end, TransferDone) and b"".join(bytes(f.payload) for f in frames) == data
    assert released.wait(5.0)


@pytest.mark.parametrize("connections", [1, 4])
def test_a_frame_goes_out_in_parts_of_a_connections_unsent_allowance(pair, connections):
    """A connection takes about what it may keep unsent (here 16 KiB, 4 blocks) of a frame and
    leaves the rest to whichever connection has room next, so none holds a transfer's tail alone;
    the END frame counts the parts, and the payload is released once, after the last."""
    rx, tx, peer = pair(tx_settings=TransportSettings(secret=SECRET, connections_per_peer=connections,
                                                      frame_bytes=1 << 20, notsent_lowat_bytes=16 << 10))
    released = threading.Event()
    data = os.urandom(64 * 4096)
    tx.send(peer, "t-tail", 3, 1, 100, 64, data, on_sent=released.set, divisible=True)  # one frame of 64 blocks
    tx.finish(peer, "t-tail")
    frames, end = collect(rx, "t-tail")
    assert isinstance(end, TransferDone)
    frames.sort(key=lambda f: f.block_start)
    assert b"".join(bytes(f.payload) for f in frames) == data
    assert [(f.layer, f.group) for f in frames] == [(3, 1)] * len(frames)
    assert [f.block_start for f in frames] == [100 + sum(f.num_blocks for f in frames[:i]) for i in range(len(frames))]
    if connections == 1:
        assert len(frames) == 1  # a lone connection has no one to share with
    else:
        assert [f.num_blocks for f in frames] == [4] * 16
    assert released.wait(5.0)


def test_a_payload_of_a_failed_transfer_is_released_too(pair):
    _, tx, _ = pair()
    released = threading.Event()
    tx.send("127.0.0.1:1", "t-lost", 0, 0, 0, 4, os.urandom(4 * 4096), on_sent=released.set)
    assert released.wait(10.0)


def test_both_ends_count_a_transfer_pending_until_it_ends_and_an_abort_ends_it(pair):
    """A cancelled request's transfer must end on both ends, or its state stays for good."""
    rx, tx, peer = pair()
    tx.send(peer, "done", 0, 0, 0, 1, os.urandom(4096))
    tx.send(peer, "cut", 0, 0, 0, 1, os.urandom(4096))
    assert wait_for(lambda: rx.snapshot().transfers_receiving == 2 and tx.snapshot().transfers_sending == 2, 5.0)
    tx.finish(peer, "done")
    assert isinstance(collect(rx, "done")[1], TransferDone)
    assert wait_for(lambda: rx.snapshot().transfers_receiving == 1 and tx.snapshot().transfers_sending == 1, 5.0)
    tx.abort(peer, "cut", "request cancelled")
    assert isinstance(collect(rx, "cut")[1], TransferFailed)
    assert wait_for(lambda: rx.snapshot().transfers_receiving == 0 and tx.snapshot().transfers_sending == 0, 5.0)


def test_a_peer_that_never_answers_the_handshake_fails_the_transfer_within_the_stall_bound():
    """The kernel accepts the connection, the receiver never speaks: the sender reports the transfer
    failed within ``stall_timeout_s``, and its snapshot names it pending, then failed with why."""
    silent = socket.create_server(("127.0.0.1", 0))
    try:
        tx = KVTransport(TransportSettings(secret=SECRET, stall_timeout_s=0.5))
        peer = f"127.0.0.1:{silent.getsockname()[1]}"
        started = time.monotonic()
        tx.send(peer, "t-dead", 0, 0, 0, 1, b"x" * 64)
        assert tx.snapshot().sends_pending == ("t-dead",)
        assert wait_for(lambda: tx.snapshot().sends_failed, 3.0)
        assert time.monotonic() - started < 1.5
        (failed_id, why), = tx.snapshot().sends_failed
        assert failed_id == "t-dead" and "failed" in why
        assert tx.snapshot().sends_pending == () and tx.snapshot().peers[0].transfers_failed == 1
        tx.close()
    finally:
        silent.close()


def test_a_connection_that_makes_no_progress_fails_its_transfer_within_the_stall_bound():
    tx = KVTransport(TransportSettings(secret=SECRET, stall_timeout_s=1.0, connections_per_peer=1))
    server = socket.create_server(("127.0.0.1", 0))
    peer = f"127.0.0.1:{server.getsockname()[1]}"

    def accept_and_stop_reading():
        conn, _ = server.accept()
        protocol.server_handshake(conn, SECRET.encode())
        time.sleep(5)  # reads nothing: the sender's socket fills and stays full
        conn.close()

    threading.Thread(target=accept_and_stop_reading, daemon=True).start()
    try:
        started = time.monotonic()
        tx.send(peer, "t-stuck", 0, 0, 0, 64, os.urandom(64 << 20), divisible=True)
        assert wait_for(lambda: any(t == "t-stuck" for t, _ in tx.snapshot().sends_failed), 4.0)
        assert time.monotonic() - started < 3.5
    finally:
        tx.close()
        server.close()
