"""KV tokens per second over a capped WAN-like link with the fp8 and int8 wire codecs against without.

The path is bench/transport_wan.py's: a network namespace behind a 20 ms round trip (a delay line
between two TUN devices), capped at 1 Gbit/s with ``tbf``, 1% random loss (tests/support/wan.py via
bench/_common.py). The KV is a bfloat16 cache shaped like SmolLM2-135M's (30 attention layers, 3 KV
heads of 64, blocks of 128 tokens, vLLM's CPU layout: 23,040 bytes per token), random normal values.
Each transfer streams ``--tokens`` tokens of it layer by layer over 8 connections, as a PrfaaS prefill
worker does: with ``transport.codec: none`` raw, with ``fp8`` or ``int8`` coded on the sending
thread (the connector's encoder, one scale per row of 128 values). The receiver, in the namespace, decodes
every coded frame back into bfloat16 (the decode worker's work) before it reports the transfer done.
Both ends code on one thread each (torch's idle threads would spin on the cores the path's delay line
needs). The codecs take turns, one transfer each per round.
KV tokens per second = tokens / (first send to the receiver's end of transfer), median of the rounds.
Target: each codec carries at least 1.9x the tokens per second of none. Needs root and gcc.

    python bench/wire_codec_wan.py [--rate-mbit 1000] [--loss 1] [--rtt-ms 20] [--tokens 8192] [--rounds 5]
"""
from __future__ import annotations

import argparse
import subprocess
import sys
import time

import _common  # noqa: F401  (puts the project on sys.path)
from _common import ROOT, add_link_arguments, median, verdict, wait_transfer, wan_link

from services.kv_connector.codecs import encode
from services.kv_transport import KVTransport, TransportSettings

SECRET = "bench-secret"
PORT = 47112
NUM_LAYERS, KV_HEADS, HEAD_SIZE, BLOCK = 30, 3, 64, 128  # SmolLM2-135M
BLOCK_BYTES = KV_HEADS * BLOCK * 2 * HEAD_SIZE * 2  # one layer's block: heads x tokens x (K|V) x bfloat16
CODING = ("bfloat16", max(BLOCK, HEAD_SIZE))  # a row of values per scale, as kv_connector/codecs.coding_of
CODECS = ("fp8", "int8")
TARGET = 1.9

RECEIVER = """
import sys, time
sys.path.insert(0, {root!r})
import torch
torch.set_num_threads(1)
from services.kv_connector.codecs import decode
from services.kv_transport import Frame, KVTransport, TransportSettings
rx = KVTransport(TransportSettings(secret={secret!r}, codec={codec!r}), listen_host={host!r}, listen_port={port})
print("ready", rx.port, flush=True)
while True:
    for event in rx.poll(1.0):
        if isinstance(event, Frame):
            decode(event.codec, event.payload, event.row_elems, torch.bfloat16)
        else:
            print(type(event).__name__, event.transfer_id, time.time(), flush=True)
"""


def start_receiver(codec: str, host: str, port: int, netns: str) -> subprocess.Popen:
    code = RECEIVER.format(root=str(ROOT), secret=SECRET, codec=codec, host=host, port=port)
    process = subprocess.Popen(["ip", "netns", "exec", netns, sys.executable, "-c", code], stdout=subprocess.PIPE,
                               text=True)
    if not process.stdout.readline().startswith("ready"):
        raise RuntimeError(f"the {codec} receiver did not start")
    return process


