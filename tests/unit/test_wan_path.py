"""The WAN path used by the transport benchmark: the delay line adds the asked round trip and
drops the asked share of packets, and everything it made is gone afterwards."""
from __future__ import annotations

import socket
import subprocess
import sys
import time
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
