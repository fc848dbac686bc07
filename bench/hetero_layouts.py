"""Bytes on the wire and transfer time when prefill and decode engines lay out KV differently.

For each pairing of block sizes and tensor-parallel sizes, one request's KV (``--tokens`` tokens of
the embedded model's shape: its layer count, KV heads, head size and dtype, in the cache layout of
the CPU kernel vLLM picks on this host; two pairings put an amx engine beside a vec one) goes from
the producer ranks' connector workers to the consumer ranks', through ``KVTransport`` over loopback
TCP with its checksums and authentication, as a prefill worker streams it: layer by layer, in
prefill chunks of ``--chunk`` tokens. Each producer rank sends each consumer rank the KV heads it
owns (SmolLM2's 3 KV heads: TP 1 <-> 3; at TP 6 each head is replicated on two consumer ranks, and
the one that receives it passes it on to the other over loopback: those bytes are counted apart, as
"passed on"), each consumer rank listening on its own port; the consumer re-blocks them into its own
blocks, and every token's K and V of every head is checked against the producer's. The baseline is
the KV itself: the bytes the consumer needs (tokens x layers x KV heads x K and V x head size x
dtype). Wire bytes are everything the senders wrote: frame headers, the LAYOUT frames (fingerprint
and layout spec), END, payload, including the padding of a partial last block (none when the token
count is a multiple of every block size). Time is from the first layer handed to the transport to
the last consumer rank's report of the finished receive, the median of ``--rounds``, after an
unmeasured transfer that opens connections. The ranks of a side run one after another in this one
process (in a deployment each is its own process).

    python bench/hetero_layouts.py [--tokens 8192] [--chunk 2048] [--rounds 3]
"""
from __future__ import annotations

import argparse
import math
import threading
import time
from dataclasses import dataclass
from types import SimpleNamespace

import _common  # puts the project on sys.path
import torch
from _common import median, verdict

from services.engine.args import checkpoint_config, resolve_dtype
from services.kv_connector.layouts.pages import KVLayout
from services.kv_connector.layouts.apply import TORCH_DTYPES, attention_view, read_tokens
from services.kv_connector.layouts.spec import DTYPE_BYTES
from services.kv_connector.layouts.from_vllm import KERNEL_LAYOUTS, cpu_kernel_layout, spec_from_vllm
from services.kv_connector.metadata import PrfaasConnectorMetadata, RecvSpec, SendSpec
from services.kv_connector.consumer import ReceiveSettings
from services.kv_connector.worker import PrfaasConnectorWorker, WorkerSettings
from services.kv_transport import KVTransport, TransportSettings

# (prefill block size, decode block size, prefill TP, decode TP[, prefill kernel, decode kernel]): by
# default each side's KV cache in the layout of the kernel vLLM picks on this host (``cpu-amx`` on hosts
# with AMX for bfloat16, ``cpu-k-transposed`` elsewhere); the last two pair an amx engine with a vec one
# (a mixed fleet), converted by the consumer
PAIRINGS = ((128, 128, 1, 1), (64, 128, 1, 1), (128, 64, 1, 1), (32, 128, 1, 1), (128, 32, 1, 1),
            (128, 128, 1, 3), (128, 128, 3, 1), (64, 128, 3, 1), (128, 128, 1, 6),
            (128, 128, 1, 1, "amx", "vec"), (64, 128, 1, 3, "vec", "amx"))
SECRET = "bench-hetero-secret"
TARGET = 1.01  # wire bytes per KV byte: the KV once, framing under 1%
RECEIVE_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class Model:
    name: str
    layers: int
    kv_heads: int
    head_size: int
    dtype: str

    @property
    def kv_bytes_per_token(self) -> int:
        return self.layers * self.kv_heads * 2 * self.head_size * DTYPE_BYTES[self.dtype]


@dataclass(frozen=True)
class Result:
    prefill_block: int
    decode_block: int
    prefill_tp: int
    decode_tp: int
    kernels: str
    wire_bytes: int
    passed_on_bytes: int
    kv_bytes: int
    payload_bytes: int
    seconds: float

    @property
    def ratio(self) -> float:
        return self.wire_bytes / self.kv_bytes

    @property
    def name(self) -> str:
        return (f"{self.prefill_block}/TP{self.prefill_tp} -> {self.decode_block}/TP{self.decode_tp}"
                + (f" {self.kernels}" if self.kernels else ""))


def embedded_model() -> Model:
    from services.models import smollm2

    path = smollm2.prepare()
    config = checkpoint_config(path)
    heads = config["num_attention_heads"]
    head_size = config.get("head_dim") or config["hidden_size"] // heads
    return Model(smollm2.NAME, config["num_hidden_layers"],
                 config.get("num_key_value_heads") or heads, head_size, resolve_dtype("auto", str(path)))


