"""KV codecs on the wire: which exist, how two ends agree on one, and the payload format each gives
a DATA frame. The arithmetic (torch) is the connector's (``kv_connector/codecs.py``); this module
only names codecs and checks that a received payload is well formed, so the transport stays free of
tensors.

A frame's header names its codec and, for a coded frame, its row size: the number of values that
share one scale. Only attention KV is ever coded; state pages, LAYOUT frames and cache-pool blocks
always travel raw (codec ``none``, row size 0).

- ``none``: the payload is the engine's cache bytes as they are.
- ``fp8``: ``n`` little-endian float32 scales, then ``n`` rows of ``row_elems`` float8 e4m3 (fn)
  values; value ``v`` of row ``r`` stands for ``v * scale[r]``.
- ``int8``: the same with signed 8-bit integers in [-127, 127]: uniform steps of ``scale[r]`` over
  the row, finer than e4m3's 3-bit mantissa for values near the row's largest.

The producer's rows never straddle two KV heads or K and V (``kv_connector.codecs.coding_of``), so
every scale travels with the head it belongs to.
"""
from __future__ import annotations

import numpy

NONE, FP8, INT8 = 0, 1, 2
CODECS = {"none": NONE, "fp8": FP8, "int8": INT8}
NAMES = {code: name for name, code in CODECS.items()}
PREFERENCE = (INT8, FP8, NONE)  # of the codecs both ends offer, the first of these is used
SCALE_BYTES = 4
VALUE_BYTES = {FP8: 1, INT8: 1}
_FP8_NAN = 0x7F  # e4m3fn has no infinities; its NaNs are S.1111.111


def offer(name: str) -> int:
    """The handshake's offer of an end configured with codec ``name``: it, and always ``none``."""
    return 1 << NONE | 1 << CODECS[name]


def agree(ours: int, theirs: int) -> int:
    """The codec two offers share (bit masks of codec ids); ``none`` when they share no other."""
    return next(code for code in PREFERENCE if ours & theirs & 1 << code or code == NONE)


def coded_rows(codec: int, row_elems: int, num_bytes: int) -> int:
    """How many rows a coded payload of ``num_bytes`` holds; -1 when that size cannot be one."""
    row_bytes = SCALE_BYTES + row_elems * VALUE_BYTES[codec]
    return num_bytes // row_bytes if num_bytes % row_bytes == 0 else -1


def payload_problem(codec: int, row_elems: int, agreed: int, payload: memoryview) -> str | None:
    """Why a received DATA payload does not fit the codec the connection agreed on, or None: a codec
    other than ``none`` or ``agreed``, a row size that does not fit the payload, scales that are not
    finite and non-negative, or NaN values."""
    if codec == NONE:
        return None if row_elems == 0 else f"raw frame announces {row_elems} values per scale"
    if codec != agreed:
        return f"frame coded {NAMES.get(codec, f'#{codec}')}, the handshake agreed on {NAMES.get(agreed, agreed)}"
    if row_elems <= 0 or (rows := coded_rows(codec, row_elems, len(payload))) <= 0:
        return f"{len(payload)} bytes are not whole rows of {row_elems} {NAMES[codec]} values with their scales"
    scales = numpy.frombuffer(payload, "<f4", rows)
    if not numpy.isfinite(scales).all() or (scales < 0).any():
        return "scales that are negative or not finite"
    values = numpy.frombuffer(payload, numpy.uint8, offset=rows * SCALE_BYTES)
    signed = values.view(numpy.int8)  # reductions, no temporary arrays: about 25x faster than masks here
    if codec == FP8 and (values.max() == 0xFF or signed.max() == _FP8_NAN):  # NaNs: S.1111.111
        return "values that are NaN"
    if codec == INT8 and signed.min() == -128:
        return "values of -128 (int8 values lie in [-127, 127])"
    return None
