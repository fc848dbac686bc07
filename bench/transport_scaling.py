"""Loopback goodput of the KV transport against connections and I/O threads, beside iperf3's.

For each number of I/O threads per side (``transport.io_threads``: 1, 2, ... up to the host's
cores) and each number of connections (1, 2, 4, 8, 16), 1 GiB of KV (64 layers of 16 MiB, checksums
and the shared secret on, as deployed) goes from this process to a receiver process; iperf3 moves
the same bytes with as many streams in the same rounds, the two taking turns. Each end gets half of
the cores: the sender (this process) and iperf3's client the first half, the receiver and iperf3's
server the second (on a 2-core host one each, as bench/transport_loopback.py pins them), so the
ends never take each other's cores, and a thread count beyond an end's cores shows what it costs. The best round of each
point is kept (bench/transport_loopback.py says why). Each point's CPU per GiB (user and system, of
each end) is printed beside it; the table and a plot (Gbit/s against connections, a line per
thread count and one for iperf3) are written under bench/results/transport_scaling-<time>/.

Target: with 8 connections, the best thread count reaches 0.9 of iperf3 with 8 streams. Growth with
threads stops where the cores do: on a host with as many cores as one end needs threads, the
sender and the receiver share them (docs/transport.md).

    python bench/transport_scaling.py [--connections 1,2,4,8,16] [--threads 1,2] [--megabytes 1024]
                                      [--rounds 3] [--frame-kib 512] [--tls] [--out DIR]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import textwrap
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import _common  # noqa: F401  (puts the project on sys.path)
from _common import iperf3_run, process_user_sys_s, require, results_dir, start_receiver, verdict, wait_transfer

from services.kv_transport import KVTransport, TransportSettings
from services.kv_transport.protocol import DEFAULT_FRAME_SIZES

SECRET = "bench-secret"
NUM_LAYERS = 64
HEADLINE_CONNECTIONS = 8
TARGET = 0.90


@dataclass(frozen=True)
class Point:
    """One round of one configuration: goodput, and CPU seconds per GiB of each end."""
    gbps: float
    sender_user: float
    sender_sys: float
    receiver_user: float
    receiver_sys: float

    @property
    def cpu_per_gib(self) -> float:
        return self.sender_user + self.sender_sys + self.receiver_user + self.receiver_sys


def transport_round(receiver: subprocess.Popen, tx: KVTransport, peer: str, transfer_id: str,
                    payload: memoryview) -> Point:
    receiver_before, sender_before = process_user_sys_s(receiver.pid), os.times()
    start = time.time()
    for layer in range(NUM_LAYERS):
        tx.send(peer, transfer_id, layer, 0, 0, 256, payload, divisible=True)
    tx.finish(peer, transfer_id)
    elapsed = wait_transfer(receiver, transfer_id) - start
    sender_after, receiver_after = os.times(), process_user_sys_s(receiver.pid)
    gib = NUM_LAYERS * len(payload) / (1 << 30)
    return Point(NUM_LAYERS * len(payload) * 8 / elapsed / 1e9,
                 (sender_after.user - sender_before.user) / gib, (sender_after.system - sender_before.system) / gib,
                 (receiver_after[0] - receiver_before[0]) / gib, (receiver_after[1] - receiver_before[1]) / gib)


def iperf3_round(streams: int, num_bytes: int, sender_cpus: str, receiver_cpus: str) -> Point:
    run = iperf3_run("127.0.0.1", streams, num_bytes, client_cpu=sender_cpus, server_cpu=receiver_cpus)
    gib = (run.num_bytes or num_bytes) / (1 << 30)
    return Point(run.gbps, (run.client_cpu_s - run.client_sys_s) / gib, run.client_sys_s / gib,
                 (run.server_cpu_s - run.server_sys_s) / gib, run.server_sys_s / gib)


def parse_counts(text: str) -> list[int]:
    return sorted({int(part) for part in text.split(",") if part.strip()})


def halves() -> tuple[list[int], list[int]]:
    """The cores of the sending end and of the receiving end (one each on a 2-core host)."""
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        return cores, cores
    return cores[:len(cores) // 2], cores[len(cores) // 2:]


def default_threads() -> str:
    """1, and powers of 2 up to twice an end's cores (at least 2): the last shows threads beyond the cores."""
    cores = len(halves()[0])
    counts, n = [1], 2
    while n <= max(2 * cores, 2):
        counts.append(n)
        n *= 2
    return ",".join(map(str, counts))


