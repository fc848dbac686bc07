"""The pieces bench/gpu_kv_path.py builds its engines from: an engine rank (FlashAttention-shaped
caches registered with a ``PrfaasConnectorWorker``, the core vLLM's hooks drive), its forward, the
deployed settings, and ``RecordedWire``, the transport replaced by recorded frames for the device
path's rates. Ranks run as threads of the benchmark or as processes of their own
(``gpu_kv_ranks``); nothing here knows which.
"""
from __future__ import annotations

import pickle
import threading
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from types import SimpleNamespace

import _common  # noqa: F401  (puts the project on sys.path)
import torch

from services.kv_connector.codecs import coding_of, decode, encode
from services.kv_connector.layouts.from_vllm import spec_from_vllm
from services.kv_connector.layouts.pages import KVLayout
from services.kv_connector.layouts.spec import TOKEN_ROWS
from services.kv_connector.metadata import PrfaasConnectorMetadata
from services.kv_connector.pool.worker import PoolWorker
from services.kv_connector.settings import ConnectorSettings
from services.kv_connector.worker import PrfaasConnectorWorker
from services.kv_transport import Frame, TransferDone, TransportSettings, codecs, protocol

BLOCK_TOKENS = 16
SECRET = "bench-secret"
FRAME_CAP = TransportSettings().frame_cap  # the most a sender with the deployed settings puts in a frame


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

    def clear(self, ids: list[int]) -> None:
        """Zero blocks ``ids`` (a consumer's, between rounds, so each round's bytes are its own)."""
        index = torch.tensor(ids, device=self.views[0].device)
        for view in self.views:
            view.index_fill_(0, index, 0)

    def reference(self, ids: list[int], codec: str) -> torch.Tensor:
        """This producer rank's blocks ``ids`` as a consumer should hold them: through the codec."""
        blocks = self.blocks(ids)
        if codec == "none":
            return blocks
        code = codecs.CODECS[codec]
        dtype, row_elems = coding_of(self.views[0])
        raw = memoryview(blocks.contiguous().view(torch.uint8).numpy()).cast("B")
        back = decode(code, memoryview(bytes(encode(code, raw, dtype, row_elems))), row_elems, torch.bfloat16)
        return torch.frombuffer(bytearray(back), dtype=torch.bfloat16).view(blocks.shape)



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


def settings_for(codec: str, listen_port: int | None, ring_bytes: int | None) -> ConnectorSettings:
    transport = {"secret": SECRET, "codec": codec, "connections_per_peer": 8}
    return ConnectorSettings(listen_port=listen_port, transport=transport, code_sends=codec != "none",
                             host_ring_bytes=ring_bytes)


def request_ids(shape: Shape) -> tuple[list[int], list[int]]:
    """The request's blocks on the producer and on the consumer, scattered over caches twice its size
    (block 0 is vLLM's null block)."""
    generator = torch.Generator().manual_seed(7)
    return tuple((torch.randperm(2 * shape.num_blocks, generator=generator)[:shape.num_blocks] + 1).tolist()
                 for _ in range(2))


def step_time(rank: Rank, meta: PrfaasConnectorMetadata | None, device: torch.device, connected: bool = True) -> float:
    """Seconds of one prefill step (the forward alone when not ``connected``), until this rank's
    compute stream is done."""
    start = time.perf_counter()
    rank.prefill(meta, connected)
    compute_done(device)
    return time.perf_counter() - start


def received(rank: Rank, recv: PrfaasConnectorMetadata, req: str) -> None:
    if failed := rank.receive(recv, req):
        raise RuntimeError(f"{req} failed on a consumer rank: {failed}")


def save_all(rank: Rank, meta: PrfaasConnectorMetadata) -> None:
    """Every layer saved back to back (no forward), until every copy was handed on."""
    rank.core.on_metadata(meta)
    for name in rank.names:
        rank.core.save_kv_layer(name)
    rank.core.wait_for_save()
    rank.core.flush()


# (peer, kind, transfer id, layer, group, block start, block count, payload, codec, values per scale)
Recorded = tuple[str, int, str, int, int, int, int, bytes, int, int]


