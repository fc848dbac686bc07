"""KV transport goodput on a WAN-like link: 1 connection vs 8, as a fraction of the link's cap.

The link is a veth pair into a network namespace made here, capped at 1 Gbit/s with ``tbf`` and
dropping 1% of packets at random (nftables), so TCP loses and retransmits as on a lossy WAN.
The receiver runs in the namespace; 256 MiB of KV in 64 layers is streamed to it. Needs root.

    python bench/transport_wan.py [--rate-mbit 1000] [--loss 1] [--megabytes 256]
"""
from __future__ import annotations

import argparse
import sys
import time

import _common  # noqa: F401  (puts the project on sys.path)
from _common import median, start_receiver, verdict, wait_transfer, wan_link

from services.kv_transport import KVTransport, TransportSettings

SECRET = "bench-secret"
NUM_LAYERS = 64
PORT = 47111

def stream(receiver, address: str, connections: int, layer_bytes: int, round_id: int) -> float:
    tx = KVTransport(TransportSettings(secret=SECRET, connections_per_peer=connections))
    peer = f"{address}:{PORT}"
    payload = memoryview(bytes(layer_bytes))
    try:
        start = time.time()
        for layer in range(NUM_LAYERS):
            tx.send(peer, f"wan-{connections}-{round_id}", layer, 0, 0, 64, payload)
        tx.finish(peer, f"wan-{connections}-{round_id}")
        done_at = wait_transfer(receiver, f"wan-{connections}-{round_id}")
        retransmits = tx.snapshot()["peers"][0]["retransmits"]
        gbps = NUM_LAYERS * layer_bytes * 8 / (done_at - start) / 1e9
        print(f"  {connections} connection(s), round {round_id + 1}: {gbps:.3f} Gbit/s, "
              f"{retransmits} retransmits", file=sys.stderr)
        return gbps
    finally:
        tx.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rate-mbit", type=int, default=1000, help="link cap in Mbit/s (default 1000)")
    parser.add_argument("--loss", type=int, default=1, help="random packet loss in percent (default 1)")
    parser.add_argument("--megabytes", type=int, default=256, help="KV per transfer in MiB (default 256)")
    parser.add_argument("--rounds", type=int, default=2, help="runs per connection count (default 2)")
    parser.add_argument("--buffer-ms", type=int, default=20, help="bottleneck queue in ms at the cap (default 20)")
    args = parser.parse_args()
    cap_gbps = args.rate_mbit / 1000
    layer_bytes = args.megabytes * (1 << 20) // NUM_LAYERS
    with wan_link(args.rate_mbit, args.loss, args.buffer_ms) as link:
        receiver, _ = start_receiver(SECRET, link.ns_addr, PORT, netns=link.ns)
        try:
            print(f"link: {args.rate_mbit} Mbit/s cap, {args.loss}% random loss; {args.megabytes} MiB per "
                  f"transfer", file=sys.stderr)
            results = {n: median([stream(receiver, link.ns_addr, n, layer_bytes, r) for r in range(args.rounds)])
                       for n in (1, 8)}
        finally:
            receiver.kill()
    one, eight = results[1] / cap_gbps, results[8] / cap_gbps
    print(f"1 connection: {one:.3f} of the cap; 8 connections: {eight:.3f} of the cap ({eight / one:.2f}x)")
    if eight < one * 1.2:
        print("8 connections are not well above 1 connection (target: at least 1.2x)")
        return 1
    return verdict("transport WAN goodput with 8 connections, fraction of the cap", eight, 0.85,
                   f"{results[8]:.3f} of {cap_gbps:.3f} Gbit/s; 1 connection {one:.3f}")


if __name__ == "__main__":
    sys.exit(main())
