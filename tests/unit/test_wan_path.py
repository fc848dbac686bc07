"""The WAN path used by the transport benchmark: the delay line adds the asked round trip and
drops the asked share of packets, and everything it made is gone afterwards."""
from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from support.netns import available
from support.wan import wan_path

pytestmark = pytest.mark.skipif(available() is not None, reason=str(available()))

ECHO_SERVER = """
import socket, sys
server = socket.create_server((sys.argv[1], 0))
print(server.getsockname()[1], flush=True)
conn, _ = server.accept()
while data := conn.recv(65536):
    conn.sendall(data)
"""


def _round_trips_ms(link, count: int = 20) -> list[float]:
    server = subprocess.Popen(link.exec_argv([sys.executable, "-c", ECHO_SERVER, link.ns_addr]),
                              stdout=subprocess.PIPE, text=True)
    try:
        port = int(server.stdout.readline())
        # At 30% loss a SYN or a byte can be lost four times in a row: 15 s of backed-off retransmissions.
        with socket.create_connection((link.ns_addr, port), timeout=30) as sock:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            samples = []
            for _ in range(count):
                start = time.perf_counter()
                sock.sendall(b"x")
                assert sock.recv(1) == b"x"
                samples.append((time.perf_counter() - start) * 1000)
            return samples
    finally:
        server.kill()
        server.wait()


def test_delay_line_adds_the_round_trip_and_cleans_up():
    with wan_path(100, rtt_ms=10, subnet="10.213.79") as link:
        samples = sorted(_round_trips_ms(link))
        namespace = link.ns
    median = samples[len(samples) // 2]
    assert 9.5 <= median <= 20, samples
    assert namespace not in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout


SINK = """
import socket, sys, threading
server = socket.create_server((sys.argv[1], 0))
print(server.getsockname()[1], flush=True)
received = []
def drain(conn):
    received.append(sum(iter(lambda: len(conn.recv(1 << 20)), 0)))
threads = [threading.Thread(target=drain, args=(server.accept()[0],)) for _ in range(int(sys.argv[2]))]
for thread in threads:
    thread.start()
for thread in threads:
    thread.join()
print(sum(received), flush=True)
"""


def test_the_path_loses_only_what_it_was_asked_to_at_the_cap():
    # 8 connections fill a 1 Gbit/s cap and recover from 1% loss in bursts. Packets the delay line
    # does not read in time overflow a device's ring, on top of the asked loss (4.7% more, measured
    # with a 500-packet ring and a delay line that wrote all due packets before reading any).
    num_connections, num_bytes = 8, 16 << 20
    with wan_path(1000, rtt_ms=20, loss_percent=1, subnet="10.213.83") as link:
        sink = subprocess.Popen(link.exec_argv([sys.executable, "-c", SINK, link.ns_addr, str(num_connections)]),
                                stdout=subprocess.PIPE, text=True)
        try:
            port = int(sink.stdout.readline())
            with ThreadPoolExecutor(num_connections) as pool:
                list(pool.map(lambda _: _send(link.ns_addr, port, num_bytes), range(num_connections)))
            assert int(sink.stdout.readline()) == num_connections * num_bytes
        finally:
            sink.kill()
            sink.wait()
        dropped = {"host": _tx_dropped(["ip", "-s", "-j", "link", "show", link.host_if]),
                   "namespace": _tx_dropped(link.exec_argv(["ip", "-s", "-j", "link", "show", link.ns_if]))}
    assert dropped == {"host": 0, "namespace": 0}


def _send(host: str, port: int, num_bytes: int) -> None:
    with socket.create_connection((host, port), timeout=30) as sock:
        sock.sendall(bytes(num_bytes))


def _tx_dropped(argv: list[str]) -> int:
    return json.loads(subprocess.run(argv, capture_output=True, text=True, check=True).stdout)[0]["stats64"]["tx"][
        "dropped"]


def test_delay_line_drops_packets_at_random():
    # Pings of a single byte: with 30% loss on the way in, some echoes need a retransmission
    # (at least the 200 ms minimum RTO); with none, no round trip takes that long.
    with wan_path(100, rtt_ms=2, loss_percent=30, subnet="10.213.80") as link:
        slow = [ms for ms in _round_trips_ms(link, 30) if ms > 150]
    assert slow, "no packet was lost"


KILLED_OWNER = """
import sys, time
sys.path.insert(0, sys.argv[1])
from support.wan import wan_path
with wan_path(100, rtt_ms=2, subnet="10.213.82") as link:
    print(link.host_if, flush=True)
    time.sleep(600)
"""


def test_a_killed_owner_leaves_no_delay_line_and_its_link_is_removed():
    owner = subprocess.Popen([sys.executable, "-c", KILLED_OWNER, str(Path(__file__).parents[1])],
                             stdout=subprocess.PIPE, text=True)
    host_if = owner.stdout.readline().strip()
    owner.kill()  # no clean-up runs
    owner.wait()
    deadline = time.monotonic() + 5
    while _delay_lines(host_if) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _delay_lines(host_if), "the delay line outlived the process that started it"
    with wan_path(100, rtt_ms=2, subnet="10.213.82") as link:
        assert host_if not in subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True).stdout
        assert f"dev {link.host_if} " in subprocess.run(["ip", "route", "get", link.ns_addr], capture_output=True,
                                                        text=True).stdout


def _delay_lines(host_if: str) -> list[str]:
    found = subprocess.run(["pgrep", "-f", f"delayline-.* {host_if} "], capture_output=True, text=True)
    return found.stdout.split()
