"""KV codecs on the wire (issue 35): fp8 round trips within their bound, per-head scales that follow
their heads through TP slicing and re-blocking, state pages untouched, negotiation at the handshake
(both ends must offer a codec, else raw), and coded frames a receiver must refuse."""
from __future__ import annotations

import struct

import numpy
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import test_kv_connector_tp as tp
from services.kv_connector.codecs import coding_of, decode, decoded_bytes, encode
from services.kv_transport import Frame, KVTransport, TransferDone, TransportSettings, codecs
from services.kv_transport.settings import SettingsError
from test_kv_transport import collect

SECRET = "codec-secret"
# e4m3 keeps 3 mantissa bits: a value rounds by at most half a step of the top binade, 16/448 of
# its row's absolute maximum, plus bfloat16's rounding on the way in and out; int8 by half a step,
# 1/254 of it, plus bfloat16's rounding of the result (half a unit in its 8th bit: 1/256 at most)
BOUND = 0.045
BOUNDS = {codecs.FP8: BOUND, codecs.INT8: 1 / 254 + 1 / 256 + 1e-4}
DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _round_trip(cache: torch.Tensor, codec: int = codecs.FP8) -> torch.Tensor:
    dtype, row_elems = coding_of(cache)
    coded = encode(codec, memoryview(cache.contiguous().view(-1).view(torch.uint8).numpy()), dtype, row_elems)
    assert codecs.payload_problem(codec, row_elems, codec, coded) is None
    decoded = decode(codec, coded, row_elems, cache.dtype)
    assert len(decoded) == decoded_bytes(codec, len(coded), row_elems, cache.dtype)
    return torch.frombuffer(decoded, dtype=torch.uint8).view(cache.dtype).view(cache.shape)


@settings(max_examples=60, deadline=None)
@given(blocks=st.integers(1, 4), heads=st.integers(1, 4), block_size=st.sampled_from([1, 16, 32]),
       head_size=st.sampled_from([8, 64]), dtype=st.sampled_from(DTYPES), seed=st.integers(0, 2**16),
       zero_head=st.booleans(), codec=st.sampled_from([codecs.FP8, codecs.INT8]))
def test_a_round_trip_is_within_its_bound_of_each_heads_absmax(blocks, heads, block_size, head_size, dtype, seed,
                                                               zero_head, codec):
    generator = torch.Generator().manual_seed(seed)
    # heads of very different magnitudes: each keeps its own precision
    magnitude = 10 ** torch.empty(1, heads, 1, 1).uniform_(-3, 3, generator=generator)
    cache = (torch.randn(blocks, heads, block_size, 2 * head_size, generator=generator) * magnitude).to(dtype)
    if zero_head:
        cache[:, 0] = 0
    back = _round_trip(cache, codec)
    assert back.dtype == cache.dtype
    error = (back.float() - cache.float()).abs().amax(dim=(0, 2, 3))
    absmax = cache.float().abs().amax(dim=(0, 2, 3))
    assert (error <= BOUNDS[codec] * absmax).all(), (error / absmax.clamp_min(1e-30)).tolist()
    if zero_head:
        assert torch.equal(back[:, 0], cache[:, 0])


@pytest.mark.parametrize("codec", [codecs.FP8, codecs.INT8])
@pytest.mark.parametrize("dtype, ratio", [(torch.bfloat16, 1.93), (torch.float32, 3.87)])
def test_a_codec_is_about_half_of_bfloat16_and_a_quarter_of_float32(codec, dtype, ratio):
    """A float32 scale per row of 128 values (SmolLM2's block on CPU: one channel of K)."""
    cache = torch.randn(4, 3, 128, 128).to(dtype)
    row_elems = coding_of(cache)[1]
    coded = encode(codec, memoryview(cache.view(-1).view(torch.uint8).numpy()), coding_of(cache)[0], row_elems)
    assert row_elems == 128 and cache.numel() * cache.element_size() / len(coded) >= ratio