class Engine:
    """One rank's paged KV cache (in ``cache_layout``, by default the one of the CPU kernel vLLM picks
    on this host) and its connector worker with a real transport (listening at ``listen_port`` on a
    consumer)."""

    def __init__(self, model: Model, block_size: int, num_tokens: int, fill: bool, listen_port: int | None,
                 tp_size: int = 1, tp_rank: int = 0, cache_layout: str = "") -> None:
        self.block_size = block_size
        self.cache_layout = cache_layout or cpu_kernel_layout(model.dtype, block_size, model.head_size)
        self.num_blocks = math.ceil(num_tokens / block_size) + 1  # block 0 is vLLM's null block
        heads = max(1, model.kv_heads // tp_size)  # vLLM replicates KV heads on more ranks than heads
        attention = SimpleNamespace(block_size=block_size, num_kv_heads=heads, head_size=model.head_size,
                                    dtype=TORCH_DTYPES[model.dtype])
        self.names = [f"layers.{i}" for i in range(model.layers)]
        config = SimpleNamespace(num_blocks=self.num_blocks, kv_cache_groups=[
            SimpleNamespace(layer_names=self.names, kv_cache_spec=attention)])
        shape = (self.num_blocks, heads, block_size, 2 * model.head_size)
        # ranks that replicate a KV head hold the same KV for it, as vLLM's do
        generator = torch.Generator().manual_seed(1000 * block_size + 10 * tp_size + tp_rank // copies(model, tp_size))
        caches = {name: (torch.randn(shape, generator=generator) if fill else torch.zeros(shape))
                  .to(TORCH_DTYPES[model.dtype]) for name in self.names}
        self.spec = spec_from_vllm(model.name, config, self.names, tp_rank, tp_size, model.kv_heads,
                                   cache_layout=self.cache_layout)
        settings = TransportSettings(secret=SECRET)
        self.worker = PrfaasConnectorWorker(
            lambda frame_bytes: KVTransport(settings, listen_port=listen_port, frame_bytes=frame_bytes),
            WorkerSettings(ReceiveSettings(RECEIVE_TIMEOUT_S, 1 << 32)))
        self.worker.register_kv_caches(KVLayout(config, caches, self.cache_layout), self.spec)
        self.block_ids = tuple(range(1, self.num_blocks))

    def tokens(self, layer: str, num_tokens: int) -> torch.Tensor:
        """K and V of the first ``num_tokens`` tokens of one layer, [tokens, local heads, 2, head_size]."""
        view = attention_view(self.worker.layout.caches[layer], self.spec.layers[0], self.block_size)
        positions = torch.arange(num_tokens)
        blocks = torch.tensor(self.block_ids)[positions // self.block_size]
        return torch.stack([read_tokens(view, half, self.cache_layout)[blocks, :, positions % self.block_size]
                            for half in (0, 1)], dim=2)

    def close(self) -> None:
        self.worker.shutdown()


def copies(model: Model, tp_size: int) -> int:
    """On how many ranks of a TP size each KV head is (vLLM replicates them on more ranks than heads)."""
    return max(1, tp_size // model.kv_heads)


def all_heads(ranks: list[Engine], layer: str, num_tokens: int, model: Model) -> torch.Tensor:
    """K and V of every head of one layer, the ranks' heads side by side; where ranks replicate heads,
    each replica must equal the rank it copies, and the heads are taken once."""
    per_rank = [rank.tokens(layer, num_tokens) for rank in ranks]
    same = copies(model, len(ranks))
    for rank, tokens in enumerate(per_rank):
        if not torch.equal(tokens, per_rank[rank - rank % same]):
            raise RuntimeError(f"rank {rank} holds other KV than the rank it replicates, layer {layer}")
    return torch.cat(per_rank[::same], dim=1)


def transfer(producers: list[Engine], consumers: list[Engine], port: int, transfer_id: str, num_tokens: int,
             chunk: int) -> float:
    """Stream one request's KV; returns the seconds until every consumer rank reported it received."""
    peer = f"127.0.0.1:{port}"
    outcome: dict[int, float | str] = {}

    def receive(rank: int, consumer: Engine) -> None:
        deadline = time.monotonic() + RECEIVE_TIMEOUT_S
        while time.monotonic() < deadline:
            results = consumer.worker.get_transfer_results()
            if results.failed_recving:
                outcome[rank] = f"consumer rank {rank} failed the receive (see the log)"
                return
            if results.finished_recving:
                outcome[rank] = time.perf_counter()
                return
            time.sleep(0.0005)
        outcome[rank] = f"no complete receive on consumer rank {rank} in {RECEIVE_TIMEOUT_S:.0f} s"

    for consumer in consumers:
        consumer.worker.on_metadata(PrfaasConnectorMetadata(recvs=[RecvSpec(
            "r", transfer_id, (consumer.block_ids,), 0, num_tokens)]))
    receivers = [threading.Thread(target=receive, args=(rank, consumer)) for rank, consumer in enumerate(consumers)]
    for receiver in receivers:
        receiver.start()
    start = time.perf_counter()
    for first in range(0, num_tokens, chunk):
        for producer in producers:
            send = SendSpec("r", transfer_id, peer, (producer.block_ids,), first, min(first + chunk, num_tokens),
                            num_tokens, len(consumers))
            producer.worker.on_metadata(PrfaasConnectorMetadata(sends=[send]))
            for name in producer.names:
                producer.worker.save_kv_layer(name)
            producer.worker.wait_for_save()
    for receiver in receivers:
        receiver.join()
    if errors := [value for value in outcome.values() if isinstance(value, str)]:
        raise RuntimeError(f"transfer {transfer_id}: {'; '.join(errors)}")
    return max(float(value) for value in outcome.values()) - start


def run_pairing(model: Model, pairing: tuple, args) -> Result:
    prefill_block, decode_block, prefill_tp, decode_tp = pairing[:4]
    kernels = pairing[4:] or ("", "")
    layouts = [KERNEL_LAYOUTS[kernel] if kernel else "" for kernel in kernels]
    port = _common.free_ports(decode_tp)
    producers = [Engine(model, prefill_block, args.tokens, True, None, prefill_tp, rank, layouts[0])
                 for rank in range(prefill_tp)]
    consumers = [Engine(model, decode_block, args.tokens, False, port + rank, decode_tp, rank, layouts[1])
                 for rank in range(decode_tp)]
    try:
        transfer(producers, consumers, port, "warm-up", args.tokens, args.chunk)
        before, passed_before = sent_bytes(producers), sent_bytes(consumers)
        seconds = [transfer(producers, consumers, port, f"round-{i}", args.tokens, args.chunk)
                   for i in range(args.rounds)]
        wire = (sent_bytes(producers) - before) // args.rounds
        passed_on = (sent_bytes(consumers) - passed_before) // args.rounds
        for name in consumers[0].names:
            if not torch.equal(all_heads(consumers, name, args.tokens, model),
                               all_heads(producers, name, args.tokens, model)):
                raise RuntimeError(f"{pairing}: layer {name} differs after the transfer")
        payload = model.kv_bytes_per_token * _sent_tokens(args, prefill_block)
        return Result(prefill_block, decode_block, prefill_tp, decode_tp, " -> ".join(kernels) if any(kernels) else "",
                      wire, passed_on,
                      model.kv_bytes_per_token * args.tokens, payload, median(seconds))
    finally:
        for engine in producers + consumers:
            engine.close()


def _sent_tokens(args, block_size: int) -> int:
    """Tokens of KV the producer sends: whole blocks, the last one padded."""
    return math.ceil(args.tokens / block_size) * block_size


def sent_bytes(engines: list[Engine]) -> int:
    return sum(peer.bytes_sent for engine in engines for peer in engine.worker.streams.snapshot().peers)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=8192, help="tokens of KV per transfer (default 8192)")
    parser.add_argument("--chunk", type=int, default=2048, help="prefill chunk in tokens (default 2048)")
    parser.add_argument("--rounds", type=int, default=3, help="measured transfers per pairing (default 3)")
    args = parser.parse_args(argv)
    for name in ("tokens", "chunk", "rounds"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be at least 1")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    model = embedded_model()
    print(f"model {model.name}: {model.layers} layers, {model.kv_heads} KV heads of {model.head_size}, "
          f"{model.dtype}: {model.kv_bytes_per_token} B of KV per token; {args.tokens} tokens per transfer, "
          f"chunks of {args.chunk}, {args.rounds} rounds", flush=True)
    results = []
    for pairing in PAIRINGS:
        print("block size {} -> {}, TP {} -> {}".format(*pairing[:4])
              + (" kernel {} -> {}".format(*pairing[4:]) if pairing[4:] else "") + " ...", flush=True)
        results.append(run_pairing(model, pairing, args))
    same = results[0].seconds
    print(f"\n{'pairing':>36} {'KV MB':>8} {'wire MB':>8} {'wire/KV':>8} {'padding':>8} {'framing':>8} "
          f"{'ms':>7} {'GB/s':>6} {'time vs same':>12} {'passed on MB':>12}")
    for r in results:
        padding = (r.payload_bytes - r.kv_bytes) / r.kv_bytes
        framing = (r.wire_bytes - r.payload_bytes) / r.kv_bytes
        print(f"{r.name:>36} {r.kv_bytes / 1e6:>8.1f} {r.wire_bytes / 1e6:>8.1f} "
              f"{r.ratio:>8.4f} {padding:>8.2%} {framing:>8.3%} {r.seconds * 1e3:>7.1f} "
              f"{r.kv_bytes / r.seconds / 1e9:>6.2f} {r.seconds / same:>12.2f} {r.passed_on_bytes / 1e6:>12.1f}")
    worst = max(results, key=lambda r: r.ratio)
    return verdict("hetero layouts: worst wire bytes per KV byte", worst.ratio, TARGET,
                   f"{worst.name}, {len(results)} pairings, {args.tokens} tokens, every token checked",
                   higher_is_better=False)


if __name__ == "__main__":
    raise SystemExit(main())
