"""The connector's worker core on the device, driven through the calls vLLM makes, in Model Runner V2's
order: what streaming costs the forward, how fast KV moves device-to-host and host-to-device against a
pinned copy, and whether every byte arrives, for every path the engine runs.

Each engine rank is a ``PrfaasConnectorWorker`` (the core ``connector.PrfaasConnector`` translates
vLLM's hooks into) over FlashAttention-shaped caches: one buffer, a logical [blocks, heads, tokens,
K|V] view per layer as vLLM 0.32 registers them, token-major (LBNHC, FlashAttention's own) or
head-major (LBHNC). Where an engine has several TP ranks (TP 1 -> 2 and 2 -> 1), every rank of both
engines is a process of its own on the one device (``gpu_kv_ranks``: 'spawn'), with its own CUDA
context, core, transport, rings and port, as vLLM's TP workers are; at TP 1 -> 1 the two ranks are
threads of this process. A prefill step, per producer rank: ``on_metadata`` (``bind_connector_metadata``),
then a forward on the default stream (three bf16 matmuls per layer, sized like an 8B model's MLP)
with ``save_kv_layer`` after each layer, then ``wait_for_save`` and ``get_transfer_results`` at the
end of the step (``post_forward``). A consumer rank runs idle steps, ``on_metadata`` (where
``start_load_kv`` runs: a no-op in this connector, loads are applied in ``get_transfer_results``) and
``get_transfer_results``, until its request is reported. Settings are the deployed ones: host rings
of the device's default sizes (``host_ring_bytes`` unset: a 1 GiB saver ring on CUDA, 256 MiB
otherwise), frames of the size the consumer announces (``transport.frame_bytes`` unset: 8 MiB on CUDA,
512 KiB otherwise), 8 connections per peer, over loopback.

Cases: TP 1 -> 1 for each layout, TP 1 -> 2 and 2 -> 1 (head slices), fp8 and int8 on the wire (the
reference is the codec applied to the sent blocks), the cache pool's store (a forward that stores its
blocks, through the pool's shared-memory arena) and load (into another engine). Per case:

- the forward alone and with the connector on, until the compute stream is done: slowdown, target
  <= 1.03x at equal TP and while storing, <= 1.05x across TP sizes;
- the core's device path alone, with the transport replaced by recorded frames (no TCP): the
  producer's device-to-host rate (every save until delivered, the frames kept) and the consumer's
  host-to-device rate (the producers' frames read into its receive memory first, then every frame
  until its copies completed), each against a pinned copy of the same bytes: target >= 0.8x;
- the consumer's blocks against the reference, byte for byte; ring waits.

One line per case, then a headline. ``--device cpu`` runs the same code on CPU tensors (streams and
events are stand-ins) with small shapes; only the bytes decide its exit status.

    python bench/gpu_kv_path.py [--device cuda|cpu] [--tokens 8192] [--layers 32] [--rounds 3]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import _common  # noqa: F401  (puts the project on sys.path)
import torch

from gpu_kv_engine import BLOCK_TOKENS, Rank, RecordedWire, Shape, request_ids, settings_for, step_time, sync
from gpu_kv_ranks import CONSUMERS, EVERYONE, PRODUCERS, RankProcesses, Ranks, RankSpec
from services.cache_pool.pool import CachePool
from services.cache_pool.server import PoolIdentity, start_pool_server
from services.cache_pool.slots import Arena
from services.cache_pool_client.hashing import prompt_block_hashes
from services.cache_pool_client.types import GroupKind, KvCacheGroup
from services.kv_connector.metadata import PoolLoadSpec, PoolStoreSpec, PrfaasConnectorMetadata
from services.kv_connector.pool.io import PoolIO, PoolModel
from services.kv_connector.pool.worker import PoolWorker

TARGET_SAME_TP, TARGET_OTHER_TP, TARGET_COPY = 1.03, 1.05, 0.8
CASES = {  # name: (producer TP, consumer TP, layout, codec, pool)
    "tp1-1 LBNHC": (1, 1, "LBNHC", "none", False), "tp1-1 LBHNC": (1, 1, "LBHNC", "none", False),
    "tp1-2": (1, 2, "LBNHC", "none", False), "tp2-1": (2, 1, "LBNHC", "none", False),
    "tp1-1 fp8": (1, 1, "LBNHC", "fp8", False), "tp1-1 int8": (1, 1, "LBNHC", "int8", False),
    "pool": (1, 1, "LBNHC", "none", True),
}


@dataclass(frozen=True)
class Result:
    case: str
    forward_s: float
    connected_s: float
    d2h_ratio: float
    h2d_ratio: float
    ring_waits: int
    bytes_match: bool
    target: float

    @property
    def slowdown(self) -> float:
        return self.connected_s / self.forward_s


def transfer_case(name: str, shape: Shape, device: torch.device, rounds: int, ring_bytes: int | None, port: int,
                  out_dir: str, processes: RankProcesses | None) -> Result:
    src_tp, dst_tp, order, codec, _ = CASES[name]
    specs = [RankSpec(shape, order, codec, src_tp, r, True, dst_tp, str(device), port, ring_bytes, out_dir)
             for r in range(src_tp)] + [RankSpec(shape, order, codec, dst_tp, r, False, src_tp, str(device), port,
                                                 ring_bytes, out_dir) for r in range(dst_tp)]
    with Ranks(specs, processes) as ranks:
        # a step lasts as long as its slowest rank: the all-reduce couples them
        forward_s = statistics.median([max(ranks.call(PRODUCERS, "forward")) for _ in range(rounds + 1)][1:])
        expected = joined(ranks.call(PRODUCERS, "blocks", name="reference"))
        connected, matches = [], True
        for round_id in range(rounds + 1):  # the first opens the connections, unmeasured
            steps = [s for s in ranks.call(EVERYONE, "step", req=f"{name}-{round_id}") if s is not None]
            connected += [max(steps)] if round_id else []
            matches &= torch.equal(joined(ranks.call(CONSUMERS, "blocks", name=f"round-{round_id}")), expected)
        waits = sum(ranks.call(PRODUCERS, "ring_waits"))
        ranks.call(EVERYONE, "start_rates")
        saves, writes = [], []
        for round_id in range(rounds + 1):
            req = f"rate-{round_id}"
            saves.append(max(ranks.call(PRODUCERS, "save_round", req=req, keep=round_id == 0)))
            writes.append(max(ranks.call(CONSUMERS, "write_round", req=req, recorded_id="rate-0")))
    kv_bytes = shape.kv_bytes()
    d2h_base, h2d_base = pinned_rates(device, kv_bytes, rounds)
    return Result(name, forward_s, statistics.median(connected), kv_bytes / statistics.median(saves[1:]) / d2h_base,
                  kv_bytes / statistics.median(writes[1:]) / h2d_base, waits, matches,
                  TARGET_SAME_TP if src_tp == dst_tp else TARGET_OTHER_TP)


def joined(paths: list[str]) -> torch.Tensor:
    """The ranks' [layers, blocks, heads, tokens, K|V] files, their heads side by side."""
    return torch.cat([torch.load(path) for path in paths], dim=2)