def test_a_row_is_one_channel_of_k_on_cpu_and_one_token_on_a_gpu_backend():
    assert coding_of(torch.empty(2, 3, 128, 2 * 64, dtype=torch.bfloat16)) == ("bfloat16", 128)  # CPU: 128 tokens
    assert coding_of(torch.empty(2, 3, 16, 2 * 128, dtype=torch.bfloat16)) == ("bfloat16", 128)  # GPU: head 128
    assert coding_of(torch.empty(2, 3, 16, 2 * 128, dtype=torch.float8_e4m3fn)) is None


@pytest.mark.parametrize("src_tp, dst_tp, src_block, dst_block", [(1, 1, 32, 32), (1, 2, 32, 32), (2, 1, 64, 32),
                                                                   (1, 4, 32, 32), (4, 2, 32, 16)])
@pytest.mark.parametrize("codec", [codecs.FP8, codecs.INT8])
def test_scales_follow_their_heads_through_tp_slicing_and_reblocking_and_state_stays_exact(
        monkeypatch, src_tp, dst_tp, src_block, dst_block, codec):
    monkeypatch.setattr(tp._Wire, "codec", codec)
    producers = [tp._rank(src_tp, r, src_block, fill=True, code_sends=True) for r in range(src_tp)]
    consumers = [tp._rank(dst_tp, r, dst_block, fill=False) for r in range(dst_tp)]
    # one head far larger than the other: a scale shared across heads would flatten the small one
    for producer in producers:
        producer.layout.caches["l1"][:, :1] *= 100
    src_blocks, dst_blocks = tp._blocks(src_block, 1), tp._blocks(dst_block, 2)
    tp._prefill(producers, src_blocks, dst_tp)
    frames = [event for p in producers for _, event in p.streams.sent
              if isinstance(event, Frame) and not event.is_layout]
    assert {f.codec for f in frames if f.layer == 1} == {codec}
    assert {f.codec for f in frames if f.layer == 0} == {codecs.NONE}
    results = tp._deliver(producers, consumers, dst_blocks)
    assert all(r.finished_recving == {"r"} and r.failed_recving == set() for r in results), results

    sent = tp._distinct([tp._heads(p, src_blocks, src_block) for p in producers], dim=1, units=tp.HEADS).float()
    got = tp._distinct([tp._heads(c, dst_blocks, dst_block) for c in consumers], dim=1, units=tp.HEADS).float()
    error, absmax = (got - sent).abs().amax(dim=(0, 3)), sent.abs().amax(dim=(0, 3))  # per (head, K or V)
    assert (error <= BOUNDS[codec] * absmax).all()
    assert not torch.equal(got, sent)  # it was coded
    for part in ("query_key", "key", "value", "ssm"):
        dim = 0 if part == "ssm" else 1
        states = [[tp._state(w, blocks[-1])[part] for w in workers]
                  for workers, blocks in ((consumers, dst_blocks), (producers, src_blocks))]
        assert torch.equal(*(tp._distinct(s, dim, tp.K_HEADS) for s in states)), part


# Negotiation over real loopback TCP ---------------------------------------------------------------

def _transfer(tx_codec: str, rx_codec: str) -> Frame:
    rx = KVTransport(TransportSettings(secret=SECRET, codec=rx_codec), listen_port=0)
    tx = KVTransport(TransportSettings(secret=SECRET, codec=tx_codec), encoder=encode)
    try:
        cache = torch.randn(2, 2, 16, 16).to(torch.bfloat16)
        tx.send(f"127.0.0.1:{rx.port}", "t", 1, 0, 0, 2, memoryview(cache.view(-1).view(torch.uint8).numpy()),
                coding=coding_of(cache))
        tx.finish(f"127.0.0.1:{rx.port}", "t")
        frames, end = collect(rx, "t")
        assert isinstance(end, TransferDone) and len(frames) == 1
        back = decode(frames[0].codec, frames[0].payload, frames[0].row_elems, torch.bfloat16)
        restored = torch.frombuffer(back, dtype=torch.uint8).view(torch.bfloat16).view(cache.shape)
        assert (restored.float() - cache.float()).abs().max() <= BOUND * cache.float().abs().max()
        return frames[0]
    finally:
        tx.close()
        rx.close()


