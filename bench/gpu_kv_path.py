"""The connector's device data path behind a simulated prefill: what layer-wise streaming costs the
forward, and how fast KV moves device-to-host and host-to-device against plain pinned copies.

KV caches are device tensors laid out as vLLM 0.32 registers them (one buffer, a strided
[blocks, heads, tokens, K|V] view per layer, token-major LBNHC and head-major LBHNC). Each layer of
a simulated forward runs three bf16 matmuls sized like an 8B model's MLP (tokens x 4096 @ 4096 x
14336 and back); after each, the real producer half (``device.producer.LayerSaver``) queues that
layer's blocks, and a sender thread hands them to a real ``KVTransport`` on 127.0.0.1; on a thread
of its own the real consumer half (``device.consumer.BlockLoader``) writes received frames into a
second cache with other block ids. Measured, per layout:

- the forward alone and with streaming on (median of ``--rounds``; with streaming, until the compute
  stream is done, which waits for the copies' gathers): slowdown target <= 1.03x;
- the producer alone (every layer saved back to back into the ring, slots given back at once)
  against one pinned device-to-host copy of the same bytes: target >= 0.8x;
- the consumer alone (every layer's received bytes written into the cache) against one pinned
  host-to-device copy of the same bytes: target >= 0.8x;
- every layer's blocks, received cache against sent, byte for byte, after every streamed round.

The producer's ring holds a whole prefill's KV here, so that loopback TCP (slower than the forward
makes KV) does not make steps wait; ``ring waits`` counts the waits anyway. The transport sends
frames of ``--frame-bytes`` (8 MiB: see ``FRAME_BYTES``), received straight into a pinned ring.

``--device cpu`` runs the same code on CPU tensors (streams and events are stand-ins, the copies
run on the calling thread) with smaller matmuls (``--hidden``, ``--ffn``, ``--tokens`` scale them),
and compares against copies between pre-allocated, already touched buffers. It checks that the
code path runs and that every byte arrives; its ratios are printed, but only matching bytes decide
its exit status. With ``--device cuda`` (the default) every target must hold.

    python bench/gpu_kv_path.py [--device cuda|cpu] [--tokens 8192] [--layers 32] [--rounds 3]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from dataclasses import dataclass

import _common  # noqa: F401  (puts the project on sys.path)
import torch

from services.kv_connector.device.consumer import BlockLoader
from services.kv_connector.device.producer import LayerSaver
from services.kv_connector.device.ring import HostRing
from services.kv_connector.device.streams import Device
from services.kv_connector.layouts.physical import detect
from services.kv_transport import Frame, KVTransport, TransferDone, TransferFailed, TransportSettings

BLOCK_TOKENS = 16
SLOT_BYTES = 16 << 20
# Every received frame costs the consumer host time: on an H100 host, frames of
# transport.max_frame_bytes (8 MiB) came in at 40-47 GB/s, the transport's default 512 KiB at 9-19.
FRAME_BYTES = 8 << 20
SECRET = "bench-secret"
TARGET_SLOWDOWN, TARGET_COPY = 1.03, 0.8


@dataclass(frozen=True)
class Shape:
    tokens: int
    layers: int
    heads: int
    head_size: int
    hidden: int
    ffn: int

    @property
    def num_blocks(self) -> int:
        return -(-self.tokens // BLOCK_TOKENS)

    @property
    def layer_bytes(self) -> int:
        return self.num_blocks * self.heads * BLOCK_TOKENS * 2 * self.head_size * 2  # bf16


@dataclass(frozen=True)
class Result:
    layout: str
    forward_s: float
    streaming_s: float
    d2h_gbps: float
    d2h_base_gbps: float
    h2d_gbps: float
    h2d_base_gbps: float
    ring_waits: int
    bytes_match: bool

    @property
    def slowdown(self) -> float:
        return self.streaming_s / self.forward_s


def caches(order: str, num_blocks: int, shape: Shape, device: torch.device, random: bool) -> list[torch.Tensor]:
    """One buffer in ``order`` (a permutation of LBHNC), a logical [B, H, N, C] view per layer."""
    sizes = {"L": shape.layers, "B": num_blocks, "H": shape.heads, "N": BLOCK_TOKENS, "C": 2 * shape.head_size}
    strides, numel = {}, 1
    for dim in reversed(order):
        strides[dim], numel = numel, numel * sizes[dim]
    buffer = (torch.randn(numel, device=device) if random else torch.zeros(numel, device=device)).to(torch.bfloat16)
    view_shape = tuple(sizes[d] for d in "BHNC")
    return [torch.as_strided(buffer, view_shape, tuple(strides[d] for d in "BHNC"), layer * strides["L"])
            for layer in range(shape.layers)]


class Forward:
    """Three matmuls per layer, sized like an MLP of ``hidden`` -> ``ffn`` over ``tokens`` tokens."""

    def __init__(self, shape: Shape, device: torch.device) -> None:
        def make(*size):
            return torch.randn(*size, device=device).to(torch.bfloat16) / size[-1] ** 0.5
        self.x, self.up, self.gate, self.down = (make(shape.tokens, shape.hidden), make(shape.hidden, shape.ffn),
                                                 make(shape.hidden, shape.ffn), make(shape.ffn, shape.hidden))
        self.h1, self.h3 = make(shape.tokens, shape.ffn), make(shape.tokens, shape.ffn)
        self.y = make(shape.tokens, shape.hidden)

    def layer(self) -> None:
        torch.matmul(self.x, self.up, out=self.h1)
        torch.matmul(self.x, self.gate, out=self.h3)
        torch.matmul(self.h1, self.down, out=self.y)


class Receiving:
    """The consumer side: a thread takes frames from the transport and writes them with the block
    loader; a transfer is in once its end arrived and its copies completed."""

    def __init__(self, device: Device, target: list[torch.Tensor], ids: list[int], receive_bytes: int,
                 frame_bytes: int) -> None:
        settings = transport_settings(frame_bytes)
        self.transport = KVTransport(settings, listen_port=0)
        receive_ring = HostRing(device, settings.frame_bytes, receive_bytes // settings.frame_bytes + 2) \
            if device.is_cuda else None
        self.loader = BlockLoader(device, HostRing(device, SLOT_BYTES, 2), receive_ring)
        if receive_ring is not None:
            self.transport.receive_into(self.loader.allocate)
        self.target, self.ids = target, ids
        self.ended: dict[str, threading.Event] = {}
        self.failures: list[str] = []
        self._ending: set[str] = set()
        self._stop = threading.Event()
        self._stopped = False
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def expect(self, transfer_id: str) -> threading.Event:
        return self.ended.setdefault(transfer_id, threading.Event())

    def _loop(self) -> None:
        while not self._stop.is_set():
            for event in self.transport.poll(0.002):
                self._on(event)
            for transfer_id in self.loader.poll() | set(self._ending):
                if transfer_id in self._ending and not self.loader.busy(transfer_id):
                    self._ending.discard(transfer_id)
                    self.expect(transfer_id).set()

    def _on(self, event) -> None:
        if isinstance(event, Frame):
            ids = self.ids[event.block_start:event.block_start + event.num_blocks]
            self.loader.write(event.transfer_id, self.target[event.layer], 0, event.payload, list(range(len(ids))),
                              ids)
        elif isinstance(event, TransferDone):
            self._ending.add(event.transfer_id)
        elif isinstance(event, TransferFailed):
            self.failures.append(event.reason)
            self.expect(event.transfer_id).set()

    def stop(self) -> None:
        """Stop receiving; the loader stays usable from the calling thread."""
        if self._stopped:
            return
        self._stopped = True
        self._stop.set()
        self._thread.join()
        self.transport.close()


def sync(device: Device) -> None:
    if device.is_cuda:
        torch.cuda.synchronize()


def compute_done(device: Device) -> None:
    """Wait for the compute stream only (copies on the side stream may still run)."""
    if device.is_cuda:
        torch.cuda.current_stream().synchronize()


def timed(run, device: Device, rounds: int) -> float:
    run()  # warm-up
    times = []
    for _ in range(rounds):
        sync(device)
        start = time.perf_counter()
        run()
        sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def forward_alone(forward: Forward, shape: Shape, device: Device) -> None:
    for _ in range(shape.layers):
        forward.layer()


def streamed_round(forward: Forward, saver: LayerSaver, source: list[torch.Tensor], ids: list[int],
                   tx: KVTransport, peer: str, receiving: Receiving, transfer_id: str) -> float:
    """One prefill with every layer streamed; returns when the compute stream is done (the
    transfer may still be moving), in seconds."""
    sync(saver.device)
    ended = receiving.expect(transfer_id)
    start = time.perf_counter()
    for layer, cache in enumerate(source):
        forward.layer()

        def deliver(first, count, payload, release, layer=layer):
            tx.send(peer, transfer_id, layer, 0, first, count, payload, on_sent=release)
        saver.save(cache, 0, ids, deliver)
    saver.then(lambda: tx.finish(peer, transfer_id))
    saver.fence()
    compute_done(saver.device)
    elapsed = time.perf_counter() - start
    if not ended.wait(120.0):
        raise TimeoutError(f"transfer {transfer_id} did not complete in 120 s")
    return elapsed


def same_blocks(source: list[torch.Tensor], src_ids: list[int], target: list[torch.Tensor], dst_ids: list[int]) -> bool:
    src, dst = (torch.tensor(ids, device=source[0].device) for ids in (src_ids, dst_ids))
    return all(torch.equal(s.index_select(0, src), t.index_select(0, dst)) for s, t in zip(source, target))


def producer_rate(saver: LayerSaver, source: list[torch.Tensor], ids: list[int], layer_bytes: int,
                  rounds: int) -> float:
    def run():
        for cache in source:
            saver.save(cache, 0, ids, lambda first, count, payload, release: release())
        saver.flush()
    return len(source) * layer_bytes / timed(run, saver.device, rounds) / 1e9


def received_frames(loader: BlockLoader, payloads: list[memoryview], num_blocks: int,
                    frame_bytes: int) -> list[tuple[int, int, memoryview]]:
    """Each layer's bytes cut into frames of whole blocks, in the memory the transport would have
    received them into (``loader.allocate``): (layer, first block, payload)."""
    frames = []
    for layer, payload in enumerate(payloads):
        block_bytes = len(payload) // num_blocks
        per_frame = max(1, frame_bytes // block_bytes)
        for first in range(0, num_blocks, per_frame):
            chunk = payload[first * block_bytes:min(first + per_frame, num_blocks) * block_bytes]
            frame = loader.allocate(len(chunk))
            frame[:] = chunk
            frames.append((layer, first, frame))
    return frames


def consumer_rate(loader: BlockLoader, frames: list[tuple[int, int, memoryview]], target: list[torch.Tensor],
                  ids: list[int], rounds: int) -> float:
    block_bytes = target[0][0].numel() * target[0].element_size()

    def run():
        for layer, first, payload in frames:
            count = len(payload) // block_bytes
            loader.write("rate", target[layer], 0, payload, list(range(count)), ids[first:first + count])
        while loader.poll() is not None and loader.busy("rate"):
            time.sleep(0.0001)
    return sum(len(frame[2]) for frame in frames) / timed(run, loader.device, rounds) / 1e9


def plain_copy_rates(device: Device, layer_bytes: int, layers: int, rounds: int) -> tuple[float, float]:
    """Device-to-host and host-to-device GB/s of the same bytes through one pinned buffer (CUDA), or
    between pre-allocated, already touched buffers (CPU)."""
    on_device = torch.ones(layers, layer_bytes, dtype=torch.uint8, device=device.device)
    host = torch.ones(layers, layer_bytes, dtype=torch.uint8, pin_memory=device.is_cuda)

    def d2h():
        for layer in range(layers):
            host[layer].copy_(on_device[layer], non_blocking=True)

    def h2d():
        for layer in range(layers):
            on_device[layer].copy_(host[layer], non_blocking=True)
    total = layer_bytes * layers / 1e9
    return total / timed(d2h, device, rounds), total / timed(h2d, device, rounds)


def transport_settings(frame_bytes: int) -> TransportSettings:
    return TransportSettings(secret=SECRET, frame_bytes=frame_bytes)


def run_layout(order: str, shape: Shape, device: Device, rounds: int, frame_bytes: int) -> Result:
    total_blocks = 2 * shape.num_blocks  # ids scattered over a cache twice the request's size
    generator = torch.Generator().manual_seed(len(order))
    src_ids = torch.randperm(total_blocks, generator=generator)[:shape.num_blocks].tolist()
    dst_ids = torch.randperm(total_blocks, generator=generator)[:shape.num_blocks].tolist()
    source = caches(order, total_blocks, shape, device.device, random=True)
    target = caches(order, total_blocks, shape, device.device, random=False)
    named = detect(source[0], total_blocks).name
    forward = Forward(shape, device.device)
    forward_s = timed(lambda: forward_alone(forward, shape, device), device, rounds)

    ring = HostRing(device, SLOT_BYTES, -(-(shape.layer_bytes * shape.layers) // SLOT_BYTES) + 2)
    saver = LayerSaver(device, ring, threaded=True)
    receiving = Receiving(device, target, dst_ids, shape.layer_bytes * shape.layers, frame_bytes)
    tx = KVTransport(transport_settings(frame_bytes))
    peer = f"127.0.0.1:{receiving.transport.port}"
    try:
        streamed, matches = [], True
        for round_id in range(rounds + 1):  # the first opens the connections, unmeasured
            for cache in target:
                cache.zero_()
            elapsed = streamed_round(forward, saver, source, src_ids, tx, peer, receiving, f"{order}-{round_id}")
            streamed += [elapsed] if round_id else []
            matches &= not receiving.failures and same_blocks(source, src_ids, target, dst_ids)
        waits = ring.num_waits
        receiving.stop()
        d2h = producer_rate(saver, source, src_ids, shape.layer_bytes, rounds)
        index = torch.tensor(src_ids, device=device.device)
        payloads = [memoryview(c.index_select(0, index).reshape(-1).view(torch.uint8).cpu().numpy()) for c in source]
        frames = received_frames(receiving.loader, payloads, shape.num_blocks, frame_bytes)
        h2d = consumer_rate(receiving.loader, frames, target, dst_ids, rounds)
        matches &= same_blocks(source, src_ids, target, dst_ids)
        d2h_base, h2d_base = plain_copy_rates(device, shape.layer_bytes, shape.layers, rounds)
    finally:
        saver.close()
        tx.close()
        receiving.stop()
        receiving.loader.ring.close()
        if receiving.loader.receive_ring is not None:
            receiving.loader.receive_ring.close()
        ring.close()
    return Result(named, forward_s, statistics.median(streamed), d2h, d2h_base, h2d, h2d_base, waits, matches)


def report(results: list[Result], device: Device, shape: Shape, frame_bytes: int) -> int:
    print(f"{shape.layers} layers, {shape.heads} KV heads of {shape.head_size}, bf16, {shape.tokens} tokens "
          f"(blocks of {BLOCK_TOKENS}), {shape.layer_bytes / 2**20:.1f} MiB of KV per layer; "
          f"MLP {shape.hidden} -> {shape.ffn}; frames of {frame_bytes >> 10} KiB; device {device_name(device)}")
    print(f"{'layout':8} {'forward':>9} {'streamed':>9} {'slowdown':>9} {'D2H GB/s':>9} {'pinned':>8} {'ratio':>6} "
          f"{'H2D GB/s':>9} {'pinned':>8} {'ratio':>6} {'waits':>6} bytes")
    for r in results:
        print(f"{r.layout:8} {r.forward_s * 1e3:7.1f}ms {r.streaming_s * 1e3:7.1f}ms {r.slowdown:8.3f}x "
              f"{r.d2h_gbps:9.1f} {r.d2h_base_gbps:8.1f} {r.d2h_gbps / r.d2h_base_gbps:6.2f} "
              f"{r.h2d_gbps:9.1f} {r.h2d_base_gbps:8.1f} {r.h2d_gbps / r.h2d_base_gbps:6.2f} {r.ring_waits:6d} "
              f"{'match' if r.bytes_match else 'DIFFER'}")
    slowdown = max(r.slowdown for r in results)
    d2h = min(r.d2h_gbps / r.d2h_base_gbps for r in results)
    h2d = min(r.h2d_gbps / r.h2d_base_gbps for r in results)
    matches = all(r.bytes_match for r in results)
    held = slowdown <= TARGET_SLOWDOWN and d2h >= TARGET_COPY and h2d >= TARGET_COPY
    figures = (f"slowdown {slowdown:.3f}x (target <= {TARGET_SLOWDOWN}), D2H {d2h:.2f}x of pinned (target >= "
               f"{TARGET_COPY}), H2D {h2d:.2f}x of pinned (target >= {TARGET_COPY}), bytes "
               f"{'match' if matches else 'DIFFER'} in every layer of every layout")
    if not device.is_cuda:
        print(f"gpu_kv_path (cpu): {figures}; on CPU only the bytes decide (the targets are for --device cuda): "
              f"{'PASS' if matches else 'FAIL'}")
        return 0 if matches else 1
    print(f"gpu_kv_path (cuda): {figures}: {'PASS' if held and matches else 'FAIL'}")
    return 0 if held and matches else 1


def device_name(device: Device) -> str:
    return torch.cuda.get_device_name(device.device) if device.is_cuda else "cpu"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     epilog="--device cpu checks that the same code path runs and that every byte "
                                            "arrives; its ratios are reported, not enforced.")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                        help="cuda (default): exit 0 only when every target holds and every byte matches; cpu: the "
                             "same code on CPU tensors with smaller matmuls, against plain memory copies; exit 0 "
                             "when every byte arrives (the ratios are printed, not enforced)")
    parser.add_argument("--tokens", type=int, help="prefill length (default 8192 on cuda, 512 on cpu)")
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--head-size", type=int, default=128)
    parser.add_argument("--hidden", type=int, help="MLP width (default 4096 on cuda, 256 on cpu)")
    parser.add_argument("--ffn", type=int, help="MLP inner width (default 14336 on cuda, 896 on cpu)")
    parser.add_argument("--layouts", default="LBNHC,LBHNC")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--frame-bytes", type=int, default=FRAME_BYTES,
                        help="transport.frame_bytes of both ends (default 8 MiB, the most a receiver accepts): each "
                             "received frame costs the consumer host time, so large frames let it keep up with "
                             "the copy engine")
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("no CUDA device: run with --device cpu")
    cpu = args.device == "cpu"
    shape = Shape(args.tokens or (512 if cpu else 8192), args.layers, args.heads, args.head_size,
                  args.hidden or (256 if cpu else 4096), args.ffn or (896 if cpu else 14336))
    device = Device(args.device)
    results = [run_layout(order, shape, device, args.rounds, args.frame_bytes) for order in args.layouts.split(",")]
    return report(results, device, shape, args.frame_bytes)


if __name__ == "__main__":
    sys.exit(main())