def pinned_rates(device: torch.device, num_bytes: int, rounds: int) -> tuple[float, float]:
    """Bytes per second of one device-to-host and one host-to-device copy through pinned memory."""
    on_device = torch.ones(num_bytes, dtype=torch.uint8, device=device)
    host = torch.ones(num_bytes, dtype=torch.uint8, pin_memory=device.type == "cuda")
    rates = []
    for target, source in ((host, on_device), (on_device, host)):
        times = []
        for _ in range(rounds + 1):
            sync(device)
            start = time.perf_counter()
            target.copy_(source, non_blocking=True)
            sync(device)
            times.append(time.perf_counter() - start)
        rates.append(num_bytes / statistics.median(times[1:]))
    return rates[0], rates[1]


def pool_case(shape: Shape, device: torch.device, rounds: int, ring_bytes: int) -> Result:
    """A forward that stores its blocks in a cache pool on this host (its arena mapped and pinned),
    then a second engine that loads them; the store's and the load's rates against pinned copies."""
    kv_bytes = shape.kv_bytes()
    with tempfile.TemporaryDirectory(dir="/dev/shm") as directory:
        arena = Arena.create(directory, "bench-pool", 2 * kv_bytes * (rounds + 2) + (64 << 20))
        server = start_pool_server(CachePool(2 * kv_bytes * (rounds + 2) + (64 << 20), arena=arena),
                                   PoolIdentity("bench-pool", "local"), "127.0.0.1", 0)
        io = PoolIO(f"127.0.0.1:{server.port}", lookup_timeout_s=5.0)
        model = PoolModel("bench/1", BLOCK_TOKENS, (KvCacheGroup(0, GroupKind.FULL_ATTENTION),))
        settings = settings_for("none", None, ring_bytes)
        source = Rank(shape, "LBNHC", 1, 0, True, device, settings, PoolWorker(io, model),
                      partial(RecordedWire, "none", ""))
        target = Rank(shape, "LBNHC", 1, 0, False, device, settings, PoolWorker(io, model),
                      partial(RecordedWire, "none", ""))
        ids, _ = request_ids(shape)
        try:
            forward_s = statistics.median([forward_time(source, device) for _ in range(rounds + 1)][1:])
            stored, loaded, storing, matches = [], [], [], True
            for round_id in range(rounds + 1):
                tokens = [round_id * 100_000 + i for i in range(shape.tokens)]
                hashes = tuple(prompt_block_hashes(tokens, BLOCK_TOKENS))
                store = PoolStoreSpec(f"s{round_id}", (tuple(ids),), tuple(enumerate(hashes)), None, shape.tokens)
                start = time.perf_counter()
                meta = PrfaasConnectorMetadata(pool_stores=[store])
                sync(device)
                storing.append(step_time(source, meta, device))
                stored_tokens = (round_id + 1) * len(hashes) * BLOCK_TOKENS
                wait_until(lambda tokens=stored_tokens: source.core.pool.num_tokens_stored >= tokens)
                stored.append(time.perf_counter() - start)
                start = time.perf_counter()
                target.receive(PrfaasConnectorMetadata(pool_loads=[PoolLoadSpec(f"l{round_id}", (tuple(ids),),
                                                                                 hashes, 0)]), f"l{round_id}")
                loaded.append(time.perf_counter() - start)
                matches &= torch.equal(target.blocks(ids), source.blocks(ids))
        finally:
            source.core.shutdown()
            target.core.shutdown()
            io.close()
            server.stop(0)
    d2h_base, h2d_base = pinned_rates(device, kv_bytes, rounds)
    return Result("pool", forward_s, statistics.median(storing[1:]), kv_bytes / statistics.median(stored[1:]) /
                  d2h_base, kv_bytes / statistics.median(loaded[1:]) / h2d_base, 0, matches, TARGET_SAME_TP)