@pytest.mark.parametrize("tx_codec, rx_codec, agreed", [("fp8", "fp8", codecs.FP8), ("fp8", "none", codecs.NONE),
                                                        ("none", "fp8", codecs.NONE), ("none", "none", codecs.NONE),
                                                        ("int8", "int8", codecs.INT8), ("int8", "fp8", codecs.NONE)])
def test_a_codec_is_used_only_when_both_ends_offer_it(tx_codec, rx_codec, agreed):
    frame = _transfer(tx_codec, rx_codec)
    assert frame.codec == agreed and frame.row_elems == (16 if agreed else 0)


def test_agreement_takes_the_preferred_shared_codec_and_falls_back_to_raw():
    assert codecs.agree(codecs.offer("fp8"), codecs.offer("fp8")) == codecs.FP8
    assert codecs.agree(codecs.offer("fp8"), 0) == codecs.NONE  # an offer of nothing at all: raw
    assert codecs.agree(codecs.offer("fp8"), 1 << 9) == codecs.NONE  # a codec this end does not know


def test_an_unknown_codec_in_the_settings_is_refused_by_name():
    with pytest.raises(SettingsError, match="transport.codec: 'zstd' is not one of none, fp8, int8"):
        TransportSettings.of({"codec": "zstd"})


# Payloads that do not match the handshake ------------------------------------------------------------

def _coded(rows: int = 2, row_elems: int = 8) -> bytearray:
    return bytearray(struct.pack(f"<{rows}f", *([1.0] * rows)) + bytes(rows * row_elems))


@pytest.mark.parametrize("case, codec, row_elems, agreed, payload, problem", [
    ("fp8 on a raw link", codecs.FP8, 8, codecs.NONE, _coded(), "the handshake agreed on none"),
    ("unknown codec", 7, 8, codecs.FP8, _coded(), "coded #7"),
    ("raw with a row size", codecs.NONE, 8, codecs.FP8, bytearray(16), "raw frame announces 8"),
    ("no row size", codecs.FP8, 0, codecs.FP8, _coded(), "not whole rows"),
    ("cut short", codecs.FP8, 8, codecs.FP8, _coded()[:-1], "not whole rows"),
    ("NaN scale", codecs.FP8, 8, codecs.FP8, bytearray(struct.pack("<f", float("nan")) + bytes(8)), "not finite"),
    ("negative scale", codecs.FP8, 8, codecs.FP8, bytearray(struct.pack("<f", -1.0) + bytes(8)), "negative"),
    ("NaN value", codecs.FP8, 8, codecs.FP8, bytearray(struct.pack("<f", 1.0) + b"\x7f" + bytes(7)), "NaN"),
    ("negative NaN value", codecs.FP8, 8, codecs.FP8, bytearray(struct.pack("<f", 1.0) + bytes(7) + b"\xff"), "NaN"),
    ("int8 on an fp8 link", codecs.INT8, 8, codecs.FP8, _coded(), "the handshake agreed on fp8"),
    ("int8 -128", codecs.INT8, 8, codecs.INT8, bytearray(struct.pack("<f", 1.0) + b"\x80" + bytes(7)), "-128"),
])
def test_payloads_that_do_not_fit_the_handshake_are_named(case, codec, row_elems, agreed, payload, problem):
    assert problem in codecs.payload_problem(codec, row_elems, agreed, memoryview(payload))


