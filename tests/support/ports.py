"""Ports for tests.

A server a test starts in its own process binds port 0 and reports the port it got (``server.port``,
``KVTransport.port``); nothing here is needed for it. ``free_port`` is only for deployments of
separate processes whose ports must be written into a config file before they start: it is racy
(another process may take the port between this check and the service's bind), which those tests accept.
Within one process it never hands out the same port twice: the kernel may return a port it just gave,
and two services of one config file must not be written the same port.

The ports come from below the kernel's ephemeral range (``net.ipv4.ip_local_port_range``). A port
there is never what the kernel picks for a ``bind(port 0)`` or for the local end of an outgoing
connection, so a vLLM engine starting meanwhile (its handshake, its torch.distributed store, the
reference engine a test runs beside its deployment) cannot take a port written into a config file
between the check and the service's bind. Only another process choosing ports by hand could.
"""
import contextlib
import random
import socket
from collections.abc import Iterator
from contextlib import contextmanager


_handed_out: set[int] = set()
_random = random.Random()  # its own: a test that seeds the module's generator must not fix the ports


def _hand_range() -> range:
    """Ports to hand out: from 10000 up to the first ephemeral port (32768 by default)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            first_ephemeral = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        first_ephemeral = 32768
    return range(10000, max(first_ephemeral, 10001 + 1000))


def _bindable(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port() -> int:
    """A port nothing listened on a moment ago, below the ephemeral range, and not returned before by
    this process, for a config file written before its services start."""
    candidates = _hand_range()
    for _ in range(1000):
        port = _random.choice(candidates)
        if port not in _handed_out and _bindable(port):
            _handed_out.add(port)
            return port
    raise RuntimeError("no free port left that this process has not handed out already")


def free_ports(count: int) -> int:
    """The first of ``count`` consecutive ports nothing listened on a moment ago (an engine of
    ``count`` TP ranks receives KV at ``kv_port + rank``)."""
    for _ in range(100):
        first = free_port()
        if first + count - 1 > 65535 or _handed_out.intersection(range(first + 1, first + count)):
            continue
        try:
            with contextlib.ExitStack() as stack:
                for port in range(first + 1, first + count):
                    sock = stack.enter_context(socket.socket())
                    sock.bind(("127.0.0.1", port))
            _handed_out.update(range(first + 1, first + count))
            return first
        except OSError:
            continue
    raise RuntimeError(f"no {count} consecutive free ports found")


@contextmanager
def refused_address() -> Iterator[str]:
    """``127.0.0.1:port`` where a connection is refused: the port is bound, never listened on, and held
    until the block ends, so no other process can take it meanwhile."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        yield f"127.0.0.1:{sock.getsockname()[1]}"
