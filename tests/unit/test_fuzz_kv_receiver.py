"""Random, truncated, oversized and mutated handshakes and frames into a live KV receiver over real
loopback TCP. The receiver must reject each (counting it), never deliver a frame it did not fully
check, and keep serving a good sender's transfers at the same time."""
from __future__ import annotations

import os
import socket
import struct
import time

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from services.kv_transport import Frame, KVTransport, TransferDone, TransferFailed, TransportSettings, codecs, protocol

SECRET = b"fuzz-secret"
SETTINGS = TransportSettings(secret=SECRET.decode(), max_frame_bytes=1 << 16, frame_bytes=1 << 16,
                             handshake_timeout_s=0.5, io_timeout_s=1.0, connections_per_peer=2)


@pytest.fixture(scope="module")
def live():
    rx, tx = KVTransport(SETTINGS, listen_port=0), KVTransport(SETTINGS)
    yield rx, tx, f"127.0.0.1:{rx.port}"
    tx.close()
    rx.close()


def _send_raw(port: int, data: bytes, handshake: bool) -> None:
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        if handshake:
            protocol.client_handshake(sock, SECRET)
        try:
            sock.sendall(data)
            sock.shutdown(socket.SHUT_WR)
            sock.settimeout(2)
            while sock.recv(4096):  # until the receiver closes it (or it ends cleanly between frames)
                pass
        except OSError:
            pass  # refused mid-way: what a rejection looks like from here


def _good_transfer(rx: KVTransport, tx: KVTransport, peer: str, transfer_id: str) -> None:
    payload = os.urandom(4096)
    tx.send(peer, transfer_id, 1, 0, 0, 1, payload)
    tx.finish(peer, transfer_id)
    frames, done, deadline = [], None, time.monotonic() + 10
    while done is None and time.monotonic() < deadline:
        for event in rx.poll(0.05):
            if event.transfer_id == transfer_id:
                frames.append(event) if isinstance(event, Frame) else (done := event)
    assert isinstance(done, TransferDone), done
    assert [bytes(f.payload) for f in frames] == [payload]


def _frame(transfer_id: str, payload: bytes) -> bytes:
    return protocol.encode_header(protocol.DATA, transfer_id, 0, 0, 0, 1, 0, payload) + payload


def _mutate(data: bytes, position: int, value: int, cut: int) -> bytes:
    data = bytearray(data)
    data[position % len(data)] = value
    return bytes(data[:max(1, len(data) - cut)])


FUZZ_IDS = st.text(alphabet="abcdef0123456789", min_size=1, max_size=12).map(lambda s: f"fuzz-{s}")


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.binary(max_size=200))
@example(data=b"PFKV\x00\x01" + b"\x00" * 32)  # right magic, zero nonce, then silence
@example(data=b"PFKV\x00\x09" + b"\x00" * 32)  # a protocol version from the future
def test_random_handshakes_are_refused(live, data):
    rx, tx, peer = live
    refused = rx.snapshot().connections_refused
    _send_raw(rx.port, data, handshake=False)
    _good_transfer(rx, tx, peer, f"good-{os.urandom(4).hex()}")
    assert rx.snapshot().connections_refused == refused + 1  # every connection that did not authenticate


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(transfer_id=FUZZ_IDS, payload=st.binary(min_size=1, max_size=2048), position=st.integers(0, 10**6),
       value=st.integers(0, 255), cut=st.integers(0, 64), junk=st.binary(max_size=64))
