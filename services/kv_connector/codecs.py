"""The arithmetic of the wire codecs (``kv_transport/codecs.py`` names them and has the formats):
attention KV coded from the producer's cache dtype, and decoded into the consumer's.

A payload of attention KV is a run of rows of ``coding_of``'s size, each inside one (block, KV head,
K or V) area of the cache: in vLLM's CPU layout one channel of a block's K (its K is stored
transposed) or a few tokens of its V, on GPU backends one token's K or V. Each row has its own
float32 scale: its absolute maximum over the codec's largest value (448 for e4m3, 127 for int8), so
a channel or token with large values costs no precision to one with small ones, and the scales go
wherever their rows go (a TP slice of heads, a re-blocked token). Vectorised over chunks of about
``CHUNK_BYTES`` of the cache dtype, so that a chunk's float32 temporaries stay in the core's cache
(at 48 MiB a payload, coding it whole ran at half the speed or less); no loop over blocks.
"""
from __future__ import annotations

import numpy
import torch

from services.kv_transport.codecs import FP8, INT8, NONE, SCALE_BYTES, coded_rows

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448
INT8_MAX = 127.0
LARGEST = {FP8: FP8_MAX, INT8: INT8_MAX}
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
_CODES = torch.arange(256, dtype=torch.uint8).view(FP8_DTYPE)
_FLOAT32_OF_CODE = _CODES.float()
CHUNK_BYTES = 512 * 1024  # best of 128 KiB to 4 MiB on this host's 2 cores
_SAME_SIZE_INT = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32}
_MAGNITUDE = {torch.bfloat16: 0x7FFF, torch.float16: 0x7FFF, torch.float32: 0x7FFFFFFF}


def coding_of(cache: torch.Tensor) -> tuple[str, int] | None:
    """The transport's ``Coding`` of attention payloads gathered from ``cache`` (its blocks along dim
    0, each ``[..., heads, tokens, K and V]``), or None when its dtype is not one the codecs read (an
    FP8 cache). A row is ``max(tokens, head_size)`` values: it divides a (block, head)'s K area and V
    area alike, and is one channel of K over the block's tokens in vLLM's CPU layout (K stored
    transposed), one token's K or V in a GPU backend's (tokens fewer than ``head_size``)."""
    name = str(cache.dtype).removeprefix("torch.")
    if name not in DTYPES or cache.dim() < 4:
        return None
    return name, max(cache.shape[-2], cache.shape[-1] // 2)


def encode(codec: int, payload: memoryview, dtype: str, row_elems: int, per_tensor: bool = False) -> memoryview:
    """``payload`` (rows of ``row_elems`` values of ``dtype``) in the format of ``codec``.
    ``per_tensor``: one scale for the whole payload, repeated per row (what an FP8 cache with one
    static scale per tensor does; for measurements only). Scales are rounded to bfloat16's
    precision, so that a bfloat16 consumer decodes with one exact multiplication."""
    if codec not in LARGEST or not len(payload):
        raise ValueError(f"no encoder for codec {codec} of {len(payload)} bytes")
    largest = LARGEST[codec]
    rows = torch.frombuffer(payload, dtype=torch.uint8).view(DTYPES[dtype]).view(-1, row_elems)
    num_rows = rows.shape[0]
    out = torch.empty(num_rows * (SCALE_BYTES + row_elems), dtype=torch.uint8)
    scales = out[:num_rows * SCALE_BYTES].view(torch.float32)
    absmax = _absmax(rows)
    if per_tensor:
        absmax = absmax.amax().expand_as(absmax)
    scales.copy_((absmax / largest).to(torch.bfloat16))
    inverse = scales.reciprocal()
    inverse = torch.where(torch.isfinite(inverse), inverse, torch.zeros_like(inverse))
    values = out[num_rows * SCALE_BYTES:].view(num_rows, row_elems)
    step = _chunk_rows(rows)
    for start in range(0, num_rows, step):  # a chunk's float32 copy stays in the core's cache
        part = slice(start, start + step)
        scaled = rows[part].to(torch.float32, copy=True).mul_(inverse[part, None])  # one rounding, into the code
        if codec == INT8:
            values[part].view(torch.int8).copy_(scaled.round_().clamp_(-INT8_MAX, INT8_MAX))
        else:
            values[part].view(FP8_DTYPE).copy_(scaled.clamp_(-FP8_MAX, FP8_MAX))
    return out.numpy().data


def _chunk_rows(rows: torch.Tensor) -> int:
    """Rows per pass of the coders: about ``CHUNK_BYTES`` of the cache dtype."""
    return max(1, CHUNK_BYTES // (rows.shape[1] * rows.element_size()))


def _absmax(rows: torch.Tensor) -> torch.Tensor:
    """Each row's largest absolute value, as float32: the largest of the values' bits with the sign
    bit cleared, read as an integer (a float's magnitude orders as its bits do; NaN above infinity).
    Ten times faster here than the largest and the smallest of 16-bit floats."""
    bits = rows.view(_SAME_SIZE_INT[rows.dtype])
    return torch.bitwise_and(bits, _MAGNITUDE[rows.dtype]).amax(dim=1).view(rows.dtype).float()


def decode(codec: int, payload: memoryview, row_elems: int, dtype: torch.dtype) -> memoryview:
    """A received payload as the raw bytes of ``dtype`` (the consumer's cache dtype) it stands for;
    a raw payload (``none``) as it is. The payload was checked against its codec on arrival. Float8
    values are looked up in a float32 table of the 256 codes (several times faster than torch's
    float8 cast here); each value times its bfloat16 scale is exact in float32, rounded once."""
    if codec == NONE:
        return payload
    num_rows = coded_rows(codec, row_elems, len(payload))
    scales = torch.from_numpy(numpy.frombuffer(payload, numpy.float32, num_rows).copy())
    codes = numpy.frombuffer(payload, numpy.uint8, offset=num_rows * SCALE_BYTES).reshape(num_rows, row_elems)
    out = torch.empty(num_rows, row_elems, dtype=dtype)
    step = _chunk_rows(out)
    for start in range(0, num_rows, step):  # a chunk's temporaries stay in the core's cache
        part = slice(start, start + step)
        if codec == INT8:  # (numpy reads the payload: it may be read-only, which torch's tensors cannot be)
            values = torch.from_numpy(codes[part].view(numpy.int8).astype(numpy.float32))
        else:
            values = _FLOAT32_OF_CODE.index_select(0, torch.from_numpy(codes[part].astype(numpy.int32)).view(-1))
        out[part] = values.view(-1, row_elems).mul_(scales[part, None])  # exact (bfloat16 scales), rounded once
    return out.view(-1).view(torch.uint8).numpy().data


def decoded_bytes(codec: int, payload_bytes: int, row_elems: int, dtype: torch.dtype) -> int:
    """The size a payload of ``payload_bytes`` has once decoded into ``dtype``."""
    if codec == NONE:
        return payload_bytes
    return coded_rows(codec, row_elems, payload_bytes) * row_elems * torch.empty((), dtype=dtype).element_size()
