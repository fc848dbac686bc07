"""The KV stream wire format, version 5.

A connection starts with a handshake (client → server) that checks the protocol version, agrees on
a KV codec (``codecs``), tells the sender the receiver's frame sizes and proves, in both directions,
knowledge of the shared secret without sending it; the offers and the frame sizes are inside the
proofs, so no one between the ends can change them::

    C: HELLO      magic "PFKV", version, client nonce, then the client's codec offer
    S: CHALLENGE  magic, version, status 0, server nonce, server offer, frame sizes,
                  HMAC(secret, "S" | client nonce | server nonce | client offer | server offer | frame sizes)
       or REFUSE  magic, version, status 1, reason          (and closes)
    C: PROOF      HMAC(secret, "C" | server nonce | client nonce | client offer | server offer | frame sizes)
    S: OK (status 0) or REFUSE (status 1, reason)

An offer is a bit mask of codec ids; both ends take the preferred codec both offer
(``codecs.agree``), ``none`` when they share no other. The frame sizes (``FrameSizes``, two
unsigned 64-bit integers) are the payload the receiver wants per frame and the most it accepts: the
sender cuts runs of whole blocks at the smaller of its own cap and the first, and never above the
second. A sender refuses a receiver whose sizes are out of bounds (``FrameSizes.problem``): it
closes without a PROOF.

Then only frames flow, client → server: a fixed header, the transfer id, the payload. Frames of
one transfer may travel on different connections; ``seq`` numbers them and the END frame carries
their count, so the receiver knows when a transfer is complete whatever the arrival order.

Frame kinds:

- DATA: blocks ``[block_start, block_start + num_blocks)`` of layer ``layer`` of KV-cache group
  ``group``, coded with ``codec`` (``none``, or the codec of the handshake; ``row_elems`` values per
  scale, 0 when raw: ``codecs`` has the payload formats). A cache pool's transfer moves whole blocks
  instead, one per DATA frame: there ``layer`` is the block's index in the transfer
  (``block_frame_fields``; read back as ``Frame.block_index``).
- LAYOUT: the producer's KV layout (payload): its fingerprint, then a newline and its ``LayoutSpec``
  where it can describe itself (``kv_connector/layouts/reblock.py``). The consumer writes no block before it
  has checked it: identical layouts copy pages as they are, others are re-blocked or refused.
  ``layer``, ``group``, ``block_start`` and ``num_blocks`` are 0.
- END: no more frames; ``seq`` is how many DATA and LAYOUT frames the transfer has.
- ABORT: the sender gave up on the transfer; the payload says why.

Versions: 5 added the receiver's frame sizes to the handshake (4 cut frames at the sender's
setting alone); 4 added the codec to the handshake and the header; 3 had neither; 2 sent the
LAYOUT frame's fingerprint alone; 1 sent it as a DATA frame of layer 0xFFFF.
"""
from __future__ import annotations

import ctypes
import hashlib
import hmac
import importlib
import os
import socket
import struct
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, NoReturn, overload

import numpy
import xxhash

from services.kv_transport.codecs import NONE, agree

PROTOCOL_VERSION = 5
MAGIC = b"PFKV"
MAX_TRANSFER_ID_BYTES = 255

DATA, END, ABORT, LAYOUT = 0, 1, 2, 3
KINDS = (DATA, END, ABORT, LAYOUT)
COUNTED_KINDS = (DATA, LAYOUT)  # the frames END counts, handed to the receiving user

# magic, version, kind, id length, codec, layer, group, block start, block count, seq, values per scale,
# payload length, xxh3-64
HEADER = struct.Struct("!4sBBBBHHIIIIQQ")
_HELLO = struct.Struct("!4sH32s")
_OFFER = struct.Struct("!H")
_REPLY = struct.Struct("!4sHB")
_FRAME_SIZES = struct.Struct("!QQ")
_NONCE = 32

Bytes = bytes | bytearray | memoryview


class ProtocolError(Exception):
    """The peer broke the protocol; the connection cannot continue."""

    def __init__(self, message: str, transfer_id: str | None = None) -> None:
        super().__init__(message)
        self.transfer_id = transfer_id


