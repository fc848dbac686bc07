"""KV transport goodput on a WAN-like link vs iperf3 with as many connections on the same path.

The link runs into a network namespace made here: a 20 ms round trip (a regional cross-datacenter
path; a delay line between two TUN devices, since this kernel has no netem), capped at 1 Gbit/s
with ``tbf`` and dropping 1% of packets at random, so TCP loses and retransmits as on a lossy WAN.
The receiver runs in the namespace; 256 MiB of KV in 64 layers is streamed to it over 8
connections, and over 1 for comparison. The baseline is what the path carries: iperf3 with the same
number of streams through the same link, in the same rounds (alternating with the transport), its
first second of slow start left out since the transport's connections are already open. Likewise
each measured transfer follows an unmeasured quarter-size one straight away: TCP restarts a
connection idle for longer than its retransmission timeout from its initial window
(``net.ipv4.tcp_slow_start_after_idle``, 1 by default), which would charge the transport for the
iperf3 run before it (measured here: 256 MiB at 0.85-0.91 Gbit/s after 4 s idle, 0.92-0.93 back to
back; a deployment whose workers idle between transfers pays that unless it sets the sysctl to 0).
The nominal cap counts IP packets: 1448 bytes of TCP payload in 1500, and 1% of them sent twice, leave
at most about 0.955 of it as goodput. TCP uses the system's congestion control (printed). Needs
root, gcc (the delay line is built on first use) and iperf3.
Target: 8 connections reach 0.95 of iperf3's goodput with 8 streams.

    python bench/transport_wan.py [--rate-mbit 1000] [--loss 1] [--rtt-ms 20] [--megabytes 256] [--rounds 5]
                                  [--whole-frames] [--io-threads N]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import _common  # noqa: F401  (puts the project on sys.path)
from _common import (add_link_arguments, iperf3_run, median, require, send_transfer, start_receiver, verdict,
                     wan_link)

from services.kv_transport import KVTransport, TransportSettings

SECRET = "bench-secret"
NUM_LAYERS = 64
PORT = 47111
TARGET = 0.95
IPERF3_OMIT_S = 1


def stream(receiver, tx: KVTransport, peer: str, layer_bytes: int, transfer_id: str, divisible: bool = True) -> float:
    """Goodput of one transfer in Gbit/s, from its first send to the receiver's last frame."""
    seconds = send_transfer(receiver, tx, peer, transfer_id, NUM_LAYERS, layer_bytes, divisible)
    return NUM_LAYERS * layer_bytes * 8 / seconds / 1e9


def measure(receiver, link, connections: int, layer_bytes: int, rounds: int, iperf3_s: int,
            divisible: bool = True, io_threads: int = TransportSettings().io_threads) -> tuple[float, float]:
    """Median goodput (transport, iperf3) over ``rounds`` alternating runs; the transport's
    connections are opened by a first, unmeasured transfer (workers keep theirs open to a peer), and
    a shorter one brings them back from idle before each measured one."""
    peer = f"{link.ns_addr}:{PORT}"
    tx = KVTransport(TransportSettings(secret=SECRET, connections_per_peer=connections, io_threads=io_threads))
    ours, theirs = [], []
    try:
        stream(receiver, tx, peer, layer_bytes, f"wan-{connections}-open")
        for round_id in range(rounds):
            stream(receiver, tx, peer, layer_bytes // 4, f"wan-{connections}-{round_id}-warm", divisible)
            ours.append(stream(receiver, tx, peer, layer_bytes, f"wan-{connections}-{round_id}", divisible))
            theirs.append(iperf3_run(link.ns_addr, connections, 0, netns=link.ns, seconds=iperf3_s,
                                     omit_s=IPERF3_OMIT_S).gbps)
            print(f"  {connections} connection(s), round {round_id + 1}: transport {ours[-1]:.3f} Gbit/s "
                  f"({tx.snapshot().peers[0].retransmits} retransmits so far), iperf3 {theirs[-1]:.3f} Gbit/s",
                  file=sys.stderr)
    finally:
        tx.close()
    return median(ours), median(theirs)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_link_arguments(parser)
    parser.add_argument("--megabytes", type=int, default=256, help="KV per transfer in MiB (default 256)")
    parser.add_argument("--rounds", type=int, default=5, help="measured runs of each per connection count, after "
                        "one to open the connections (default 5)")
    parser.add_argument("--connections", type=int, default=8, help="connections of the headline (default 8)")
    parser.add_argument("--buffer-ms", type=int, default=20, help="bottleneck queue in ms at the cap (default 20)")
    parser.add_argument("--whole-frames", action="store_true", help="send every frame whole, as the transport did "
                        "before a slow connection took frames in parts (for an old/new comparison)")
    parser.add_argument("--io-threads", type=int, default=TransportSettings().io_threads,
                        help=f"transport.io_threads of both ends (default {TransportSettings().io_threads})")
    args = parser.parse_args()
    require("iperf3", "iperf3")
    cap_gbps = args.rate_mbit / 1000
    layer_bytes = args.megabytes * (1 << 20) // NUM_LAYERS
    congestion_control = Path("/proc/sys/net/ipv4/tcp_congestion_control").read_text().strip()
    with wan_link(args.rate_mbit, args.loss, args.buffer_ms, args.rtt_ms) as link:
        receiver, _ = start_receiver(SECRET, link.ns_addr, PORT, netns=link.ns, io_threads=args.io_threads)
        try:
            print(f"link: {args.rate_mbit} Mbit/s cap, {args.rtt_ms:g} ms added round trip, {args.loss:g}% random "
                  f"loss, TCP {congestion_control}; {args.megabytes} MiB per transfer", file=sys.stderr)
            iperf3_s = max(2, round(args.megabytes * 8 * 1.048576 / args.rate_mbit))  # a transfer at the cap
            results = {n: measure(receiver, link, n, layer_bytes, args.rounds, iperf3_s, not args.whole_frames,
                                  args.io_threads)
                       for n in sorted({1, args.connections})}
        finally:
            receiver.kill()
    path = f"{args.rtt_ms:g} ms RTT, {args.loss:g}% loss, TCP {congestion_control}"
    (one, one_iperf3), (ours, theirs) = results[1], results[args.connections]
    print(f"1 connection: {one:.3f} Gbit/s, {one / cap_gbps:.3f} of the cap, {one / one_iperf3:.3f} of iperf3 -P 1 "
          f"({one_iperf3:.3f} Gbit/s); {args.connections} connections carry {ours / one:.2f}x as much")
    print(f"transport WAN goodput with {args.connections} connections, fraction of the nominal cap: "
          f"{ours / cap_gbps:.3f} (iperf3 -P {args.connections}: {theirs / cap_gbps:.3f}; {args.rate_mbit} Mbit/s, "
          f"{path})")
    return verdict(f"transport WAN goodput vs iperf3 on the same path, {args.connections} connections", ours / theirs,
                   TARGET, f"median {ours:.3f} vs {theirs:.3f} Gbit/s, {args.megabytes} MiB per transfer, {path}",
                   baseline=f"iperf3 -P {args.connections} {theirs:.3f} Gbit/s")


if __name__ == "__main__":
    sys.exit(main())
