"""Shared helpers of the benchmarks: free ports, iperf3, CPU times, medians, the verdict line."""
from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
for _path in (ROOT, ROOT / "tests"):  # the project, and tests/support (the netns link)
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

from support.interrupt import stop_on_signals  # noqa: E402
from support.netns import VethLink, available, veth_link  # noqa: E402
from support.ports import free_port, free_ports  # noqa: E402,F401  (re-exported for the benches)
from support.wan import wan_path  # noqa: E402

# Every benchmark imports this module: SIGTERM (a timeout, an operator) unwinds like Ctrl-C, so the
# benchmark's `finally` blocks stop its services, delay lines and namespaces before it exits.
stop_on_signals()


def results_dir(name: str) -> Path:
    """``bench/results/<name>-<local time>``, where a benchmark writes what it keeps (git ignores it)."""
    return ROOT / "bench" / "results" / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}"


def require(tool: str, package: str) -> str:
    path = shutil.which(tool)
    if path is None:
        sys.exit(f"{tool} is not installed (Debian package `{package}`; scripts/bootstrap.sh installs it)")
    return path


def pinned(cpu: int | str | None) -> list[str]:
    """argv prefix running a command on one CPU, or on a list of them such as "2,3" (none when None)."""
    return [] if cpu is None else ["taskset", "-c", str(cpu)]


@dataclass(frozen=True)
class Iperf3Result:
    gbps: float          # receiver-side goodput
    client_cpu_s: float  # CPU time of the sending end over the test
    server_cpu_s: float  # CPU time of the receiving end
    client_sys_s: float = 0.0  # of which in the kernel
    server_sys_s: float = 0.0
    num_bytes: int = 0   # received