@example(transfer_id="fuzz-len", payload=b"x" * 16, position=38, value=0xFF, cut=0, junk=b"")  # length byte
def test_mutated_frames_after_a_good_handshake_never_deliver_wrong_bytes(live, transfer_id, payload, position,
                                                                          value, cut, junk):
    rx, tx, peer = live
    frame = _frame(transfer_id, payload)
    mutated = _mutate(frame, position, value, cut) + junk
    _send_raw(rx.port, mutated, handshake=True)
    delivered = []
    deadline = time.monotonic() + 0.3
    while time.monotonic() < deadline:
        delivered += [e for e in rx.poll(0.05) if isinstance(e, Frame) and e.transfer_id.startswith("fuzz-")]
    for event in delivered:  # whatever got through matched the checksum its header announced
        digest = protocol.HEADER.unpack(mutated[:protocol.HEADER.size])[-1]
        assert protocol.checksum(event.payload) == digest
    _good_transfer(rx, tx, peer, f"good-{os.urandom(4).hex()}")


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(size=st.integers((1 << 16) + 1, 1 << 40))
def test_oversized_frames_are_refused_before_any_payload_is_staged(live, size):
    rx, tx, peer = live
    rejected = rx.snapshot().frames_rejected
    header = bytearray(protocol.encode_header(protocol.DATA, "fuzz-big", 0, 0, 0, 1, 0, b"x"))
    fields = list(protocol.HEADER.unpack(bytes(header[:protocol.HEADER.size])))
    fields[-2] = size
    header[:protocol.HEADER.size] = protocol.HEADER.pack(*fields)
    _send_raw(rx.port, bytes(header) + b"x" * 1024, handshake=True)
    deadline = time.monotonic() + 5
    while rx.snapshot().frames_rejected == rejected and time.monotonic() < deadline:
        rx.poll(0.05)
    assert rx.snapshot().frames_rejected > rejected
    assert rx._receiver.staging.used == 0
    _good_transfer(rx, tx, peer, f"good-{os.urandom(4).hex()}")


FP8_SETTINGS = TransportSettings(secret=SECRET.decode(), max_frame_bytes=1 << 16, frame_bytes=1 << 16,
                                 handshake_timeout_s=0.5, io_timeout_s=1.0, connections_per_peer=2, codec="fp8")


@pytest.fixture(scope="module")
def live_fp8():
    rx = KVTransport(FP8_SETTINGS, listen_port=0)
    yield rx
    rx.close()


def _send_coded(port: int, data: bytes, offer: int) -> None:
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        protocol.client_handshake(sock, SECRET, offer)
        sock.sendall(data)
        sock.shutdown(socket.SHUT_WR)
        sock.settimeout(2)
        while sock.recv(4096):
            pass


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(transfer_id=FUZZ_IDS, codec=st.integers(0, 255), row_elems=st.integers(0, 40), scales=st.lists(
    st.floats(width=32, allow_nan=True, allow_infinity=True), min_size=0, max_size=4),
    values=st.binary(max_size=160), fp8_receiver=st.booleans(), offer_fp8=st.booleans())
@example(transfer_id="fuzz-ok", codec=1, row_elems=4, scales=[1.0, 2.0], values=b"\x01" * 8, fp8_receiver=True,
         offer_fp8=True)
@example(transfer_id="fuzz-raw-link", codec=1, row_elems=4, scales=[1.0], values=b"\x01" * 4, fp8_receiver=False,
         offer_fp8=True)
def test_coded_frames_that_do_not_match_the_handshake_are_refused_and_counted(live, live_fp8, transfer_id, codec,
                                                                              row_elems, scales, values, fp8_receiver,
                                                                              offer_fp8):
    rx = live_fp8 if fp8_receiver else live[0]
    transfer_id = f"{transfer_id}-{os.urandom(4).hex()}"  # a refused transfer's id is remembered as over
    agreed = codecs.agree(codecs.offer("fp8" if fp8_receiver else "none"), codecs.offer("fp8" if offer_fp8 else "none"))
    payload = struct.pack(f"<{len(scales)}f", *scales) + values
    frame = protocol.encode_header(protocol.DATA, transfer_id, 0, 0, 0, 1, 0, payload, codec, row_elems) + payload
    rejected = rx.snapshot().frames_rejected
    _send_coded(rx.port, frame, codecs.offer("fp8" if offer_fp8 else "none"))
    events, deadline = [], time.monotonic() + 2
    while not events and time.monotonic() < deadline:
        events = [e for e in rx.poll(0.05) if e.transfer_id == transfer_id]
    problem = codecs.payload_problem(codec, row_elems, agreed, memoryview(payload))
    if problem is None:
        assert isinstance(events[0], Frame) and (events[0].codec, events[0].row_elems) == (codec, row_elems)
        assert bytes(events[0].payload) == payload
    else:
        assert events and isinstance(events[0], TransferFailed), events
        assert rx.snapshot().frames_rejected == rejected + 1