class RecordedWire:
    """The transport replaced by recorded frames, for the device path's rates (no TCP, no other rank
    needed at the time): a producer's sends are cut into frames as the transport cuts them (whole
    blocks up to the consumer's frame size, or the cap for payloads that are not blocks one after
    another), coded as the transport codes them, and kept (``take``); a consumer reads recorded
    frames into its receive memory as the transport would (``replay``: on CUDA into its ring) and
    ``poll`` hands them to its core. Every rank of the benchmark is on one kind of device, so a
    consumer announces the frame size this wire's own rank does."""

    def __init__(self, codec: str, address: str, frame_bytes: int) -> None:
        self.codec = codecs.CODECS[codec]
        self.address = address
        self.receive_frame_bytes = frame_bytes
        self.allocate = bytearray
        self._sent: list[Recorded] = []
        self._frames: list = []
        self._lock = threading.Lock()

    def frame_bytes(self, peer: str) -> int:
        return min(FRAME_CAP, self.receive_frame_bytes)

    def receive_into(self, allocate) -> None:
        self.allocate = allocate

    def send_layout(self, peer, transfer_id, payload) -> None:
        self._record((peer, protocol.LAYOUT, transfer_id, 0, 0, 0, 0, bytes(payload), codecs.NONE, 0))

    def send(self, peer, transfer_id, layer, group, block_start, num_blocks, payload, on_sent=None, coding=None,
             divisible=False) -> None:
        payload = memoryview(payload).cast("B")
        block_bytes = max(len(payload) // max(num_blocks, 1), 1)
        per_frame = max(1, (self.frame_bytes(peer) if divisible else FRAME_CAP) // block_bytes)
        codec = self.codec if coding is not None else codecs.NONE
        for first in range(0, max(num_blocks, 1), per_frame):
            count = min(per_frame, num_blocks - first)
            part = payload[first * block_bytes:(first + count) * block_bytes]
            data = bytes(encode(codec, part, *coding)) if codec != codecs.NONE else bytes(part)
            self._record((peer, protocol.DATA, transfer_id, layer, group, block_start + first, count, data, codec,
                          coding[1] if codec != codecs.NONE else 0))
        if on_sent is not None:
            on_sent()

    def finish(self, peer, transfer_id) -> None:
        self._record((peer, protocol.END, transfer_id, 0, 0, 0, 0, b"", codecs.NONE, 0))

    def take(self) -> list[Recorded]:
        """The frames sent since the last ``take``."""
        with self._lock:
            sent, self._sent = self._sent, []
        return sent

    def replay(self, recorded: list[Recorded], recorded_id: str, transfer_id: str) -> None:
        """The frames of ``recorded`` (addressed to this rank: ``load_recordings``), received as
        transfer ``transfer_id`` (they were sent as ``recorded_id``)."""
        events = []
        for _, kind, wire, layer, group, start, count, data, codec, row_elems in recorded:
            wire = transfer_id + wire[len(recorded_id):]
            if kind == protocol.END:
                events.append(TransferDone(wire))
            elif kind == protocol.LAYOUT:
                events.append(Frame(wire, 0, 0, 0, 0, memoryview(data), protocol.LAYOUT))
            else:
                memory = self.allocate(len(data))
                memory[:] = data
                events.append(Frame(wire, layer, group, start, count, memoryview(memory), kind, codec, row_elems))
        with self._lock:
            self._frames += events

    def poll(self, wait_s: float) -> list:
        with self._lock:
            frames, self._frames = self._frames, []
        return frames

    def forget(self, transfer_id) -> None:
        pass

    def close(self) -> None:
        pass

    def _record(self, frame: Recorded) -> None:
        with self._lock:
            self._sent.append(frame)


def save_recording(path: Path, recorded: list[Recorded]) -> None:
    path.write_bytes(pickle.dumps(recorded, protocol=pickle.HIGHEST_PROTOCOL))


def load_recordings(paths, address: str) -> list[Recorded]:
    """The frames of the recordings at ``paths`` addressed to ``address``."""
    return [frame for path in paths for frame in pickle.loads(Path(path).read_bytes()) if frame[0] == address]
