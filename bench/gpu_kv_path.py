"""The connector's worker core on the device, driven through the calls vLLM makes, in Model Runner V2's
order: what streaming costs the forward, how fast KV moves device-to-host and host-to-device against a
pinned copy, and whether every byte arrives, for every path the engine runs.

Each engine rank is a ``PrfaasConnectorWorker`` (the core ``connector.PrfaasConnector`` translates
vLLM's hooks into) over FlashAttention-shaped caches: one buffer, a logical [blocks, heads, tokens,
K|V] view per layer as vLLM 0.32 registers them, token-major (LBNHC, FlashAttention's own) or
head-major (LBHNC). Ranks of one engine are threads of this process on one device, each with its
own core and transport. A prefill step, per producer rank: ``on_metadata`` (``bind_connector_metadata``),
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
- the core's device path alone, with the transport replaced by an in-process hand-over (no TCP): the
  producer's device-to-host rate (every save until delivered) and the consumer's host-to-device rate
  (every received frame until its copies completed), each against a pinned copy of the same bytes:
  target >= 0.8x;
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
import threading
import time
from dataclasses import dataclass
from functools import partial
from types import SimpleNamespace

import _common  # noqa: F401  (puts the project on sys.path)
import torch

from services.cache_pool.pool import CachePool
from services.cache_pool.server import PoolIdentity, start_pool_server
from services.cache_pool.slots import Arena
from services.cache_pool_client.hashing import prompt_block_hashes
from services.cache_pool_client.types import GroupKind, KvCacheGroup
from services.kv_connector.codecs import coding_of, decode, encode
from services.kv_connector.layouts.from_vllm import spec_from_vllm
from services.kv_connector.layouts.pages import KVLayout
from services.kv_connector.layouts.spec import TOKEN_ROWS
from services.kv_connector.metadata import PoolLoadSpec, PoolStoreSpec, PrfaasConnectorMetadata, RecvSpec, SendSpec
from services.kv_connector.pool.io import PoolIO, PoolModel
from services.kv_connector.pool.worker import PoolWorker
from services.kv_connector.settings import ConnectorSettings
from services.kv_connector.worker import PrfaasConnectorWorker
from services.kv_transport import Frame, TransferDone, TransportSettings, codecs, protocol

BLOCK_TOKENS = 16
SECRET = "bench-secret"
TARGET_SAME_TP, TARGET_OTHER_TP, TARGET_COPY = 1.03, 1.05, 0.8
CASES = {  # name: (producer TP, consumer TP, layout, codec, pool)
    "tp1-1 LBNHC": (1, 1, "LBNHC", "none", False), "tp1-1 LBHNC": (1, 1, "LBHNC", "none", False),
    "tp1-2": (1, 2, "LBNHC", "none", False), "tp2-1": (2, 1, "LBNHC", "none", False),
    "tp1-1 fp8": (1, 1, "LBNHC", "fp8", False), "tp1-1 int8": (1, 1, "LBNHC", "int8", False),
    "pool": (1, 1, "LBNHC", "none", True),
}


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

    def kv_bytes(self, tp_size: int = 1) -> int:
        return self.layers * self.num_blocks * self.heads // tp_size * BLOCK_TOKENS * 2 * self.head_size * 2


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


class Forward:
    """Three matmuls per layer, sized like an MLP of ``hidden`` -> ``ffn`` over ``tokens`` tokens."""

    def __init__(self, shape: Shape, device: torch.device) -> None:
        def make(*size):
            return torch.randn(*size, device=device).to(torch.bfloat16) / size[-1] ** 0.5
        self.x, self.up, self.down = make(shape.tokens, shape.hidden), make(shape.hidden, shape.ffn), \
            make(shape.ffn, shape.hidden)
        self.h, self.y = make(shape.tokens, shape.ffn), make(shape.tokens, shape.hidden)

    def layer(self) -> None:
        torch.matmul(self.x, self.up, out=self.h)
        torch.matmul(self.x, self.up, out=self.h)
        torch.matmul(self.h, self.down, out=self.y)


class Rank:
    """One engine rank: FlashAttention-shaped caches registered with a worker core."""

    def __init__(self, shape: Shape, order: str, tp_size: int, rank: int, fill: bool, device: torch.device,
                 settings: ConnectorSettings, pool: PoolWorker | None = None, open_streams=None) -> None:
        heads = shape.heads // tp_size
        self.names = [f"model.layers.{i}.self_attn.attn" for i in range(shape.layers)]
        spec = SimpleNamespace(block_size=BLOCK_TOKENS, num_kv_heads=heads, head_size=shape.head_size,
                               dtype=torch.bfloat16)
        self.num_blocks = 2 * shape.num_blocks + 1  # the request's ids scattered over a cache twice its size
        config = SimpleNamespace(num_blocks=self.num_blocks, kv_cache_groups=[
            SimpleNamespace(layer_names=self.names, kv_cache_spec=spec)])
        generator = torch.Generator(device=device).manual_seed(1 + rank)
        self.views = flash_attention_views(order, self.num_blocks, shape.layers, heads, shape.head_size, device,
                                           generator if fill else None)
        self.forward = Forward(shape, device)
        self.core = PrfaasConnectorWorker(open_streams or partial(settings.open_streams, rank),
                                          settings.worker_settings, pool)
        self.core.register_kv_caches(KVLayout(config, dict(zip(self.names, self.views))),
                                     spec_from_vllm("bench", config, self.names, rank, tp_size, shape.heads,
                                                    cache_layout=TOKEN_ROWS))

    def prefill(self, meta: PrfaasConnectorMetadata, connected: bool = True) -> None:
        """One step in Model Runner V2's order (the forward alone when not ``connected``)."""
        if connected:
            self.core.on_metadata(meta)
        for name in self.names:
            self.forward.layer()
            if connected:
                self.core.save_kv_layer(name)
        if connected:
            self.core.wait_for_save()
            self.core.get_transfer_results()

    def receive(self, meta: PrfaasConnectorMetadata, req_id: str, timeout_s: float = 300.0) -> set[str]:
        """Idle steps until ``req_id`` is reported; returns the failed requests."""
        self.core.on_metadata(meta)
        deadline = time.monotonic() + timeout_s
        while True:
            results = self.core.get_transfer_results()
            if req_id in results.finished_recving:
                return results.failed_recving
            if time.monotonic() > deadline:
                raise TimeoutError(f"{req_id} was not received in {timeout_s:.0f} s")
            self.core.on_metadata(PrfaasConnectorMetadata(idle=True))

    def blocks(self, ids: list[int]) -> torch.Tensor:
        """[layers, blocks, heads, tokens, K|V] of ``ids``, on the host."""
        index = torch.tensor(ids, device=self.views[0].device)
        return torch.stack([view.index_select(0, index) for view in self.views]).cpu()