def tls_settings(directory: Path) -> dict[str, str]:
    from support.certs import make_node_cert  # tests/support, on the path through _common
    return make_node_cert(directory).transport()


def best(points: list[Point]) -> Point:
    return max(points, key=lambda p: p.gbps)


def describe(name: str, point: Point) -> str:
    return (f"{name}: {point.gbps:6.2f} Gbit/s, CPU s/GiB sender {point.sender_user:.3f} user + "
            f"{point.sender_sys:.3f} sys, receiver {point.receiver_user:.3f} + {point.receiver_sys:.3f}")


def plot(path: Path, connections: list[int], ours: dict[tuple[int, int], Point], theirs: dict[int, Point],
         threads: list[int], title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    figure, axes = plt.subplots(figsize=(7, 4.5))
    for t in threads:
        axes.plot(connections, [ours[t, n].gbps for n in connections], marker="o", label=f"transport, {t} I/O thread"
                  + ("s" if t > 1 else "") + " per side")
    axes.plot(connections, [theirs[n].gbps for n in connections], marker="s", linestyle="--", color="black",
              label="iperf3 (same streams)")
    axes.set_xscale("log", base=2)
    axes.set_xticks(connections, [str(n) for n in connections])
    axes.set_xlabel("TCP connections (iperf3 streams)")
    axes.set_ylabel("goodput, Gbit/s (best round)")
    axes.set_ylim(bottom=0)
    axes.set_title(textwrap.fill(title, 100), fontsize=8)
    axes.grid(alpha=0.3)
    axes.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--connections", default="1,2,4,8,16", help="connection counts (default 1,2,4,8,16)")
    parser.add_argument("--threads", default=default_threads(),
                        help=f"I/O thread counts per side (default: 1 and powers of 2 up to twice an end's cores, here "
                        f"{default_threads()})")
    parser.add_argument("--megabytes", type=int, default=1024, help="KV per transfer in MiB (default 1024)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds; the best of each point is kept (default 3)")
    parser.add_argument("--frame-kib", type=int, default=DEFAULT_FRAME_SIZES.preferred >> 10,
                        help="transport.frame_bytes in KiB, set on both ends (default "
                        f"{DEFAULT_FRAME_SIZES.preferred >> 10}, what a receiver without a GPU announces)")
    parser.add_argument("--tls", action="store_true", help="mutual TLS on the transport's connections (a throwaway "
                        "CA); iperf3 stays plain, so the ratio is TLS's cost")
    parser.add_argument("--out", type=Path, default=None, help="where the table and plot go (default "
                        "bench/results/transport_scaling-<time>/)")
    args = parser.parse_args()
    require("iperf3", "iperf3")
    connections, threads = parse_counts(args.connections), parse_counts(args.threads)
    headline_n = HEADLINE_CONNECTIONS if HEADLINE_CONNECTIONS in connections else max(connections)
    layer_bytes = args.megabytes * (1 << 20) // NUM_LAYERS
    payload = memoryview(os.urandom(layer_bytes))
    cores = len(os.sched_getaffinity(0))
    sending, receiving = halves()
    sender_cpus, receiver_cpus = ",".join(map(str, sending)), ",".join(map(str, receiving))
    os.sched_setaffinity(0, sending)
    with tempfile.TemporaryDirectory() as certs:
        extra = tls_settings(Path(certs)) if args.tls else {}
        common = dict(secret=SECRET, frame_bytes=args.frame_kib << 10, **extra)
        receivers = {t: start_receiver(SECRET, connections=max(connections), io_threads=t, cpu=receiver_cpus, **{
            k: v for k, v in common.items() if k != "secret"}) for t in threads}
        links = {(t, n): KVTransport(TransportSettings(connections_per_peer=n, io_threads=min(t, n), **common))
                 for t in threads for n in connections}
        ours: dict[tuple[int, int], list[Point]] = {key: [] for key in links}
        theirs: dict[int, list[Point]] = {n: [] for n in connections}
        try:
            for (t, n), tx in links.items():  # opens the connections, which a deployment keeps open
                receiver, port = receivers[t]
                transport_round(receiver, tx, f"127.0.0.1:{port}", f"open-{t}-{n}", payload[:layer_bytes // 16])
            for round_id in range(args.rounds):
                for n in connections:
                    for t in threads:
                        receiver, port = receivers[t]
                        ours[t, n].append(transport_round(receiver, links[t, n], f"127.0.0.1:{port}",
                                                          f"r{round_id}-{t}-{n}", payload))
                        print(f"round {round_id + 1}, {n:2d} connections, {t} threads: "
                              + describe("transport", ours[t, n][-1]), file=sys.stderr)
                    theirs[n].append(iperf3_round(n, NUM_LAYERS * layer_bytes, sender_cpus, receiver_cpus))
                    print(f"round {round_id + 1}, {n:2d} streams:              "
                          + describe("iperf3", theirs[n][-1]), file=sys.stderr)
        finally:
            for tx in links.values():
                tx.close()
            for receiver, _ in receivers.values():
                receiver.kill()
                receiver.wait()
    best_ours = {key: best(points) for key, points in ours.items()}
    best_theirs = {n: best(points) for n, points in theirs.items()}
    out = args.out or results_dir("transport_scaling")
    out.mkdir(parents=True, exist_ok=True)
    setup = (f"{cores} cores (sender on {sender_cpus}, receiver on {receiver_cpus}), {args.megabytes} MiB per "
             f"transfer, frames of {args.frame_kib} KiB"
             + (", mutual TLS" if args.tls else "") + f", best of {args.rounds} rounds")
    print(f"goodput in Gbit/s (best round; CPU s/GiB of both ends together in brackets); {setup}")
    print("connections  " + "  ".join(f"{t} thread{'s' if t > 1 else ' '}      " for t in threads) + "  iperf3")
    for n in connections:
        cells = [f"{best_ours[t, n].gbps:6.2f} ({best_ours[t, n].cpu_per_gib:.2f})" for t in threads]
        print(f"{n:11d}  " + "  ".join(f"{cell:15s}" for cell in cells)
              + f"  {best_theirs[n].gbps:6.2f} ({best_theirs[n].cpu_per_gib:.2f})")
    (out / "points.json").write_text(json.dumps({
        "setup": setup, "transport": [{"threads": t, "connections": n, **asdict(p)} for (t, n), p in best_ours.items()],
        "iperf3": [{"connections": n, **asdict(p)} for n, p in best_theirs.items()]}, indent=1))
    plot(out / "scaling.png", connections, best_ours, best_theirs, threads,
         f"KV transport vs iperf3 on loopback; {setup}")
    print(f"plot: {out / 'scaling.png'}")
    top = max(threads, key=lambda t: best_ours[t, headline_n].gbps)
    ours_gbps, theirs_gbps = best_ours[top, headline_n].gbps, best_theirs[headline_n].gbps
    by_threads = ", ".join(f"{t}: {best_ours[t, headline_n].gbps:.2f}" for t in threads)
    return verdict(f"transport scaling, {headline_n} connections, best I/O threads vs iperf3 -P {headline_n}",
                   ours_gbps / theirs_gbps, TARGET,
                   f"{ours_gbps:.2f} vs {theirs_gbps:.2f} Gbit/s with {top} threads; by threads {by_threads}; {setup}",
                   baseline=f"iperf3 -P {headline_n} best {theirs_gbps:.2f} Gbit/s")


if __name__ == "__main__":
    sys.exit(main())
