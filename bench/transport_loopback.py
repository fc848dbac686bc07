"""Loopback goodput of the KV transport vs iperf3 with the same number of parallel streams.

A 1 GiB KV stream (64 layers of 16 MiB) goes from this process to a receiver process through
``KVTransport`` (8 connections, checksums and authentication on, as deployed); iperf3 moves the
same number of bytes over 8 streams. Both run with the sender on CPU 0 and the receiver on CPU 1,
so neither shares a core with its peer (left to the scheduler, the two ends of iperf3 sometimes
share one and its goodput swings between runs). A first, unmeasured transfer opens the
connections (workers keep theirs open); then runs alternate and medians are compared.

    python bench/transport_loopback.py [--rounds 3] [--connections 8]
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

import _common  # noqa: F401  (puts the project on sys.path)
from _common import iperf3_gbps, median, start_receiver, verdict, wait_transfer

from services.kv_transport import KVTransport, TransportSettings

NUM_LAYERS = 64
LAYER_BYTES = 16 << 20
BLOCKS_PER_LAYER = 256
SECRET = "bench-secret"
SENDER_CPU, RECEIVER_CPU = 0, 1

def transport_gbps(receiver: subprocess.Popen, port: int, tx: KVTransport, round_id: int) -> float:
    payload = memoryview(os.urandom(LAYER_BYTES))
    transfer_id = f"bench-{round_id}"
    start = time.time()
    for layer in range(NUM_LAYERS):
        tx.send(f"127.0.0.1:{port}", transfer_id, layer, 0, 0, BLOCKS_PER_LAYER, payload)
    tx.finish(f"127.0.0.1:{port}", transfer_id)
    return NUM_LAYERS * LAYER_BYTES * 8 / (wait_transfer(receiver, transfer_id) - start) / 1e9


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5, help="alternating runs of each (default 5)")
    parser.add_argument("--connections", type=int, default=8, help="TCP connections / iperf3 streams (default 8)")
    args = parser.parse_args()
    os.sched_setaffinity(0, {SENDER_CPU})
    receiver, port = start_receiver(SECRET, connections=args.connections, cpu=RECEIVER_CPU)
    tx = KVTransport(TransportSettings(secret=SECRET, connections_per_peer=args.connections))
    try:
        transport_gbps(receiver, port, tx, -1)  # opens the connections, which a deployment keeps open
        ours, theirs = [], []
        for round_id in range(args.rounds):
            ours.append(transport_gbps(receiver, port, tx, round_id))
            theirs.append(iperf3_gbps("127.0.0.1", args.connections, NUM_LAYERS * LAYER_BYTES,
                                      server_cpu=RECEIVER_CPU, client_cpu=SENDER_CPU))
            print(f"round {round_id + 1}/{args.rounds}: transport {ours[-1]:.2f} Gbit/s, "
                  f"iperf3 {theirs[-1]:.2f} Gbit/s", file=sys.stderr)
    finally:
        tx.close()
        receiver.kill()
    ratio = median(ours) / median(theirs)
    return verdict("transport loopback goodput vs iperf3", ratio, 0.90,
                   f"median {median(ours):.2f} vs {median(theirs):.2f} Gbit/s, 1 GiB in {NUM_LAYERS} layers, "
                   f"{args.connections} connections")


if __name__ == "__main__":
    sys.exit(main())