def flash_attention_views(order: str, num_blocks: int, layers: int, heads: int, head_size: int,
                          device: torch.device, generator) -> list[torch.Tensor]:
    """One buffer in ``order`` (LBNHC or LBHNC), a logical [B, H, N, C] view per layer."""
    sizes = {"L": layers, "B": num_blocks, "H": heads, "N": BLOCK_TOKENS, "C": 2 * head_size}
    strides, numel = {}, 1
    for dim in reversed(order):
        strides[dim], numel = numel, numel * sizes[dim]
    buffer = (torch.randn(numel, device=device, generator=generator) if generator is not None
              else torch.zeros(numel, device=device)).to(torch.bfloat16)
    return [torch.as_strided(buffer, tuple(sizes[d] for d in "BHNC"), tuple(strides[d] for d in "BHNC"),
                             layer * strides["L"]) for layer in range(layers)]


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def compute_done(device: torch.device) -> None:
    """Wait for the compute stream only (copies on side streams may still run)."""
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()


def on_threads(calls) -> float:
    """Run each call on a thread of its own (an engine's ranks), all at once; seconds until all ended."""
    barrier, errors = threading.Barrier(len(calls)), []

    def run(call):
        try:
            barrier.wait()
            call()
        except BaseException as error:  # noqa: BLE001 - re-raised below
            errors.append(error)
    threads = [threading.Thread(target=run, args=(call,)) for call in calls]
    start = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
    return time.perf_counter() - start


