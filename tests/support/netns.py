"""A WAN-like link made by a test or benchmark itself: a veth pair into a private network namespace,
capped with ``tbf`` on either side and, optionally, dropping packets at random with nftables.
Needs root. Used by ``tests/e2e`` and ``bench/``; it imports nothing from the project."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from itertools import count
from pathlib import Path
from typing import Literal

Side = Literal["host", "ns"]
_serial = count()
# The names this module and support.wan give: "pf" (veth) or "pt" (delay line), the owner's pid, a serial.
_OWNED = re.compile(r"p[ft](\d+)x\d+(?:ns|a|b)")


def available() -> str | None:
    """None when this process can make namespaces; otherwise why not."""
    if os.geteuid() != 0:
        return "needs root (network namespaces, veth pairs, tc)"
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    return f"needs {', '.join(missing)} (Debian package iproute2)" if missing else None


@dataclass(frozen=True, slots=True)
class VethLink:
    """``host_addr`` lives on ``host_if`` in the caller's namespace, ``ns_addr`` on ``ns_if`` in ``ns``."""

    ns: str
    host_if: str
    ns_if: str
    host_addr: str
    ns_addr: str

    def exec_argv(self, argv: list[str]) -> list[str]:
        """``argv`` run inside the namespace (``ip netns exec`` execs it: the pid stays the same)."""
        return ["ip", "netns", "exec", self.ns, *argv]

    def set_rate(self, rate_mbit: float, side: Side = "host", buffer_ms: int = 20, action: str = "change") -> None:
        """(Re)cap traffic leaving ``side``: ``host`` caps host → namespace, ``ns`` the way back."""
        burst = max(int(rate_mbit * 125), 131072)  # bytes: 1 ms at the cap, room for a 64 KiB GSO packet
        limit = max(int(rate_mbit * 125 * buffer_ms), 3 * 1514)  # bytes: the bottleneck queue
        self._on(side, "tc", "qdisc", action, "dev", self._dev(side), "root", "tbf", "rate", f"{rate_mbit}mbit",
                 "burst", str(burst), "limit", str(limit))

    def set_up(self, up: bool, side: Side = "ns") -> None:
        """Take one end down (or up): the pair carries nothing while either end is down. Taking the
        namespace end down keeps ``host_addr`` reachable from the host itself."""
        self._on(side, "ip", "link", "set", self._dev(side), "up" if up else "down")

    def drop_percent(self, percent: int) -> None:
        """Drop this share of the packets arriving in the namespace from the host (needs nft)."""
        table = f"table inet {self.ns} {{\n chain input {{\n  type filter hook input priority 0; policy accept;\n" \
                f"  ip saddr {self.host_addr} numgen random mod 100 < {percent} drop\n }}\n}}\n"
        self._on("ns", "nft", "-f", "-", stdin=table)

    def _dev(self, side: Side) -> str:
        return self.host_if if side == "host" else self.ns_if

    def _on(self, side: Side, *argv: str, stdin: str | None = None) -> None:
        run_command(*(self.exec_argv(list(argv)) if side == "ns" else argv), stdin=stdin)


@contextmanager
def veth_link(subnet: str = "10.213.77", rate_mbit: float | None = None, side: Side = "host",
              buffer_ms: int = 20) -> Iterator[VethLink]:
    """A fresh namespace joined to this one by a veth pair on ``subnet``.1/30 (here) and .2 (there),
    optionally capped from the start; everything is removed on exit, also after a failure."""
    if (reason := available()) is not None:
        raise PermissionError(reason)
    link = new_link("pf", subnet)
    run_command("ip", "netns", "add", link.ns)
    try:
        run_command("ip", "link", "add", link.host_if, "type", "veth", "peer", "name", link.ns_if)
        run_command("ip", "link", "set", link.ns_if, "netns", link.ns)
        run_command("ip", "addr", "add", f"{link.host_addr}/30", "dev", link.host_if)
        run_command("ip", "link", "set", link.host_if, "up")
        for argv in (["ip", "addr", "add", f"{link.ns_addr}/30", "dev", link.ns_if],
                     ["ip", "link", "set", link.ns_if, "up"], ["ip", "link", "set", "lo", "up"]):
            run_command(*link.exec_argv(argv))
        for dev in (link.host_if, link.ns_if):  # segments no larger than on a real NIC's wire
            _ethtool(link, dev, "tso", "off", "gso", "off")
        if rate_mbit is not None:
            link.set_rate(rate_mbit, side, buffer_ms, action="add")
        yield link
    finally:
        subprocess.run(["ip", "link", "del", link.host_if], capture_output=True)
        subprocess.run(["ip", "netns", "del", link.ns], capture_output=True)


def new_link(kind: str, subnet: str) -> VethLink:
    """The names and addresses of a new link, once the links of dead owners are gone and ``subnet``
    is free (a RuntimeError naming the interface that holds it, if not)."""
    remove_stale_links()
    addresses = subprocess.run(["ip", "-o", "-4", "addr", "show"], capture_output=True, text=True).stdout
    for line in addresses.splitlines():
        fields = line.split()
        if f"{subnet}.1" in (address.split("/")[0] for address in fields[3:]):
            raise RuntimeError(f"{subnet}.1 is already on interface {fields[1]}: another test or benchmark "
                               "on this machine is using the subnet")
    tag = f"{kind}{os.getpid()}x{next(_serial)}"  # at most 15 bytes: "pf", 7 digits of pid_max, "x", "NNa"
    return VethLink(f"{tag}ns", f"{tag}a", f"{tag}b", f"{subnet}.1", f"{subnet}.2")


def remove_stale_links() -> None:
    """Delete the namespaces and host interfaces this module or ``support.wan`` made for processes
    that no longer run (killed before their ``finally``): their routes would take their subnets."""
    names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split()
    for name in names:
        if (owner := _OWNED.fullmatch(name)) and not _alive(int(owner[1])):
            subprocess.run(["ip", "netns", "del", name], capture_output=True)
    for line in subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True).stdout.splitlines():
        name = line.split(":")[1].strip().split("@")[0]
        if (owner := _OWNED.fullmatch(name)) and not _alive(int(owner[1])):
            subprocess.run(["ip", "link", "del", name], capture_output=True)


def _alive(pid: int) -> bool:
    return Path(f"/proc/{pid}").exists()


def _ethtool(link: VethLink, dev: str, *features: str) -> None:
    if shutil.which("ethtool") is not None:
        argv = ["ethtool", "-K", dev, *features]
        run_command(*(link.exec_argv(argv) if dev == link.ns_if else argv))


def run_command(*argv: str, stdin: str | None = None) -> None:
    result = subprocess.run(argv, capture_output=True, text=True, input=stdin)
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)}: {result.stderr.strip()}")
