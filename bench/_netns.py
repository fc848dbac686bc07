"""A WAN-like link made by the benchmark itself: a veth pair into a private network namespace,
capped with ``tbf`` and, optionally, dropping packets at random with nftables. Needs root."""
from __future__ import annotations

import os
import subprocess
from contextlib import contextmanager

HOST_ADDR, NS_ADDR = "10.213.77.1", "10.213.77.2"


def _run(*argv: str, stdin: str | None = None) -> None:
    result = subprocess.run(argv, capture_output=True, text=True, input=stdin)
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)}: {result.stderr.strip()}")


@contextmanager
def wan_link(rate_mbit: int, loss_percent: int = 0, buffer_ms: int = 20):
    """Yields the namespace name; traffic host → namespace crosses the cap (and the loss)."""
    if os.geteuid() != 0:
        raise SystemExit("this benchmark needs root (network namespaces, tc, nftables)")
    tag = f"pfw{os.getpid() % 100000}"
    ns, host_if, ns_if = f"{tag}ns", f"{tag}a", f"{tag}b"
    _run("ip", "netns", "add", ns)
    try:
        _run("ip", "link", "add", host_if, "type", "veth", "peer", "name", ns_if)
        _run("ip", "link", "set", ns_if, "netns", ns)
        _run("ip", "addr", "add", f"{HOST_ADDR}/30", "dev", host_if)
        _run("ip", "link", "set", host_if, "up")
        for argv in (("ip", "addr", "add", f"{NS_ADDR}/30", "dev", ns_if), ("ip", "link", "set", ns_if, "up"),
                     ("ip", "link", "set", "lo", "up")):
            _run("ip", "netns", "exec", ns, *argv)
        set_rate(ns, rate_mbit, buffer_ms, action="add")
        _run("ethtool", "-K", host_if, "tso", "off", "gso", "off") if _has("ethtool") else None
        if loss_percent:
            rules = (f"table inet {tag} {{\n chain input {{\n  type filter hook input priority 0; policy accept;\n"
                     f"  ip saddr {HOST_ADDR} numgen random mod 100 < {loss_percent} drop\n }}\n}}\n")
            _run("ip", "netns", "exec", ns, "nft", "-f", "-", stdin=rules)
        yield ns
    finally:
        subprocess.run(["ip", "link", "del", host_if], capture_output=True)
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def set_rate(ns: str, rate_mbit: int, buffer_ms: int = 20, action: str = "change") -> None:
    """(Re)cap the link into namespace ``ns`` made by ``wan_link``."""
    burst = max(rate_mbit * 125, 131072)  # bytes: 1 ms at the cap, and room for a 64 KiB GSO packet
    limit = rate_mbit * 1000 // 8 * buffer_ms        # bytes: the bottleneck queue
    _run("tc", "qdisc", action, "dev", _host_if(ns), "root", "tbf", "rate", f"{rate_mbit}mbit",
         "burst", str(burst), "limit", str(limit))


def _host_if(ns: str) -> str:
    return ns.removesuffix("ns") + "a"


def _has(tool: str) -> bool:
    from shutil import which

    return which(tool) is not None
