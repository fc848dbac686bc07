"""Does ``MSG_ZEROCOPY`` pay for the KV transport's large frames? A probe, not a benchmark.

The same bytes go over loopback TCP connections (a receiver process reads them with ``recv_into``
into one buffer per connection) from one sending thread, in frames of each size asked for: with
plain ``sendmsg`` (the transport's way: the kernel copies the frame into the socket) and with
``sendmsg(..., MSG_ZEROCOPY)`` (the kernel pins the pages and reports, on the socket's error queue,
when it no longer needs them; the probe reaps those reports as it goes, as a sender that releases
the caller's buffer only then would). Prints goodput and the CPU seconds per GiB of each end.
docs/transport.md has the figures measured here.

    python scripts/probe_msg_zerocopy.py [--frames-kib 512,4096] [--megabytes 2048] [--connections 4]
"""
from __future__ import annotations

import argparse
import multiprocessing
import os
import select
import socket
import time

SO_ZEROCOPY = getattr(socket, "SO_ZEROCOPY", 60)
MSG_ZEROCOPY = getattr(socket, "MSG_ZEROCOPY", 0x4000000)
MSG_ERRQUEUE = getattr(socket, "MSG_ERRQUEUE", 0x2000)


def receive(port: int, connections: int, total: int, done) -> None:
    listener = socket.create_server(("127.0.0.1", port))
    conns = [listener.accept()[0] for _ in range(connections)]
    buffers = {c.fileno(): memoryview(bytearray(8 << 20)) for c in conns}
    by_fd = {c.fileno(): c for c in conns}
    poller = select.epoll()
    for conn in conns:
        conn.setblocking(False)
        poller.register(conn, select.EPOLLIN)
    got, cpu = 0, os.times()
    while got < total:
        for fd, _ in poller.poll():
            try:
                got += by_fd[fd].recv_into(buffers[fd])
            except BlockingIOError:
                pass
    after = os.times()
    done.put((after.user - cpu.user, after.system - cpu.system))


def reap(sock: socket.socket) -> int:
    """Completion reports read off the error queue (each covers a range of sends)."""
    reaped = 0
    while True:
        try:
            sock.recvmsg(0, 256, MSG_ERRQUEUE | socket.MSG_DONTWAIT)
            reaped += 1
        except BlockingIOError:
            return reaped


def run(frame_bytes: int, total: int, connections: int, zerocopy: bool) -> tuple[float, float, float, float, float]:
    port = socket.create_server(("127.0.0.1", 0)).getsockname()[1]
    done: multiprocessing.Queue = multiprocessing.Queue()
    receiver = multiprocessing.Process(target=receive, args=(port, connections, total, done))
    receiver.start()
    time.sleep(0.3)
    socks = []
    for _ in range(connections):
        sock = socket.create_connection(("127.0.0.1", port))
        if zerocopy:
            sock.setsockopt(socket.SOL_SOCKET, SO_ZEROCOPY, 1)
        socks.append(sock)
    payload = memoryview(os.urandom(frame_bytes))
    flags = MSG_ZEROCOPY if zerocopy else 0
    sent, reaped, start, cpu = 0, 0, time.perf_counter(), os.times()
    index = 0
    while sent < total:
        sock = socks[index % connections]
        index += 1
        view = payload[:min(frame_bytes, total - sent)]
        while view:
            try:
                n = sock.sendmsg([view], [], flags)
            except OSError as exc:  # ENOBUFS: too many unreaped notifications
                if exc.errno != 105:
                    raise
                reaped += reap(sock)
                continue
            view = view[n:]
            sent += n
        if zerocopy:
            reaped += reap(sock)
    receiver_cpu = done.get()
    elapsed = time.perf_counter() - start
    after = os.times()
    receiver.join()
    for sock in socks:
        sock.close()
    gib = total / (1 << 30)
    return (total * 8 / elapsed / 1e9, (after.user - cpu.user) / gib, (after.system - cpu.system) / gib,
            receiver_cpu[0] / gib, receiver_cpu[1] / gib)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--frames-kib", default="512,4096", help="frame sizes in KiB (default 512,4096)")
    parser.add_argument("--megabytes", type=int, default=2048, help="bytes per run in MiB (default 2048)")
    parser.add_argument("--connections", type=int, default=4, help="connections (default 4)")
    parser.add_argument("--rounds", type=int, default=3, help="runs of each; all are printed (default 3)")
    args = parser.parse_args()
    total = args.megabytes << 20
    for frame_kib in (int(k) for k in args.frames_kib.split(",")):
        for round_id in range(args.rounds):
            for zerocopy in (False, True):
                gbps, su, ss, ru, rs = run(frame_kib << 10, total, args.connections, zerocopy)
                mode = "MSG_ZEROCOPY" if zerocopy else "copy        "
                print(f"frames {frame_kib:5d} KiB, round {round_id + 1}, {mode}: "
                      f"{gbps:6.2f} Gbit/s; CPU s/GiB sender {su:.3f} user + {ss:.3f} sys, "
                      f"receiver {ru:.3f} + {rs:.3f}", flush=True)


if __name__ == "__main__":
    main()