def test_a_well_formed_payload_passes():
    assert codecs.payload_problem(codecs.FP8, 8, codecs.FP8, memoryview(_coded())) is None
    assert codecs.payload_problem(codecs.INT8, 8, codecs.INT8, memoryview(bytearray(struct.pack("<f", 1.0))
                                                                            + b"\x7f\x81" + bytes(6))) is None
    assert codecs.payload_problem(codecs.NONE, 0, codecs.FP8, memoryview(bytearray(5))) is None
    every_code = bytes(range(256))
    fp8_numbers = bytes(code for code in every_code if code & 0x7F != 0x7F)  # all but the two NaNs
    int8_numbers = every_code.replace(b"\x80", b"")  # all but -128
    scale = struct.pack("<f", 1.0)
    assert codecs.payload_problem(codecs.FP8, 254, codecs.FP8, memoryview(scale + fp8_numbers)) is None
    assert codecs.payload_problem(codecs.INT8, 255, codecs.INT8, memoryview(scale + int8_numbers)) is None


def test_tables_of_the_decoder_match_torchs_float8():
    codes = torch.arange(256, dtype=torch.uint8)
    finite = ~(((codes & 0x7F) == 0x7F))
    for dtype in (torch.bfloat16, torch.float32):
        payload = bytearray(struct.pack("<f", 1.0)) + bytearray(codes.numpy().tobytes())
        got = torch.frombuffer(decode(codecs.FP8, memoryview(payload), 256, dtype), dtype=torch.uint8).view(dtype)
        want = codes.view(torch.float8_e4m3fn).to(dtype)
        assert torch.equal(got[finite], want[finite])
    assert numpy.isnan(codes.view(torch.float8_e4m3fn).float().numpy()[~finite.numpy()]).all()


@pytest.mark.parametrize("codec", [codecs.FP8, codecs.INT8])
@pytest.mark.parametrize("dtype", DTYPES)
def test_encoding_leaves_the_payload_as_it_was(codec, dtype):
    """The payload is the engine's ring slot or cache copy: coding must not write into it."""
    cache = torch.randn(2, 2, 16, 32).to(dtype)
    before = cache.clone()
    encode(codec, memoryview(cache.view(-1).view(torch.uint8).numpy()), *coding_of(cache))
    assert torch.equal(cache, before)


def test_once_a_handshake_agreed_frames_are_coded_on_the_sending_thread():
    """The I/O thread only writes: coding a frame there would hold every connection's writes. The
    first frames (no handshake yet) are coded as they go out, later ones by whoever sends them."""
    import threading

    threads: list[str] = []

    def recording(codec, payload, dtype, row_elems):
        threads.append(threading.current_thread().name)
        return encode(codec, payload, dtype, row_elems)

    rx = KVTransport(TransportSettings(secret=SECRET, codec="int8"), listen_port=0)
    tx = KVTransport(TransportSettings(secret=SECRET, codec="int8"), encoder=recording)
    try:
        cache = torch.randn(2, 2, 16, 16).to(torch.bfloat16)
        payload = memoryview(cache.view(-1).view(torch.uint8).numpy())
        for transfer in ("first", "second"):
            tx.send(f"127.0.0.1:{rx.port}", transfer, 1, 0, 0, 2, payload, coding=coding_of(cache))
            tx.finish(f"127.0.0.1:{rx.port}", transfer)
            frames, end = collect(rx, transfer)
            assert isinstance(end, TransferDone) and [f.codec for f in frames] == [codecs.INT8]
            back = decode(frames[0].codec, frames[0].payload, frames[0].row_elems, torch.bfloat16)
            restored = torch.frombuffer(back, dtype=torch.uint8).view(torch.bfloat16).view(cache.shape)
            assert (restored.float() - cache.float()).abs().max() <= BOUNDS[codecs.INT8] * cache.float().abs().max()
    finally:
        tx.close()
        rx.close()
    assert threads == ["prfaas-kv-send-0", threading.current_thread().name]