def step_time(ranks: list[Rank], meta_of, connected: bool, device: torch.device) -> float:
    sync(device)
    return on_threads([lambda r=r: (r.prefill(meta_of(r), connected), compute_done(device)) for r in ranks])


def settings_for(codec: str, listen_port: int | None, ring_bytes: int | None) -> ConnectorSettings:
    transport = {"secret": SECRET, "codec": codec, "connections_per_peer": 8}
    return ConnectorSettings(listen_port=listen_port, transport=transport, code_sends=codec != "none",
                             host_ring_bytes=ring_bytes)


def reference(ranks: list[Rank], ids: list[int], codec: str) -> torch.Tensor:
    """The producer's blocks as the consumer should hold them: every head, through the codec."""
    per_rank = []
    for rank in ranks:
        blocks = rank.blocks(ids)
        if codec != "none":
            code = codecs.CODECS[codec]
            dtype, row_elems = coding_of(rank.views[0])
            raw = memoryview(blocks.contiguous().view(torch.uint8).numpy()).cast("B")
            back = decode(code, memoryview(bytes(encode(code, raw, dtype, row_elems))), row_elems, torch.bfloat16)
            blocks = torch.frombuffer(bytearray(back), dtype=torch.bfloat16).view(blocks.shape)
        per_rank.append(blocks)
    return torch.cat(per_rank, dim=2)


def transfer_case(name: str, shape: Shape, device: torch.device, rounds: int, ring_bytes: int, port: int) -> Result:
    src_tp, dst_tp, order, codec, _ = CASES[name]
    consumers = [Rank(shape, order, dst_tp, r, False, device, settings_for(codec, port, ring_bytes))
                 for r in range(dst_tp)]
    producers = [Rank(shape, order, src_tp, r, True, device, settings_for(codec, None, ring_bytes))
                 for r in range(src_tp)]
    src_ids, dst_ids = request_ids(shape)
    try:
        forward_s = statistics.median([step_time(producers, lambda r: None, False, device)
                                       for _ in range(rounds + 1)][1:])
        connected, matches = [], True
        for round_id in range(rounds + 1):  # the first opens the connections, unmeasured
            req = f"{name}-{round_id}"
            send = PrfaasConnectorMetadata(sends=[SendSpec(req, req, f"127.0.0.1:{port}", (tuple(src_ids),), 0,
                                                           shape.tokens, shape.tokens, dst_tp)])
            recv = PrfaasConnectorMetadata(recvs=[RecvSpec(req, req, (tuple(dst_ids),), 0, shape.tokens)])
            steps: list[float] = []
            on_threads([partial(timed_step, r, send, device, steps) for r in producers]
                       + [partial(received, r, recv, req) for r in consumers])
            connected += [max(steps)] if round_id else []
            matches &= torch.equal(torch.cat([r.blocks(dst_ids) for r in consumers], dim=2),
                                   reference(producers, src_ids, codec))
        waits = sum(r.core.producer.saver.ring.num_waits for r in producers)
    finally:
        for rank in producers + consumers:
            rank.core.shutdown()
    d2h, h2d = device_path_rates(shape, order, src_tp, dst_tp, codec, device, rounds, ring_bytes)
    return Result(name, forward_s, statistics.median(connected), d2h, h2d, waits, matches,
                  TARGET_SAME_TP if src_tp == dst_tp else TARGET_OTHER_TP)


