"""Loopback goodput of the KV transport vs iperf3 with the same number of parallel streams.

A 1 GiB KV stream (64 layers of 16 MiB) goes from this process to a receiver process through
``KVTransport`` (8 connections, checksums and authentication on, as deployed); iperf3 moves the
same number of bytes over 8 streams. Both run with the sender on CPU 0 and the receiver on CPU 1,
so neither shares a core with its peer (left to the scheduler, the two ends of iperf3 sometimes
share one and its goodput swings between runs). A first, unmeasured transfer opens the
connections (workers keep theirs open); then runs alternate, and the best round of each is
compared (medians are printed beside them).

Each round also prints the CPU time per GiB of both ends of both. On a small VM the end that is
out of CPU sets the goodput, and a round's CPU cost per GiB is not the code's alone: on this 2-core
VM both tools had rounds at twice their usual cost per GiB (iperf3's client 0.43-0.46 s/GiB against
0.23, the transport's sender 0.58-0.61 against 0.22-0.25), at random, and a median of five rounds
moved by 0.15 of the ratio from run to run. Each tool's best round is its goodput with the least
of that interference (timeit's rule: the fastest repeat is the one the host disturbed least), and
iperf3's best is the highest limit it shows.

    python bench/transport_loopback.py [--rounds 9] [--connections 8] [--io-threads N]
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from dataclasses import dataclass

import _common  # noqa: F401  (puts the project on sys.path)
from _common import iperf3_run, median, process_cpu_s, start_receiver, verdict, wait_transfer

from services.kv_transport import KVTransport, TransportSettings

NUM_LAYERS = 64
LAYER_BYTES = 16 << 20
BLOCKS_PER_LAYER = 256
SECRET = "bench-secret"
SENDER_CPU, RECEIVER_CPU = 0, 1

@dataclass(frozen=True)
class Round:
    gbps: float
    sender_cpu_s: float    # per GiB
    receiver_cpu_s: float  # per GiB


def transport_round(receiver: subprocess.Popen, port: int, tx: KVTransport, round_id: int) -> Round:
    payload = memoryview(os.urandom(LAYER_BYTES))
    transfer_id = f"bench-{round_id}"
    receiver_cpu, sender = process_cpu_s(receiver.pid), os.times()
    start = time.time()
    for layer in range(NUM_LAYERS):
        tx.send(f"127.0.0.1:{port}", transfer_id, layer, 0, 0, BLOCKS_PER_LAYER, payload, divisible=True)
    tx.finish(f"127.0.0.1:{port}", transfer_id)
    elapsed = wait_transfer(receiver, transfer_id) - start
    sender_cpu = sum(os.times()[:2]) - sum(sender[:2])
    gib = NUM_LAYERS * LAYER_BYTES / (1 << 30)
    return Round(NUM_LAYERS * LAYER_BYTES * 8 / elapsed / 1e9, sender_cpu / gib,
                 (process_cpu_s(receiver.pid) - receiver_cpu) / gib)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=9,
                        help="alternating runs of each; the best of each is compared (default 9)")
    parser.add_argument("--connections", type=int, default=8, help="TCP connections / iperf3 streams (default 8)")
    parser.add_argument("--io-threads", type=int, default=TransportSettings().io_threads,
                        help=f"transport.io_threads of both ends (default {TransportSettings().io_threads})")
    args = parser.parse_args()
    os.sched_setaffinity(0, {SENDER_CPU})
    receiver, port = start_receiver(SECRET, connections=args.connections, cpu=RECEIVER_CPU, io_threads=args.io_threads)
    tx = KVTransport(TransportSettings(secret=SECRET, connections_per_peer=args.connections,
                                       io_threads=args.io_threads))
    try:
        transport_round(receiver, port, tx, -1)  # opens the connections, which a deployment keeps open
        ours, theirs = [], []
        gib = NUM_LAYERS * LAYER_BYTES / (1 << 30)
        for round_id in range(args.rounds):
            ours.append(transport_round(receiver, port, tx, round_id))
            theirs.append(iperf3_run("127.0.0.1", args.connections, NUM_LAYERS * LAYER_BYTES,
                                     server_cpu=RECEIVER_CPU, client_cpu=SENDER_CPU))
            print(f"round {round_id + 1}/{args.rounds}: transport {ours[-1].gbps:.2f} Gbit/s "
                  f"(CPU s/GiB: sender {ours[-1].sender_cpu_s:.3f}, receiver {ours[-1].receiver_cpu_s:.3f}); "
                  f"iperf3 {theirs[-1].gbps:.2f} Gbit/s (client {theirs[-1].client_cpu_s / gib:.3f}, "
                  f"server {theirs[-1].server_cpu_s / gib:.3f})", file=sys.stderr)
    finally:
        tx.close()
        receiver.kill()
    ours_gbps, theirs_gbps = max(r.gbps for r in ours), max(r.gbps for r in theirs)
    medians = f"{median(r.gbps for r in ours):.2f} vs {median(r.gbps for r in theirs):.2f}"
    return verdict("transport loopback goodput vs iperf3, best round of each", ours_gbps / theirs_gbps, 0.90,
                   f"{ours_gbps:.2f} vs {theirs_gbps:.2f} Gbit/s of {args.rounds} rounds, medians {medians}; "
                   f"1 GiB in {NUM_LAYERS} layers, {args.connections} connections",
                   baseline=f"iperf3 best {theirs_gbps:.2f} Gbit/s")


if __name__ == "__main__":
    sys.exit(main())