class HandshakeRefused(Exception):
    """The peer (or we) refused the connection: version or secret mismatch, or (a sender) frame sizes
    out of bounds."""


@dataclass(frozen=True, slots=True)
class FrameHeader:
    kind: int
    transfer_id: str
    layer: int
    group: int
    block_start: int
    num_blocks: int
    seq: int
    length: int
    digest: int
    codec: int = NONE
    row_elems: int = 0


@dataclass(frozen=True, slots=True)
class FrameSizes:
    """What a receiver announces at the handshake: the frame payload it wants (``preferred``) and the
    most it accepts (``limit``), in bytes."""
    preferred: int = 512 << 10
    limit: int = 8 << 20

    @property
    def problem(self) -> str | None:
        """Why a sender cannot use these sizes, or None."""
        if not 0 < self.preferred <= self.limit:
            return (f"receiver announced frames of {self.preferred} bytes with a limit of {self.limit} bytes; "
                    "a frame size must be at least 1 byte and at most the limit")
        return None

    def pack(self) -> bytes:
        return _FRAME_SIZES.pack(self.preferred, self.limit)


DEFAULT_FRAME_SIZES = FrameSizes()


@dataclass(frozen=True, slots=True)
class Agreement:
    """What a sender's handshake settled: the codec, and the receiver's frame sizes."""
    codec: int
    frames: FrameSizes


def block_frame_fields(index: int, group: int) -> tuple[int, int, int, int]:
    """(layer, group, block_start, num_blocks) of a DATA frame carrying one whole block, the
    ``index``-th of its transfer (a cache pool's transfer)."""
    return index, group, 0, 1


def encode_header(kind: int, transfer_id: str, layer: int, group: int, block_start: int, num_blocks: int,
                  seq: int, payload: Bytes, codec: int = NONE, row_elems: int = 0) -> bytes:
    tid = transfer_id.encode()
    if len(tid) > MAX_TRANSFER_ID_BYTES:
        raise ValueError(f"transfer id longer than {MAX_TRANSFER_ID_BYTES} bytes")
    return HEADER.pack(MAGIC, PROTOCOL_VERSION, kind, len(tid), codec, layer, group, block_start, num_blocks, seq,
                       row_elems, len(payload), checksum(payload)) + tid


def checksum(payload: Bytes) -> int:
    """xxh3-64 of the payload: catches corruption at memory speed (CRC32 would halve goodput). A
    large payload is hashed without the GIL (``_gil_free_xxh3``), so that I/O threads hash theirs
    on several cores at once."""
    if _gil_free_xxh3 is not None and (view := memoryview(payload)).nbytes >= GIL_FREE_CHECKSUM_BYTES:
        array = numpy.frombuffer(view, numpy.uint8)
        return int(_gil_free_xxh3(array.ctypes.data, array.nbytes))
    return xxhash.xxh3_64_intdigest(payload)


GIL_FREE_CHECKSUM_BYTES = 64 << 10  # below it, the call through ctypes costs more than the GIL does


def _find_gil_free_xxh3() -> Callable[[int, int], int] | None:
    """python-xxhash's own XXH3-64 (its SIMD-dispatching entry point), called through ctypes, which
    lets go of the GIL for the call: the module's ``xxh3_64_intdigest`` holds it while it hashes,
    which serialized every I/O thread's checksums. None where the library does not export it (or
    gives another digest): then ``xxh3_64_intdigest`` it is."""
    try:
        library = importlib.import_module("xxhash._xxhash").__file__
        function = ctypes.CDLL(library).XXH3_64bits_dispatch
    except (ImportError, OSError, AttributeError):
        return None
    function.restype, function.argtypes = ctypes.c_uint64, (ctypes.c_void_p, ctypes.c_size_t)
    sample = numpy.frombuffer(os.urandom(4096), numpy.uint8)
    if function(sample.ctypes.data, sample.nbytes) != xxhash.xxh3_64_intdigest(sample.data):
        return None
    return function


_gil_free_xxh3 = _find_gil_free_xxh3()


