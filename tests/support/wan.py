"""A WAN path on one machine: propagation delay, a ``tbf`` cap and random loss, between this
namespace and a private one. Needs root and gcc.

This kernel has no ``netem`` (and no ``fq`` for timestamp-based delay), so the delay comes from a
userspace delay line (``delayline.c``, compiled on first use) bridging two TUN devices: one here,
one in the namespace. The delay is split evenly between the two directions; loss applies per
packet on the way into the namespace. The yielded ``VethLink`` works as for a veth pair:
``set_rate`` caps host → namespace, ``set_up`` cuts the path.
"""
from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from support.netns import VethLink, available, new_link, run_command

SOURCE = Path(__file__).with_name("delayline.c")
# Packets each TUN device holds for the delay line to read: at the default 500, a few milliseconds
# without a read at 1 Gbit/s (the host's other work) drop packets that the path was not asked to lose.
RING_PACKETS = 20000


def delay_line_binary() -> Path:
    """The compiled delay line, cached by its source's hash."""
    source = SOURCE.read_bytes()
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "prfaas"
    binary = cache / f"delayline-{hashlib.sha256(source).hexdigest()[:12]}"
    if not binary.exists():
        if shutil.which("gcc") is None:
            raise RuntimeError("the WAN delay line needs gcc to build tests/support/delayline.c")
        cache.mkdir(parents=True, exist_ok=True)
        partial = binary.with_suffix(f".{os.getpid()}")
        run_command("gcc", "-O2", "-pthread", "-o", str(partial), str(SOURCE))
        partial.replace(binary)
    return binary


@contextmanager
def wan_path(rate_mbit: float, rtt_ms: float, loss_percent: float = 0.0, buffer_ms: int = 20,
             subnet: str = "10.213.78", seed: int = 1) -> Iterator[VethLink]:
    """``subnet``.1 here and ``subnet``.2 in a fresh namespace, ``rtt_ms`` apart, host → namespace
    capped at ``rate_mbit`` (a ``tbf`` queue of ``buffer_ms``) and losing ``loss_percent`` of packets.
    The delay line dies with the thread that entered this (a killed owner leaves none running)."""
    if (reason := available()) is not None:
        raise PermissionError(reason)
    link = new_link("pt", subnet)
    line = subprocess.Popen([str(delay_line_binary()), link.host_if, link.ns_if, str(int(rtt_ms * 500)),
                             str(loss_percent), str(seed)], stdout=subprocess.PIPE, text=True)
    try:
        if line.stdout.readline().strip() != "ready":
            raise RuntimeError(f"the delay line exited with {line.wait()}")
        run_command("ip", "netns", "add", link.ns)
        run_command("ip", "link", "set", link.ns_if, "netns", link.ns)
        run_command("ip", "addr", "add", f"{link.host_addr}/32", "peer", link.ns_addr, "dev", link.host_if)
        run_command("ip", "link", "set", link.host_if, "txqueuelen", str(RING_PACKETS), "up")
        for argv in (["ip", "addr", "add", f"{link.ns_addr}/32", "peer", link.host_addr, "dev", link.ns_if],
                     ["ip", "link", "set", link.ns_if, "txqueuelen", str(RING_PACKETS), "up"],
                     ["ip", "link", "set", "lo", "up"]):
            run_command(*link.exec_argv(argv))
        link.set_rate(rate_mbit, "host", buffer_ms, action="add")
        yield link
    finally:
        line.kill()
        line.wait()
        subprocess.run(["ip", "netns", "del", link.ns], capture_output=True)