def forward_time(rank: Rank, device: torch.device) -> float:
    sync(device)
    return step_time(rank, None, device, connected=False)


def wait_until(condition, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError("the pool's Put did not end")
        time.sleep(0.001)


def free_ports(count: int) -> int:
    """A port with the ``count - 1`` after it free too (a consumer's rank r listens at port + r)."""
    import socket

    for _ in range(100):
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            base = probe.getsockname()[1]
        try:
            for offset in range(count):
                with socket.socket() as other:
                    other.bind(("127.0.0.1", base + offset))
            return base
        except OSError:
            continue
    raise RuntimeError("no run of free ports")


def report(results: list[Result], device: torch.device, shape: Shape) -> int:
    print(f"{shape.layers} layers, {shape.heads} KV heads of {shape.head_size}, bf16, {shape.tokens} tokens (blocks "
          f"of {BLOCK_TOKENS}), {shape.kv_bytes() / 2**20:.1f} MiB of KV; MLP {shape.hidden} -> {shape.ffn}; "
          f"device {torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'}")
    print(f"{'case':12} {'forward':>9} {'connected':>10} {'slowdown':>9} {'target':>7} {'D2H/pinned':>11} "
          f"{'H2D/pinned':>11} {'waits':>6} bytes")
    for r in results:
        print(f"{r.case:12} {r.forward_s * 1e3:7.1f}ms {r.connected_s * 1e3:8.1f}ms {r.slowdown:8.3f}x "
              f"{r.target:6.2f}x {r.d2h_ratio:11.2f} {r.h2d_ratio:11.2f} {r.ring_waits:6d} "
              f"{'match' if r.bytes_match else 'DIFFER'}")
    matches = all(r.bytes_match for r in results)
    held = all(r.slowdown <= r.target and min(r.d2h_ratio, r.h2d_ratio) >= TARGET_COPY for r in results)
    worst = max(results, key=lambda r: r.slowdown / r.target)
    figures = (f"worst slowdown {worst.slowdown:.3f}x ({worst.case}, target <= {worst.target}), D2H "
               f"{min(r.d2h_ratio for r in results):.2f}x and H2D {min(r.h2d_ratio for r in results):.2f}x of pinned "
               f"at worst (target >= {TARGET_COPY}), bytes {'match' if matches else 'DIFFER'} in every case")
    if device.type != "cuda":
        print(f"gpu_kv_path (cpu): {figures}; on CPU only the bytes decide: {'PASS' if matches else 'FAIL'}")
        return 0 if matches else 1
    print(f"gpu_kv_path (cuda): {figures}: {'PASS' if held and matches else 'FAIL'}")
    return 0 if held and matches else 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                        help="cuda (default): exit 0 only when every target holds and every byte matches; cpu: the "
                             "same code on CPU tensors, small; exit 0 when every byte matches")
    parser.add_argument("--tokens", type=int, help="prefill length (default 8192 on cuda, 256 on cpu)")
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--head-size", type=int, default=128)
    parser.add_argument("--hidden", type=int, help="MLP width (default 4096 on cuda, 128 on cpu)")
    parser.add_argument("--ffn", type=int, help="MLP inner width (default 14336 on cuda, 256 on cpu)")
    parser.add_argument("--cases", default=",".join(CASES), help=f"of: {', '.join(CASES)}")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--ring-bytes", type=int, help="host_ring_bytes (default: unset, the device's defaults, "
                        "docs/gpu.md)")
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("no CUDA device: run with --device cpu")
    cpu = args.device == "cpu"
    shape = Shape(args.tokens or (256 if cpu else 8192), args.layers, args.heads, args.head_size,
                  args.hidden or (128 if cpu else 4096), args.ffn or (256 if cpu else 14336))
    device = torch.device(args.device)
    if not cpu:
        torch.cuda.set_device(device)
    names = args.cases.split(",")
    # started first, so that their Python and torch start while the cases on threads run
    size = max((src + dst for src, dst, *_ in (CASES[name] for name in names) if max(src, dst) > 1), default=0)
    processes = RankProcesses(size) if size else None
    results = []
    try:
        with tempfile.TemporaryDirectory(dir="/dev/shm" if Path("/dev/shm").is_dir() else None) as out_dir:
            for name in names:
                if CASES[name][4]:
                    results.append(pool_case(shape, device, args.rounds, args.ring_bytes))
                else:
                    results.append(transfer_case(name, shape, device, args.rounds, args.ring_bytes,
                                                 free_ports(CASES[name][1]), out_dir, processes))
    finally:
        if processes is not None:
            processes.close()
    return report(results, device, shape)


if __name__ == "__main__":
    sys.exit(main())
