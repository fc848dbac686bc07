"""The arithmetic of the wire codecs (``kv_transport/codecs.py`` names them and has the formats):
attention KV coded from the producer's cache dtype, and decoded into the consumer's.

A payload of attention KV is a run of rows, each one (block, KV head, K or V) of the cache: its
``block_size x head_size`` values, whichever order the kernels keep them in. ``fp8`` gives each row
its own float32 scale (its absolute maximum over 448, e4m3's largest value), so a head with large
values costs no precision to one with small ones, and the scales go wherever their rows go (a TP
slice of heads, a re-blocked token). Vectorised over the whole payload; no loop over blocks.
"""
from __future__ import annotations

import numpy
import torch

from services.kv_transport.codecs import FP8, NONE, SCALE_BYTES, coded_rows

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
_CODES = torch.arange(256, dtype=torch.uint8).view(FP8_DTYPE)
_FLOAT32_OF_CODE = _CODES.float().numpy()
_BF16_OF_CODE = _CODES.to(torch.bfloat16).view(torch.int16).numpy()


def coding_of(cache: torch.Tensor) -> tuple[str, int] | None:
    """The transport's ``Coding`` of attention payloads gathered from ``cache`` (its blocks along dim
    0, each ``[..., heads, tokens, K and V]``: a row is half of one (block, head), the K and the V
    area of vLLM's CPU layout), or None when its dtype is not one the codecs read (an FP8 cache)."""
    name = str(cache.dtype).removeprefix("torch.")
    return (name, cache.shape[-2] * cache.shape[-1] // 2) if name in DTYPES and cache.dim() >= 4 else None


def encode(codec: int, payload: memoryview, dtype: str, row_elems: int, per_tensor: bool = False) -> memoryview:
    """``payload`` (rows of ``row_elems`` values of ``dtype``) in the format of ``codec``.
    ``per_tensor``: one scale for the whole payload, repeated per row (what an FP8 cache with one
    static scale per tensor does; for measurements only). Scales are rounded to bfloat16's
    precision, so that a bfloat16 consumer decodes with one exact multiplication."""
    if codec != FP8 or not len(payload):
        raise ValueError(f"no encoder for codec {codec} of {len(payload)} bytes")
    rows = torch.frombuffer(payload, dtype=torch.uint8).view(DTYPES[dtype]).view(-1, row_elems)
    num_rows = rows.shape[0]
    out = torch.empty(num_rows * (SCALE_BYTES + row_elems), dtype=torch.uint8)
    scales = out[:num_rows * SCALE_BYTES].view(torch.float32)
    absmax = torch.maximum(rows.amax(dim=1), rows.amin(dim=1).neg()).float()
    if per_tensor:
        absmax = absmax.amax().expand_as(absmax)
    scales.copy_((absmax / FP8_MAX).to(torch.bfloat16))
    inverse = scales.reciprocal()
    inverse = torch.where(torch.isfinite(inverse), inverse, torch.zeros_like(inverse))
    work = rows if rows.dtype != torch.float16 else rows.float()  # 1/scale overflows float16
    scaled = torch.mul(work, inverse.to(work.dtype)[:, None]).clamp_(-FP8_MAX, FP8_MAX)
    out[num_rows * SCALE_BYTES:].view(FP8_DTYPE).view(num_rows, row_elems).copy_(scaled)
    return out.numpy().data


def decode(codec: int, payload: memoryview, row_elems: int, dtype: torch.dtype) -> memoryview:
    """A received payload as the raw bytes of ``dtype`` (the consumer's cache dtype) it stands for;
    a raw payload (``none``) as it is. The payload was checked against its codec on arrival. Values
    are looked up in a table of the 256 codes (several times faster than torch's float8 cast here)."""
    if codec == NONE:
        return payload
    num_rows = coded_rows(codec, row_elems, len(payload))
    scales = torch.frombuffer(payload, dtype=torch.float32, count=num_rows)
    codes = numpy.frombuffer(payload, numpy.uint8, offset=num_rows * SCALE_BYTES)
    if dtype == torch.bfloat16:
        values = torch.from_numpy(_BF16_OF_CODE[codes]).view(torch.bfloat16).view(num_rows, row_elems)
        return values.mul_(scales.to(torch.bfloat16)[:, None]).view(-1).view(torch.uint8).numpy().data
    values = torch.from_numpy(_FLOAT32_OF_CODE[codes]).view(num_rows, row_elems).mul_(scales[:, None])
    return values.to(dtype).view(-1).view(torch.uint8).numpy().data


def decoded_bytes(codec: int, payload_bytes: int, row_elems: int, dtype: torch.dtype) -> int:
    """The size a payload of ``payload_bytes`` has once decoded into ``dtype``."""
    if codec == NONE:
        return payload_bytes
    return coded_rows(codec, row_elems, payload_bytes) * row_elems * torch.empty((), dtype=dtype).element_size()