def request_ids(shape: Shape) -> tuple[list[int], list[int]]:
    """The request's blocks on the producer and on the consumer, scattered over caches twice its size
    (block 0 is vLLM's null block)."""
    generator = torch.Generator().manual_seed(7)
    return tuple((torch.randperm(2 * shape.num_blocks, generator=generator)[:shape.num_blocks] + 1).tolist()
                 for _ in range(2))


def timed_step(rank: Rank, meta: PrfaasConnectorMetadata, device: torch.device, times: list[float]) -> None:
    """One connected prefill step, until this rank's compute stream is done: its time into ``times``."""
    start = time.perf_counter()
    rank.prefill(meta)
    compute_done(device)
    times.append(time.perf_counter() - start)


def received(rank: Rank, recv: PrfaasConnectorMetadata, req: str) -> None:
    if failed := rank.receive(recv, req):
        raise RuntimeError(f"{req} failed on a consumer rank: {failed}")


FRAME_CAP = TransportSettings().frame_cap  # the most a sender with the deployed settings puts in a frame


class LoopWire:
    """The transport replaced by an in-process hand-over, for the device path's rates: a send is cut
    into frames as the transport cuts it (whole blocks up to the consumer's announced frame size, or
    the transport's cap for payloads that are not blocks one after another), each read into the
    addressed consumer rank's receive memory (its ``allocate``), coded as the transport codes it;
    that rank's ``poll`` hands its frames to its core."""

    def __init__(self, network: dict[str, LoopWire], codec: str, address: str = "",
                 frame_bytes: int = FRAME_CAP) -> None:
        self.codec = codecs.CODECS[codec]
        self.network = network
        self.receive_frame_bytes = frame_bytes
        self.allocate = bytearray
        self.listen_host, self.port = "127.0.0.1", int(address.rpartition(":")[2] or 0)
        self._frames: list = []
        self._lock = threading.Lock()
        if address:
            network[address] = self

    def receive_into(self, allocate) -> None:
        self.allocate = allocate

    def frame_bytes(self, peer) -> int:
        return min(FRAME_CAP, self.network[peer].receive_frame_bytes)

    def send_layout(self, peer, transfer_id, payload) -> None:
        self.network[peer].deliver(Frame(transfer_id, 0, 0, 0, 0, memoryview(bytes(payload)), protocol.LAYOUT))

    def send(self, peer, transfer_id, layer, group, block_start, num_blocks, payload, on_sent=None, coding=None,
             divisible=False) -> None:
        target, cap = self.network[peer], FRAME_CAP
        payload = memoryview(payload).cast("B")
        block_bytes = max(len(payload) // max(num_blocks, 1), 1)
        per_frame = max(1, (min(cap, target.receive_frame_bytes) if divisible else cap) // block_bytes)
        for first in range(0, max(num_blocks, 1), per_frame):
            count = min(per_frame, num_blocks - first)
            target.deliver(self._frame(target, transfer_id, layer, group, block_start + first, count,
                                       payload[first * block_bytes:(first + count) * block_bytes], coding))
        if on_sent is not None:
            on_sent()

    def _frame(self, target: LoopWire, transfer_id, layer, group, block_start, num_blocks, payload, coding) -> Frame:
        codec = self.codec if coding is not None else codecs.NONE
        data = encode(codec, payload, *coding) if codec != codecs.NONE else payload
        memory = target.allocate(len(data))
        memory[:] = data
        return Frame(transfer_id, layer, group, block_start, num_blocks, memoryview(memory), protocol.DATA, codec,
                     coding[1] if codec != codecs.NONE else 0)

    def finish(self, peer, transfer_id) -> None:
        self.network[peer].deliver(TransferDone(transfer_id))

    def deliver(self, event) -> None:
        with self._lock:
            self._frames.append(event)

    def poll(self, wait_s: float) -> list:
        with self._lock:
            frames, self._frames = self._frames, []
        return frames

    def forget(self, transfer_id) -> None:
        pass

    def close(self) -> None:
        pass


def device_path_rates(shape: Shape, order: str, src_tp: int, dst_tp: int, codec: str, device: torch.device,
                      rounds: int, ring_bytes: int) -> tuple[float, float]:
    """The producer ranks' save rate and the consumer ranks' write rate, through the same cores with
    no TCP between them, each over a pinned copy of the same bytes."""
    network: dict[str, LoopWire] = {}
    settings = settings_for(codec, None, ring_bytes)
    consumers = [Rank(shape, order, dst_tp, r, False, device, settings,
                      open_streams=partial(LoopWire, network, codec, f"loop:{7000 + r}")) for r in range(dst_tp)]
    producers = [Rank(shape, order, src_tp, r, True, device, settings,
                      open_streams=partial(LoopWire, network, codec, ""))
                 for r in range(src_tp)]
    src_ids, dst_ids = request_ids(shape)
    saves, writes = [], []
    try:
        for round_id in range(rounds + 1):
            req = f"rate-{round_id}"
            send = PrfaasConnectorMetadata(sends=[SendSpec(req, req, "loop:7000", (tuple(src_ids),), 0, shape.tokens,
                                                           shape.tokens, dst_tp)])
            recv = PrfaasConnectorMetadata(recvs=[RecvSpec(req, req, (tuple(dst_ids),), 0, shape.tokens)])
            for rank in consumers:
                rank.core.on_metadata(recv)
            sync(device)
            saves.append(on_threads([partial(save_all, r, send) for r in producers]))
            sync(device)
            writes.append(on_threads([partial(received, r, PrfaasConnectorMetadata(), req) for r in consumers]))
    finally:
        for rank in producers + consumers:
            rank.core.shutdown()
    kv_bytes = shape.kv_bytes()
    d2h_base, h2d_base = pinned_rates(device, kv_bytes, rounds)
    return kv_bytes / statistics.median(saves[1:]) / d2h_base, kv_bytes / statistics.median(writes[1:]) / h2d_base


def save_all(rank: Rank, meta: PrfaasConnectorMetadata) -> None:
    """Every layer saved back to back (no forward), until every copy was handed on."""
    rank.core.on_metadata(meta)
    for name in rank.names:
        rank.core.save_kv_layer(name)
    rank.core.wait_for_save()
    rank.core.flush()


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
        settings, network = settings_for("none", None, ring_bytes), {}
        source = Rank(shape, "LBNHC", 1, 0, True, device, settings, PoolWorker(io, model),
                      partial(LoopWire, network, "none", ""))
        target = Rank(shape, "LBNHC", 1, 0, False, device, settings, PoolWorker(io, model),
                      partial(LoopWire, network, "none", ""))
        ids, _ = request_ids(shape)
        try:
            forward_s = statistics.median([step_time([source], lambda r: None, False, device)
                                           for _ in range(rounds + 1)][1:])
            stored, loaded, storing, matches = [], [], [], True
            for round_id in range(rounds + 1):
                tokens = [round_id * 100_000 + i for i in range(shape.tokens)]
                hashes = tuple(prompt_block_hashes(tokens, BLOCK_TOKENS))
                store = PoolStoreSpec(f"s{round_id}", (tuple(ids),), tuple(enumerate(hashes)), None, shape.tokens)
                start = time.perf_counter()
                meta = PrfaasConnectorMetadata(pool_stores=[store])
                storing.append(step_time([source], lambda r, meta=meta: meta, True, device))
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
    results = []
    for name in args.cases.split(","):
        if CASES[name][4]:
            results.append(pool_case(shape, device, args.rounds, args.ring_bytes))
        else:
            results.append(transfer_case(name, shape, device, args.rounds, args.ring_bytes,
                                         free_ports(CASES[name][1])))
    return report(results, device, shape)


if __name__ == "__main__":
    sys.exit(main())