def iperf3_run(host: str, streams: int, num_bytes: int, netns: str | None = None, bind: str | None = None,
               seconds: float | None = None, attempts: int = 5, server_cpu: int | str | None = None,
               client_cpu: int | str | None = None, omit_s: float = 0, window: str = "") -> Iperf3Result:
    """One iperf3 run with ``streams`` parallel TCP streams (a run that iperf3 itself reports as
    failed is repeated with a fresh server); ``omit_s`` seconds of slow start before ``seconds``
    count toward nothing."""
    require("iperf3", "iperf3")
    wrap = ["ip", "netns", "exec", netns] if netns else []
    wrap += pinned(server_cpu)
    amount = ["-t", str(seconds)] if seconds else ["-n", str(num_bytes)]
    amount += ["-O", str(omit_s)] if omit_s else []
    amount += ["-w", window] if window else []
    error = ""
    for _ in range(attempts):
        port = free_port()
        server = subprocess.Popen(wrap + ["iperf3", "-s", "-1", "-p", str(port)] + (["-B", bind] if bind else []),
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            for _ in range(50):  # until the server listens
                command = ["iperf3", "-c", host, "-p", str(port), "-P", str(streams), "-J"] + amount
                result = subprocess.run(pinned(client_cpu) + command,
                                        capture_output=True, text=True)
                if "unable to connect" not in result.stdout + result.stderr:
                    break
                time.sleep(0.1)
            try:
                end = json.loads(result.stdout)["end"]
                cpu, seconds_run = end["cpu_utilization_percent"], end["sum_received"]["seconds"]
                return Iperf3Result(end["sum_received"]["bits_per_second"] / 1e9,
                                    cpu["host_total"] / 100 * seconds_run, cpu["remote_total"] / 100 * seconds_run,
                                    cpu["host_system"] / 100 * seconds_run, cpu["remote_system"] / 100 * seconds_run,
                                    int(end["sum_received"]["bytes"]))
            except (ValueError, KeyError):
                error = (result.stdout[-300:] + result.stderr[-300:]).strip()
        finally:
            server.kill()
            server.wait()
    raise RuntimeError(f"iperf3 failed {attempts} times; last output: {error}")


def process_cpu_s(pid: int) -> float:
    """User plus system CPU time of a process so far (all its threads)."""
    return sum(process_user_sys_s(pid))


def process_user_sys_s(pid: int) -> tuple[float, float]:
    """(user, system) CPU seconds of a process so far (all its threads)."""
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return int(fields[11]) / os.sysconf("SC_CLK_TCK"), int(fields[12]) / os.sysconf("SC_CLK_TCK")


def median(values) -> float:
    return statistics.median(values)


def verdict(name: str, ratio: float, target: float, detail: str, higher_is_better: bool = True,
            baseline: str = "") -> int:
    """The headline, printed last: ``<name>: <figure> (<detail>)[; baseline <baseline>]; target <op>
    <target>: PASS|FAIL`` (bench/_headlines.py reads it back); the exit status, 0 when it passed."""
    ok = ratio >= target if higher_is_better else ratio <= target
    sign = ">=" if higher_is_better else "<="
    against = f"; baseline {baseline}" if baseline else ""
    print(f"{name}: {ratio:.3f} ({detail}){against}; target {sign} {target}: {'PASS' if ok else 'FAIL'}")
    return 0 if ok else 1


RECEIVER_SCRIPT = """
import sys, time
sys.path.insert(0, {root!r})
from services.kv_transport import Frame, KVTransport, TransportSettings
rx = KVTransport(TransportSettings(secret={secret!r}, connections_per_peer={connections}, **{extra!r}),
                 listen_host={host!r}, listen_port={port})
print("ready", rx.port, flush=True)
while True:
    for event in rx.poll(1.0):
        if not isinstance(event, Frame):
            print(type(event).__name__, event.transfer_id, time.time(), flush=True)
"""


def start_receiver(secret: str, host: str = "127.0.0.1", port: int = 0, connections: int = 8,
                   netns: str | None = None, cpu: int | str | None = None,
                   **settings: object) -> tuple[subprocess.Popen, int]:
    """A KV receiver in its own process (optionally inside ``netns``, on ``cpu``), with more
    ``TransportSettings`` than the defaults where given; returns it and its port. It prints one line
    per finished transfer: kind, transfer id, completion time (epoch seconds)."""
    code = RECEIVER_SCRIPT.format(root=str(ROOT), secret=secret, connections=connections, host=host, port=port,
                                  extra=settings)
    wrap = (["ip", "netns", "exec", netns] if netns else []) + pinned(cpu)
    process = subprocess.Popen(wrap + [sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    ready, bound = process.stdout.readline().split()
    return process, int(bound)


def send_transfer(receiver: subprocess.Popen, tx, peer: str, transfer_id: str, num_layers: int,
                  layer_bytes: int, divisible: bool = True) -> float:
    """Seconds from the first send of ``num_layers`` layers of ``layer_bytes`` (zeros, 64 blocks each)
    through ``tx`` (a ``KVTransport``) until ``receiver`` completed the transfer; ``divisible``: the
    transport may cut its frames between blocks (``KVTransport.send``)."""
    payload = memoryview(bytes(layer_bytes))
    start = time.time()
    for layer in range(num_layers):
        tx.send(peer, transfer_id, layer, 0, 0, 64, payload, divisible=divisible)
    tx.finish(peer, transfer_id)
    return wait_transfer(receiver, transfer_id) - start


def wait_transfer(receiver: subprocess.Popen, transfer_id: str) -> float:
    """When ``transfer_id`` completed at the receiver; raises if it failed."""
    while True:
        line = receiver.stdout.readline()
        if not line:
            raise RuntimeError("the receiver exited")
        kind, tid, at = line.split()
        if tid == transfer_id:
            if kind != "TransferDone":
                raise RuntimeError(f"transfer {tid} failed at the receiver")
            return float(at)


@contextmanager
def wan_link(rate_mbit: int, loss_percent: float = 0, buffer_ms: int = 20, rtt_ms: float = 0) -> Iterator[VethLink]:
    """A path into a namespace made here; traffic host → namespace crosses the cap (and the loss).
    ``rtt_ms`` 0: a veth pair (a round trip of tens of microseconds); otherwise a delay line between
    two TUN devices adds that round trip (``tests/support/wan.py``)."""
    if (reason := available()) is not None:
        raise SystemExit(f"this benchmark {reason}")
    if rtt_ms > 0:
        with wan_path(rate_mbit, rtt_ms, loss_percent, buffer_ms) as link:
            yield link
        return
    with veth_link(rate_mbit=rate_mbit, side="host", buffer_ms=buffer_ms) as link:
        if loss_percent:
            link.drop_percent(int(loss_percent))
        yield link


def add_link_arguments(parser) -> None:
    """The emulated WAN path's options (``wan_link``), shared by the benchmarks that use it."""
    parser.add_argument("--rate-mbit", type=int, default=1000, help="link cap in Mbit/s (default 1000)")
    parser.add_argument("--loss", type=float, default=1, help="random packet loss in percent (default 1)")
    parser.add_argument("--rtt-ms", type=float, default=20, help="round trip added by the link in ms; 0: a plain "
                        "veth pair, tens of microseconds (default 20)")
