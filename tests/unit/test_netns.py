"""The links that tests and benchmarks make: those left behind by a killed run are removed before a
new one takes the subnet (their route would carry its traffic nowhere), and a subnet that a running
owner holds is refused with its interface named."""
from __future__ import annotations

import subprocess

import pytest

from support.netns import available, veth_link

pytestmark = pytest.mark.skipif(available() is not None, reason=str(available()))
SUBNET = "10.213.81"


def _dead_pid() -> int:
    process = subprocess.Popen(["true"])
    process.wait()
    return process.pid


def _names(*argv: str) -> str:
    return subprocess.run(argv, capture_output=True, text=True, check=True).stdout


def test_a_killed_runs_link_is_removed_and_its_subnet_reused():
    tag = f"pf{_dead_pid()}x0"
    stale = [["ip", "netns", "add", f"{tag}ns"],
             ["ip", "link", "add", f"{tag}a", "type", "veth", "peer", "name", f"{tag}b"],
             ["ip", "link", "set", f"{tag}b", "netns", f"{tag}ns"],
             ["ip", "addr", "add", f"{SUBNET}.1/30", "dev", f"{tag}a"],
             ["ip", "link", "set", f"{tag}a", "up"]]
    try:
        for argv in stale:
            subprocess.run(argv, check=True, capture_output=True)
        with veth_link(SUBNET) as link:
            assert f"{tag}a" not in _names("ip", "-o", "link", "show")
            assert f"{tag}ns" not in _names("ip", "netns", "list")
            assert f"dev {link.host_if} " in _names("ip", "route", "get", link.ns_addr)
    finally:
        subprocess.run(["ip", "link", "del", f"{tag}a"], capture_output=True)
        subprocess.run(["ip", "netns", "del", f"{tag}ns"], capture_output=True)


def test_a_subnet_held_by_a_running_owner_is_refused():
    with veth_link(SUBNET) as link:
        with pytest.raises(RuntimeError, match=f"{SUBNET}.1 is already on interface {link.host_if}"):
            with veth_link(SUBNET):
                pass
        assert link.ns in _names("ip", "netns", "list")
    assert link.ns not in _names("ip", "netns", "list")