def layer_payload(num_blocks: int) -> memoryview:
    import torch

    generator = torch.Generator().manual_seed(35)
    values = torch.randn(num_blocks * BLOCK_BYTES // 2, generator=generator).to(torch.bfloat16)
    return memoryview(values.view(torch.uint8).numpy()).cast("B")


def stream(receiver, tx: KVTransport, peer: str, payload: memoryview, num_blocks: int, transfer_id: str) -> float:
    """Seconds from the first send to the receiver's end of the transfer."""
    start = time.time()
    for layer in range(NUM_LAYERS):
        tx.send(peer, transfer_id, layer, 0, 0, num_blocks, payload, coding=CODING)
    tx.finish(peer, transfer_id)
    return wait_transfer(receiver, transfer_id) - start


def codec_speed(codec: str, megabytes: int = 48, rounds: int = 5) -> tuple[float, float]:
    """Encode and decode GB/s of bfloat16 KV on one core (one torch thread), medians of ``rounds``."""
    import torch

    from services.kv_connector.codecs import decode
    from services.kv_transport.codecs import CODECS

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        payload = layer_payload(megabytes * 2**20 // BLOCK_BYTES)
        encode_s, decode_s = [], []
        for _ in range(rounds):
            started = time.perf_counter()
            coded = encode(CODECS[codec], payload, *CODING)
            encode_s.append(time.perf_counter() - started)
            started = time.perf_counter()
            decode(CODECS[codec], coded, CODING[1], torch.bfloat16)
            decode_s.append(time.perf_counter() - started)
    finally:
        torch.set_num_threads(threads)
    return len(payload) / median(encode_s) / 1e9, len(payload) / median(decode_s) / 1e9


def measure(codecs: tuple[str, ...], link, tokens: int, rounds: int) -> dict[str, tuple[float, int]]:
    """Per codec, the median KV tokens per second over ``rounds`` transfers (after one that opens its
    connections) and the bytes one transfer put on the wire. The codecs take turns, one transfer
    each per round, so that a slow spell of the emulated path falls on all of them alike."""
    import torch

    torch.set_num_threads(1)  # as the sending thread codes: one core (torch's idle threads would spin)
    num_blocks = tokens // BLOCK
    payload = layer_payload(num_blocks)
    receivers, senders, peers, seconds = {}, {}, {}, {codec: [] for codec in codecs}
    try:
        for number, codec in enumerate(codecs):
            receivers[codec] = start_receiver(codec, link.ns_addr, PORT + number, link.ns)
            senders[codec] = KVTransport(TransportSettings(secret=SECRET, codec=codec), encoder=encode)
            peers[codec] = f"{link.ns_addr}:{PORT + number}"
            stream(receivers[codec], senders[codec], peers[codec], payload, num_blocks, f"{codec}-warm")
        sent = {codec: senders[codec].snapshot().peers[0].bytes_sent for codec in codecs}
        for number in range(rounds):
            for codec in codecs:
                took = stream(receivers[codec], senders[codec], peers[codec], payload, num_blocks, f"{codec}-{number}")
                seconds[codec].append(took)
                print(f"  round {number + 1}, {codec}: {tokens / took:,.0f} KV tokens/s", file=sys.stderr)
        per_transfer = {codec: (senders[codec].snapshot().peers[0].bytes_sent - sent[codec]) // rounds
                        for codec in codecs}
    finally:
        for sender in senders.values():
            sender.close()
        for receiver in receivers.values():
            receiver.kill()
            receiver.wait()
    for codec in codecs:
        rate = median(per_transfer[codec] * 8 / s for s in seconds[codec]) / 1e9
        print(f"{codec}: median {tokens / median(seconds[codec]):,.0f} KV tokens/s, {rate:.3f} Gbit/s on the wire",
              file=sys.stderr)
    return {codec: (tokens / median(seconds[codec]), per_transfer[codec]) for codec in codecs}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_link_arguments(parser)
    parser.add_argument("--tokens", type=int, default=8192, help="KV tokens per transfer, a multiple of 128 "
                        "(default 8192: 189 MB of bfloat16 KV)")
    parser.add_argument("--rounds", type=int, default=5, help="measured transfers per codec, the codecs taking "
                        "turns (default 5)")
    parser.add_argument("--buffer-ms", type=int, default=20, help="bottleneck queue in ms at the cap (default 20)")
    args = parser.parse_args()
    if args.tokens < BLOCK or args.tokens % BLOCK or args.rounds < 1 or args.rate_mbit <= 0:
        parser.error(f"--tokens must be a positive multiple of {BLOCK}, --rounds and --rate-mbit positive")
    for codec in CODECS:
        encode_gbs, decode_gbs = codec_speed(codec)
        print(f"{codec} on one core: encode {encode_gbs:.2f} GB/s, decode {decode_gbs:.2f} GB/s of bfloat16 KV "
              f"({encode_gbs * 8:.1f} / {decode_gbs * 8:.1f} Gbit/s)", file=sys.stderr)
    with wan_link(args.rate_mbit, args.loss, args.buffer_ms, args.rtt_ms) as link:
        print(f"link: {args.rate_mbit} Mbit/s cap, {args.rtt_ms:g} ms added round trip, {args.loss:g}% random loss; "
              f"{args.tokens} tokens of bfloat16 KV per transfer", file=sys.stderr)
        results = measure(("none", *CODECS), link, args.tokens, args.rounds)
    raw, raw_bytes = results["none"]
    ratios = {codec: results[codec][0] / raw for codec in CODECS}
    detail = "; ".join(f"{codec} {results[codec][0]:,.0f} KV tokens/s ({ratios[codec]:.3f}x), wire bytes per "
                       f"transfer {results[codec][1] / raw_bytes:.3f} of none's" for codec in CODECS)
    detail += (f"; none {raw:,.0f} KV tokens/s; {args.rate_mbit} Mbit/s, {args.rtt_ms:g} ms RTT, {args.loss:g}% "
               "loss, bfloat16 cache")
    return verdict(f"wire codec WAN KV tokens/s, the lower of {' and '.join(CODECS)} vs none", min(ratios.values()),
                   TARGET, detail, baseline=f"codec none {raw:,.0f} KV tokens/s")


if __name__ == "__main__":
    sys.exit(main())
