"""The ports the e2e tests write into config files before their services start."""
from support.ports import free_port, free_ports


def test_free_port_never_hands_out_a_port_twice():
    # The kernel returns a port it just gave often enough (about one repeat in 50 draws here) that
    # two workers of one config once got the same port.
    ports = [free_port() for _ in range(500)]
    assert len(set(ports)) == len(ports)


def test_free_ports_does_not_overlap_single_ports():
    singles = {free_port() for _ in range(200)}
    first = free_ports(4)
    assert singles.isdisjoint(range(first, first + 4))
    assert free_port() not in range(first, first + 4)


def test_ports_come_from_below_the_ephemeral_range():
    # A vLLM engine starting beside a deployment binds port 0 for its handshake and its torch store:
    # a port from the ephemeral range written into a config could be taken before the service binds it.
    with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
        first_ephemeral = int(f.read().split()[0])
    ports = [free_port() for _ in range(50)] + [free_ports(2)]
    assert all(10000 <= port < first_ephemeral for port in ports)