def read_header(conn: socket.socket, max_frame_bytes: int) -> FrameHeader | None:
    """The next frame's header, or None at a clean end of stream; raises ProtocolError."""
    raw = recv_exactly(conn, HEADER.size, eof_ok=True)
    if raw is None:
        return None
    fields = unpack_fixed(raw)
    return finish_header(fields, recv_exactly(conn, fields[1]), max_frame_bytes)


HeaderFields = tuple[int, int, int, int, int, int, int, int, int, int, int]


def unpack_fixed(raw: Bytes) -> HeaderFields:
    """The fixed part of a header (``HEADER.size`` bytes), checked: (kind, length of the transfer id
    that follows, layer, group, block start, block count, seq, payload length, digest, codec, values
    per scale)."""
    magic, version, kind, tid_len, codec, layer, group, start, count, seq, row_elems, length, digest = \
        HEADER.unpack(raw)
    if magic != MAGIC:
        raise ProtocolError("bad frame magic (stream out of sync)")
    if version != PROTOCOL_VERSION:
        raise ProtocolError(f"frame of protocol version {version}, expected {PROTOCOL_VERSION}")
    if kind not in KINDS:
        raise ProtocolError(f"unknown frame kind {kind}")
    return kind, tid_len, layer, group, start, count, seq, length, digest, codec, row_elems


def finish_header(fields: HeaderFields, raw_tid: Bytes, max_frame_bytes: int) -> FrameHeader:
    kind, _, layer, group, start, count, seq, length, digest, codec, row_elems = fields
    transfer_id = bytes(raw_tid).decode(errors="replace")
    if length > max_frame_bytes:
        raise ProtocolError(f"oversized frame: {length} bytes announced, limit {max_frame_bytes}", transfer_id)
    return FrameHeader(kind, transfer_id, layer, group, start, count, seq, length, digest, codec, row_elems)


@overload
def recv_exactly(conn: socket.socket, size: int, *, eof_ok: Literal[False] = False) -> bytes: ...
@overload
def recv_exactly(conn: socket.socket, size: int, *, eof_ok: bool) -> bytes | None: ...


def recv_exactly(conn: socket.socket, size: int, *, eof_ok: bool = False) -> bytes | None:
    """``size`` bytes from ``conn``; None when it closes first and ``eof_ok`` (else ProtocolError)."""
    buffer = bytearray(size)
    if recv_into_exactly(conn, memoryview(buffer), eof_ok=eof_ok) is None:
        return None
    return bytes(buffer)


@overload
def recv_into_exactly(conn: socket.socket, view: memoryview, *, eof_ok: Literal[False] = False,
                      flags: int = 0) -> memoryview: ...
@overload
def recv_into_exactly(conn: socket.socket, view: memoryview, *, eof_ok: bool,
                      flags: int = 0) -> memoryview | None: ...


def recv_into_exactly(conn: socket.socket, view: memoryview, *, eof_ok: bool = False,
                      flags: int = 0) -> memoryview | None:
    received = 0
    while received < len(view):
        n = conn.recv_into(view[received:], 0, flags)
        if n == 0:
            if received == 0 and eof_ok:
                return None
            raise ProtocolError(f"truncated frame: connection closed after {received} of {len(view)} bytes")
        received += n
    return view


# Handshake -------------------------------------------------------------------------------------

def client_handshake(conn: socket.socket, secret: bytes, codecs: int = 1 << NONE) -> Agreement:
    """Authenticate to a receiver, offering the codecs ``codecs`` (``codecs.offer``); the codec agreed
    on and the receiver's frame sizes. Raises HandshakeRefused (the receiver refused, failed to
    authenticate, or announced frame sizes out of bounds), or ConnectionError when the peer closes
    the connection before the handshake is over."""
    try:
        return _client_handshake(conn, secret, codecs)
    except ProtocolError as exc:
        raise ConnectionError(f"peer closed the connection during the handshake ({exc})") from None


