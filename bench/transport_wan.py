"""KV transport goodput on a WAN-like link: 1 connection vs 8, as a fraction of the link's cap.

The link runs into a network namespace made here: a 20 ms round trip (a regional cross-datacenter
path; a delay line between two TUN devices, since this kernel has no netem), capped at 1 Gbit/s
with ``tbf`` and dropping 1% of packets at random, so TCP loses and retransmits as on a lossy WAN.
The receiver runs in the namespace; 256 MiB of KV in 64 layers is streamed to it. TCP uses the
system's congestion control (printed). Needs root and gcc (the delay line is built on first use).
Target: 8 connections reach 0.85 of the cap and at least 1.2x one connection.

    python bench/transport_wan.py [--rate-mbit 1000] [--loss 1] [--rtt-ms 20] [--megabytes 256]
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import _common  # noqa: F401  (puts the project on sys.path)
from _common import median, start_receiver, wait_transfer, wan_link

from services.kv_transport import KVTransport, TransportSettings

SECRET = "bench-secret"
NUM_LAYERS = 64
PORT = 47111

def stream(receiver, tx: KVTransport, peer: str, connections: int, layer_bytes: int, round_id: int) -> float:
    transfer_id = f"wan-{connections}-{round_id}"
    payload = memoryview(bytes(layer_bytes))
    start = time.time()
    for layer in range(NUM_LAYERS):
        tx.send(peer, transfer_id, layer, 0, 0, 64, payload)
    tx.finish(peer, transfer_id)
    gbps = NUM_LAYERS * layer_bytes * 8 / (wait_transfer(receiver, transfer_id) - start) / 1e9
    if round_id >= 0:
        retransmits = tx.snapshot().peers[0].retransmits
        print(f"  {connections} connection(s), round {round_id + 1}: {gbps:.3f} Gbit/s, "
              f"{retransmits} retransmits so far", file=sys.stderr)
    return gbps


def measure(receiver, peer: str, connections: int, layer_bytes: int, rounds: int) -> float:
    """Median goodput over ``rounds`` transfers on connections opened by a first, unmeasured one
    (workers keep their connections to a peer open)."""
    tx = KVTransport(TransportSettings(secret=SECRET, connections_per_peer=connections))
    try:
        stream(receiver, tx, peer, connections, layer_bytes, -1)
        return median([stream(receiver, tx, peer, connections, layer_bytes, r) for r in range(rounds)])
    finally:
        tx.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rate-mbit", type=int, default=1000, help="link cap in Mbit/s (default 1000)")
    parser.add_argument("--loss", type=float, default=1, help="random packet loss in percent (default 1)")
    parser.add_argument("--rtt-ms", type=float, default=20, help="round trip added by the link in ms; 0: a plain "
                        "veth pair, tens of microseconds (default 20)")
    parser.add_argument("--megabytes", type=int, default=256, help="KV per transfer in MiB (default 256)")
    parser.add_argument("--rounds", type=int, default=3, help="measured runs per connection count, after one "
                        "to open the connections (default 3)")
    parser.add_argument("--buffer-ms", type=int, default=20, help="bottleneck queue in ms at the cap (default 20)")
    args = parser.parse_args()
    cap_gbps = args.rate_mbit / 1000
    layer_bytes = args.megabytes * (1 << 20) // NUM_LAYERS
    congestion_control = Path("/proc/sys/net/ipv4/tcp_congestion_control").read_text().strip()
    with wan_link(args.rate_mbit, args.loss, args.buffer_ms, args.rtt_ms) as link:
        receiver, _ = start_receiver(SECRET, link.ns_addr, PORT, netns=link.ns)
        try:
            print(f"link: {args.rate_mbit} Mbit/s cap, {args.rtt_ms:g} ms added round trip, {args.loss:g}% random "
                  f"loss, TCP {congestion_control}; {args.megabytes} MiB per transfer", file=sys.stderr)
            peer = f"{link.ns_addr}:{PORT}"
            results = {n: measure(receiver, peer, n, layer_bytes, args.rounds) for n in (1, 8)}
        finally:
            receiver.kill()
    one, eight = results[1] / cap_gbps, results[8] / cap_gbps
    ok = eight >= 0.85 and eight >= 1.2 * one
    print(f"transport WAN goodput with 8 connections, fraction of the cap: {eight:.3f} (1 connection {one:.3f}, "
          f"{eight / one:.2f}x; {args.rtt_ms:g} ms RTT, {args.loss:g}% loss, TCP {congestion_control}); "
          f"target >= 0.85 and >= 1.2x one connection: {'PASS' if ok else 'FAIL'}")
    return 0 if ok else 1

if __name__ == "__main__":
    sys.exit(main())