def _client_handshake(conn: socket.socket, secret: bytes, ours: int) -> Agreement:
    client_nonce = os.urandom(_NONCE)
    conn.sendall(_HELLO.pack(MAGIC, PROTOCOL_VERSION, client_nonce) + _OFFER.pack(ours))
    version, status = _read_reply(conn)
    if status != 0:
        raise HandshakeRefused(f"peer refused the connection: {_read_reason(conn)}")
    server_nonce = recv_exactly(conn, _NONCE)
    (theirs,) = _OFFER.unpack(recv_exactly(conn, _OFFER.size))
    frames = FrameSizes(*_FRAME_SIZES.unpack(recv_exactly(conn, _FRAME_SIZES.size)))
    server_proof = recv_exactly(conn, 32)
    signed = _OFFER.pack(ours) + _OFFER.pack(theirs) + frames.pack()
    if not hmac.compare_digest(server_proof, _proof(secret, b"S", client_nonce, server_nonce, signed)):
        raise HandshakeRefused("peer failed authentication (different transport secret)")
    if (problem := frames.problem) is not None:
        raise HandshakeRefused(f"this sender does not connect: the {problem}")
    conn.sendall(_proof(secret, b"C", server_nonce, client_nonce, signed))
    _, status = _read_reply(conn)
    if status != 0:
        raise HandshakeRefused(f"peer refused the connection: {_read_reason(conn)}")
    return Agreement(agree(ours, theirs), frames)


def server_handshake(conn: socket.socket, secret: bytes, codecs: int = 1 << NONE,
                     admit: Callable[[], str | None] | None = None,
                     frames: FrameSizes = DEFAULT_FRAME_SIZES) -> int:
    """Authenticate a connecting sender, offering the codecs ``codecs`` and announcing the frame sizes
    ``frames``; the codec agreed on. ``admit``, called once the sender proved the secret: why the
    receiver cannot take the connection after all (refused with that reason), or None."""
    raw = recv_exactly(conn, _HELLO.size)
    magic, version, client_nonce = _HELLO.unpack(raw)
    if magic != MAGIC:
        raise HandshakeRefused("not a PrfaaS KV stream (bad magic)")
    if version != PROTOCOL_VERSION:
        _refuse(conn, f"protocol version {version} is not supported (this worker speaks {PROTOCOL_VERSION})")
    (theirs,) = _OFFER.unpack(recv_exactly(conn, _OFFER.size))
    signed = _OFFER.pack(theirs) + _OFFER.pack(codecs) + frames.pack()
    server_nonce = os.urandom(_NONCE)
    conn.sendall(_REPLY.pack(MAGIC, PROTOCOL_VERSION, 0) + server_nonce + _OFFER.pack(codecs) + frames.pack()
                 + _proof(secret, b"S", client_nonce, server_nonce, signed))
    try:
        client_proof = recv_exactly(conn, 32)
    except (ProtocolError, OSError):
        raise HandshakeRefused("peer left the handshake: it could not authenticate this worker "
                               "(different transport secret) or refused its frame sizes") from None
    if not hmac.compare_digest(client_proof, _proof(secret, b"C", server_nonce, client_nonce, signed)):
        _refuse(conn, "authentication failed (different transport secret)")
    if admit is not None and (why := admit()) is not None:
        _refuse(conn, why)
    conn.sendall(_REPLY.pack(MAGIC, PROTOCOL_VERSION, 0))
    return agree(codecs, theirs)


def _refuse(conn: socket.socket, reason: str) -> NoReturn:
    data = reason.encode()
    try:
        conn.sendall(_REPLY.pack(MAGIC, PROTOCOL_VERSION, 1) + struct.pack("!H", len(data)) + data)
    except OSError:
        pass
    raise HandshakeRefused(reason)


def _read_reply(conn: socket.socket) -> tuple[int, int]:
    magic, version, status = _REPLY.unpack(recv_exactly(conn, _REPLY.size))
    if magic != MAGIC:
        raise HandshakeRefused("peer is not a PrfaaS KV receiver (bad magic)")
    if version != PROTOCOL_VERSION and status == 0:
        raise HandshakeRefused(f"peer speaks protocol version {version}, this worker {PROTOCOL_VERSION}")
    return version, status


def _read_reason(conn: socket.socket) -> str:
    (length,) = struct.unpack("!H", recv_exactly(conn, 2))
    return recv_exactly(conn, length).decode(errors="replace")


def _proof(secret: bytes, side: bytes, first: bytes, second: bytes, signed: bytes) -> bytes:
    return hmac.new(secret, side + first + second + signed, hashlib.sha256).digest()
